#!/bin/sh
# check-prologue.sh [--driver] LIB PREFIX [EXPECTED_SYMBOL...]
#
# Fails unless every exported function of LIB whose name starts with PREFIX
# begins with `push %rbp`, and every EXPECTED_SYMBOL is exported. --driver:
# the prologue must be the real driver's, `push %rbp; mov %rsp,%rbp; push %r12`.
#
# Why: the real libcuda.so.1's entry points start with push %rbp, which
# x86 uprobes emulate in the kernel; a different first instruction (endbr64,
# sub $x,%rsp from -O2 leaf functions...) is single-stepped instead, roughly
# 16x slower, which would skew every probe-overhead measurement made on the
# stand-in. The enforcer's recheck probe goes on the first emulated instruction
# after the entry (probes/prologue.py): push %r12 at +4 in the driver (580), so
# the stand-in driver must have it there too, or enforced-mode benchmarks on
# the CPU machine measure a single-stepped recheck the H100 no longer has.
set -eu
want="push %rbp"
if [ "${1:-}" = "--driver" ]; then
    want="push %rbp; mov %rsp,%rbp; push %r12"
    shift
fi
lib=$1
prefix=$2
shift 2

tmp=$(mktemp)
trap 'rm -f "$tmp"' EXIT

# "name insn; insn; insn" (as many as $want has) for every function in the disassembly.
n=$(echo "$want" | awk -F';' '{ print NF }')
objdump -d --no-show-raw-insn "$lib" | awk -v n="$n" '
    /^[0-9a-f]+ <.*>:$/ { name = $2; gsub(/[<>:]/, "", name); left = n; line = ""; next }
    left > 0 && /^ *[0-9a-f]+:\t/ {
        sub(/^ *[0-9a-f]+:\t/, ""); gsub(/[ \t]+/, " "); sub(/ +$/, "")
        line = line == "" ? $0 : line "; " $0
        if (--left == 0) print name, line
    }' > "$tmp"

status=0
count=0
for sym in $(nm -D --defined-only "$lib" | awk '$2 == "T" { print $3 }' | grep "^$prefix" || true); do
    count=$((count + 1))
    first=$(awk -v s="$sym" '$1 == s { $1 = ""; sub(/^ /, ""); print; exit }' "$tmp")
    case "$first" in
    "$want") ;;
    *)
        echo "check-prologue: $lib: $sym starts with '$first', not '$want'" >&2
        status=1
        ;;
    esac
done
for sym in "$@"; do
    if ! nm -D --defined-only "$lib" | awk '$2 == "T" { print $3 }' | grep -qx "$sym"; then
        echo "check-prologue: $lib: $sym is not exported" >&2
        status=1
    fi
done
if [ "$count" -eq 0 ]; then
    echo "check-prologue: $lib: no exported $prefix* functions" >&2
    status=1
fi
[ "$status" -eq 0 ] && echo "check-prologue: $lib: $count $prefix* functions start with $want"
exit $status
