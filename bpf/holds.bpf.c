// holds.bpf.c (included by convgpu.bpf.c): how BPF stops a thread, and tells the enforcer.
// Every stop is listed in `held` before the signal goes (a watchdog finds it if the enforcer
// dies). A call that cannot be checked is killed here, and only here (kill_unchecked).

#define SIGKILL 9
#define SIGSTOP 19

// The pid of the process tracing the current thread, if that is not convgpu (whose ptrace
// holder, enforcer/failsafe/threadhold.py, only ever keeps a stop); 0 if none. A tracer sees a
// SIGSTOP before its tracee and may swallow it: issue 33, attack 2 (a PTRACE_SEIZE loop, no
// privilege needed, dropped 30 stops and took 2,048 MiB under 256 MiB). Read from the task
// itself (offsets from the kernel's BTF, probes/btf.py), only on the way to a stop.
static __always_inline u32 foreign_tracer(void)
{
    u32 k = 0;
    struct cg_config *c = config.lookup(&k);
    if (!c || !c->task_ptrace)
        return 0;
    u64 task = bpf_get_current_task(), parent = 0;
    u32 ptraced = 0;
    s32 tgid = 0;
    bpf_probe_read_kernel(&ptraced, sizeof(ptraced), (void *)(task + c->task_ptrace));
    if (!ptraced)
        return 0;
    bpf_probe_read_kernel(&parent, sizeof(parent), (void *)(task + c->task_parent));  // the tracer
    bpf_probe_read_kernel(&tgid, sizeof(tgid), (void *)(parent + c->task_tgid));
    return (u32)tgid == c->self_tgid ? 0 : tgid > 0 ? (u32)tgid : 1;
}

// Fail closed (STYLE.md 18): a call that cannot be checked dies; it never runs unchecked. The
// one place that decides it, for every path where that may be so; reason:
//   LAST_CHECK: no later check sees this call before its body runs (the recheck's own stop, or
//     a stop at the entry of a call without a recheck). It cannot be checked if a process other
//     than convgpu traces its thread: a tracer sees the SIGSTOP first and may swallow it
//     (foreign_tracer). Killed only then, with a SIGKILL, which no tracer can stop.
//   UNTRACKED: the call has no `threads` entry (its thread past its container's thread quota,
//     or the map full, OP_FULL): nothing can check or account it later (resumed, it ran
//     unreserved and its bytes counted nowhere). Killed, traced or not.
// The event says which: EF_TRACED and the tracer's pid as its result, else result 0. Listed in
// `held` first, as every stop is. Returns whether it killed.
#define LAST_CHECK 1
#define UNTRACKED 2
static __always_inline int kill_unchecked(u64 id, u16 api, u8 op, u8 flags, s32 dev, u64 key,
                                          u64 size, u64 total, int reason)
{
    u32 tracer = foreign_tracer();
    if (!tracer && reason != UNTRACKED)
        return 0;
    u64 why = (u32)bpf_ktime_get_ns() | 1;
    held.update(&id, &why);
    bpf_send_signal_thread(SIGKILL);
    emit_flags(id, api, op, flags | (tracer ? EF_TRACED : 0), dev, key, size, total, tracer,
               BPF_RB_FORCE_WAKEUP);
    return 1;
}

// The stop is sent before the event that tells the enforcer, never after: the enforcer may
// answer an event at once (a first context is placed and resumed within a millisecond) on
// another CPU, and a SIGCONT sent before the SIGSTOP is generated would be lost, leaving the
// process stopped for good. Sent first, the SIGSTOP is pending or taken when the event can be
// read, and the enforcer's SIGCONT discards or undoes it.
// final: no later check sees this call before its body runs (kill_unchecked, LAST_CHECK).
// --over-limit kill: a call over its limit or its container's quota is killed, not stopped
// (a policy the operator chose; the call could be checked).
static __always_inline void stop_then_tell(u64 id, u16 api, u8 op, u8 flags, s32 dev, u64 key,
                                           u64 size, u64 total, struct cg_control *ctl, int final)
{
    if (final && kill_unchecked(id, api, op, flags, dev, key, size, total, LAST_CHECK))
        return;
    // To this thread: a SIGSTOP sent to the process merges with one already pending for it,
    // which may be another thread's to take, and this thread would then return to its call
    // before that group stop reached it. Taken here, it stops the whole process all the same.
    // The stop's number (never 0, below HELD_OPEN), in `held` and the event: the enforcer's
    // release names the stop it ends, so a late one never lets a later stop's call run
    // (enforcer/failsafe/threadhold.py holds the thread under ptrace).
    u64 why = (u32)bpf_ktime_get_ns() | 1;
    int kill = (op == OP_OVER_LIMIT || op == OP_QUOTA) && ctl->over_limit_kill;
    held.update(&id, &why);         // listed before it stops: the watchdog always finds it
    bpf_send_signal_thread(kill ? SIGKILL : SIGSTOP);
    emit_flags(id, api, op, flags, dev, key, size, total, (u32)why, BPF_RB_FORCE_WAKEUP);
}
