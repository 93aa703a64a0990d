#!/bin/sh
# check-prologue.sh LIB PREFIX [EXPECTED_SYMBOL...]
#
# Fails unless every exported function of LIB whose name starts with PREFIX
# begins with `push %rbp`, and every EXPECTED_SYMBOL is exported.
#
# Why: the real libcuda.so.1's entry points start with push %rbp, which
# x86 uprobes emulate in the kernel; a different first instruction (endbr64,
# sub $x,%rsp from -O2 leaf functions...) is single-stepped instead, roughly
# 16x slower, which would skew every probe-overhead measurement made on the
# stand-in.
set -eu
lib=$1
prefix=$2
shift 2

tmp=$(mktemp)
trap 'rm -f "$tmp"' EXIT

# "name first-instruction" for every function in the disassembly.
objdump -d --no-show-raw-insn "$lib" | awk '
    /^[0-9a-f]+ <.*>:$/ { name = $2; gsub(/[<>:]/, "", name); want = 1; next }
    want && /^ *[0-9a-f]+:\t/ {
        sub(/^ *[0-9a-f]+:\t/, ""); gsub(/[ \t]+/, " "); print name, $0; want = 0
    }' > "$tmp"

status=0
count=0
for sym in $(nm -D --defined-only "$lib" | awk '$2 == "T" { print $3 }' | grep "^$prefix" || true); do
    count=$((count + 1))
    first=$(awk -v s="$sym" '$1 == s { $1 = ""; sub(/^ /, ""); print; exit }' "$tmp")
    case "$first" in
    "push %rbp") ;;
    *)
        echo "check-prologue: $lib: $sym starts with '$first', not 'push %rbp'" >&2
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
[ "$status" -eq 0 ] && echo "check-prologue: $lib: $count $prefix* functions start with push %rbp"
exit $status
