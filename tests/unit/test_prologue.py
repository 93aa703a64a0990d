"""Where the enforcer's recheck probe goes (probes/prologue.py): the first instruction after the
entry that the kernel emulates, within the straight-line prologue, from real prologues."""
from convgpu.probes import prologue

# cuMemAlloc_v2 of the driver 580.159.04 on the H100 (dumped 2026-11-25): push %rbp;
# mov %rsp,%rbp; push %r12; sub $8,%rsp; cmpl $0x..,(%rip)
DRIVER_580 = bytes.fromhex("554889e5415448 83ec08 813d00000000".replace(" ", ""))


def test_the_driver_580_prologue_rechecks_on_push_r12():
    assert prologue.prologue(DRIVER_580) == [(0, "emulated"), (1, "stepped"), (4, "emulated"),
                                             (6, "stepped")]
    assert prologue.recheck_site(DRIVER_580) == (4, "emulated")


def test_endbr64_first_then_push_rbp():
    b = bytes.fromhex("f30f1efa554889e5")          # -fcf-protection builds
    assert prologue.classify(b) == ("stepped", 4)
    assert prologue.recheck_site(b) == (4, "emulated")


def test_pushes_in_a_row_recheck_on_the_second():
    assert prologue.recheck_site(bytes.fromhex("5541574156")) == (1, "emulated")   # push rbp, r15, r14
    assert prologue.recheck_site(bytes.fromhex("554889e5")) == (1, "stepped")      # nothing emulated


def test_fallback_is_the_second_instruction_and_unknown_lengths_stop_the_decoding():
    # push %rbp; mov %rsp,%rbp; sub $0x20,%rsp; push %rbx: the push after the sub is not trusted
    b = bytes.fromhex("554889e54883ec2053")
    assert prologue.recheck_site(b) == (1, "stepped")
    # an unknown first instruction: no place known to be before the body
    assert prologue.recheck_site(bytes.fromhex("4883ec28")) is None
    # a lock prefix second: the kernel would never install that probe
    assert prologue.recheck_site(bytes.fromhex("55f0ff05")) is None
    assert prologue.classify(bytes.fromhex("f0ff05")) == ("unprobeable", None)
    assert prologue.classify(b"") == ("unknown", None)
