// swap.bpf.c (included by convgpu.bpf.c): a swapped process's next driver call (issue 46).
// The driver checkpointed the process's GPU memory to host memory and keeps it locked: its
// next CUDA call blocks inside the driver until the enforcer restores and unlocks it
// (enforcer/swap/). An admitted call (an allocation, a context) is stopped at its entry as any
// call over its container's charge, and the enforcer hears that. Any other call (a launch, a
// copy, a synchronize) would only block in the driver, unheard: so while some process is
// swapped the enforcer attaches `touch` to the driver's most used entry points (probes/table.py
// TOUCH), and a swapped process's first call there tells it, once. Detached when none is
// swapped: a launch pays no trap otherwise.

// tgid -> 0: swapped, its next call not told yet; 1: told (the enforcer writes and deletes)
BPF_HASH(swapped, u32, u64, 4096);

int touch(struct pt_regs *ctx)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32;
    u64 *told = swapped.lookup(&tgid);
    if (!told || *told)
        return 0;
    *told = 1;                      // two threads at once: two events, taken as one
    emit_flags(id, 0, OP_TOUCH, 0, -1, 0, 0, 0, 0, BPF_RB_FORCE_WAKEUP);
    return 0;
}
