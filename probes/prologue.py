"""What a uprobe costs where it sits: the x86 instructions the kernel emulates (no single-step)
and, for the enforcer's recheck probe, the cheapest place in a function's prologue.

A probe on a `push` is emulated by the kernel (about 0.5 us a hit here, 1 us on the H100 VM);
any other instruction is single-stepped, which exits to the hypervisor (about 16 us here, 6 us
on the H100: FACTS.md). The driver's entry points (580.159.04) all begin
`55` push %rbp; `48 89 e5` mov %rsp,%rbp; `41 54` push %r12; `48 83 ec 08` sub $8,%rsp: the
recheck used to sit on the second instruction, the mov, and cost a single-step per allocation
(most of the enforced path's +9.3 us there). Any instruction of the straight-line prologue
before the body is as good a place: saving registers and setting up the frame change nothing
the body or anyone else could see, so a call stopped at entry is still caught before it runs."""

ENDBR64 = bytes.fromhex("f30f1efa")
MOV_RSP_RBP = (bytes.fromhex("4889e5"), bytes.fromhex("488bec"))   # both encodings of mov %rsp,%rbp
PROLOGUE_BYTES = 16   # read from each symbol: the prologues drivers start with are shorter


def classify(b: bytes) -> tuple[str, int | None]:
    """(class, length) of the instruction at the start of b, for the prologue instructions only:
    'emulated' (push reg, push r8-r15), 'stepped' (mov %rsp,%rbp, endbr64, or anything else:
    length None, not decoded), 'unprobeable' (a lock prefix: the kernel refuses to install it)."""
    if not b:
        return "unknown", None
    if b[0] == 0xF0:
        return "unprobeable", None
    if 0x50 <= b[0] <= 0x57:
        return "emulated", 1                # push %rax..%rdi (55: push %rbp)
    if len(b) > 1 and b[0] == 0x41 and 0x50 <= b[1] <= 0x57:
        return "emulated", 2                # push %r8..%r15 (41 54: push %r12)
    if b[:3] in MOV_RSP_RBP:
        return "stepped", 3
    if b[:4] == ENDBR64:
        return "stepped", 4
    return "stepped", None


def prologue(b: bytes) -> list[tuple[int, str]]:
    """(offset, class) of each instruction of the straight-line prologue at the start of b, up to
    and including the first one that is not a push, mov %rsp,%rbp or endbr64 (its class is
    known, its length is not: nothing after it is decoded)."""
    out, at = [], 0
    while at < len(b):
        kind, n = classify(b[at:])
        out.append((at, kind))
        if n is None:
            break
        at += n
    return out


def recheck_site(b: bytes) -> tuple[int, str] | None:
    """Where the recheck probe goes: (offset, class). The first emulated instruction after the
    entry within the prologue; else the second instruction (single-stepped: the old place);
    None when the first instruction's length is unknown (no place known to be before the body)."""
    insns = prologue(b)
    for off, kind in insns[1:]:
        if kind == "emulated":
            return off, kind
    if len(insns) > 1 and insns[1][1] != "unprobeable":
        return insns[1]
    return None
