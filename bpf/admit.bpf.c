// admit.bpf.c (included by convgpu.bpf.c): admission. Every probed call's entry saves its
// arguments; a call that takes device memory is admitted or stopped before it runs, and
// checked again in its prologue (recheck).
//
// A call that takes device memory reserves its size in its container's state first (atomics,
// so racing threads cannot together overshoot), then compares with the assignment. Over it,
// the process is stopped from here with bpf_send_signal_thread(SIGSTOP): the stop lands when
// the trap returns, before the function body (FACTS.md), and the reservation stays held until the
// call returns, so the enforcer sees what the waiter needs. Nothing here runs unless an
// enforcer is alive: its heartbeat (enforcer/heartbeat.py) older than HEARTBEAT_NS means fail open.

#ifndef HEARTBEAT_NS
#define HEARTBEAT_NS 2000000000ULL
#endif

// A successor owns admission (control.owner is another enforcer's): this program belongs to a
// crashed enforcer whose watchdog still holds its probes, and they detach one by one (~100 ms
// each) after the successor took over. Until then every call hits both programs, newest
// first, so at entry this one steps aside: it would reset the call slot the owner had just
// filled, and the owner's reservation for that call would never be given back (issue 14.3:
// jobs stalled "over limit" for good after a restart). Returns still settle in either program:
// a call that entered before the successor's return probe existed has only this one's.
static __always_inline int retired(void)
{
    u32 k = 0;
    struct cg_control *c = control.lookup(&k);
    return c && c->owner && c->owner != owner();
}

// An enforcer is set up but its heartbeat is stale: it is hung or dead, so the call runs
// unchecked (nobody would resume it). Counted: the enforcer shows the count in its status.
static __always_inline int lapsed(struct cg_control *c)
{
    // signed: a heartbeat stamped a hair "after" this read (another CPU) is fresh, not stale
    if ((s64)(bpf_ktime_get_ns() - c->heartbeat_ns) <= (s64)HEARTBEAT_NS)
        return 0;
    stat_inc(ST_UNCHECKED);
    return 1;
}

// Over the limit: the call can never run, even once every other process and thread of its
// container is gone: its size, what its own thread obtained and still holds, and its
// process's contexts (which no sibling can free) exceed the limit. Anything less is a wait (docs/ENFORCE.md, "Waits"), decided by the
// enforcer per thread. Looked up only on the way to a stop.
static __always_inline u8 stall_op(u32 tgid, s32 dev, u64 size, struct cg_assign *a,
                                   struct cg_thread *t)
{
    struct cg_usage_key k = {.tgid = tgid, .dev = dev};
    struct cg_usage *u = usage.lookup(&k);
    u64 own = (u && u->contexts > 0 ? u->contexts * a->ctx_charge : 0) + (t->live > 0 ? t->live : 0);
    return own + size > a->limit ? OP_OVER_LIMIT : OP_STALL;
}

// Threads inside a wrapper of the enforcer's own shim library (shim_enter .. shim_exit: a
// uprobe and a uretprobe on each admitted wrapper, enforcer/serving/shimprobes.py). Saying
// `hello` on the shim socket proves nothing (any process can); running the wrapper does: it
// asks the enforcer before it calls the driver (issue 24, row 2).
BPF_TABLE("lru_hash", u64, u8, shim_calls, 16384);   // LRU: a thread killed inside never fills it

int shim_enter(struct pt_regs *ctx)
{
    u64 id = bpf_get_current_pid_tgid();
    u8 one = 1;
    shim_calls.update(&id, &one);
    return 0;
}

int shim_exit(struct pt_regs *ctx)
{
    u64 id = bpf_get_current_pid_tgid();
    shim_calls.delete(&id);
    return 0;
}

// Room in its container's quotas (cg_quota) for a call of a placed process: its thread
// (counted here if it was made before the process was placed), its process (made at the
// call's return) and one object. Checked before the call runs, so a container at its quota
// is stopped (or killed, --over-limit kill) and never refused an entry after its call ran.
static __always_inline int quota_ok(u32 tgid, struct cg_thread *t, u64 key, struct cg_control *ctl)
{
    struct cg_quota *s = quotas.lookup(&key);
    if (!s)
        return 1;
    if (!t->quota) {
        struct cg_proc *p = procs.lookup(&tgid);
        if (!p && q_left(s, key, Q_PROCS, ctl) <= 0)
            return 0;
        if (p && !p->quota) {       // made before it was placed (or any enforcer ran): from now on
            u64 pq = q_take(key, Q_PROCS);
            if (pq == Q_DENIED)
                return 0;
            if (__sync_val_compare_and_swap(&p->quota, 0, pq) != 0)
                q_give(pq, Q_PROCS);    // a sibling thread counted it first
        }
        u64 q = q_take(key, Q_THREADS);
        if (q == Q_DENIED)
            return 0;
        t->quota = q;
    }
    return q_left(s, key, Q_OBJS, ctl) > 0;
}

static __always_inline void quota_stop(u64 id, struct cg_thread *t, u16 api, s32 dev, u64 key,
                                       struct cg_control *ctl, int final)
{
    t->call.stalled = 1;            // recheck() lets it go once the container has room
    t->call.want = 0;
    t->call.wdev = dev;
    stop_then_tell(id, api, OP_QUOTA, 0, dev, key, 0, 0, ctl, final);
}

// At the entry of a call that takes `size` bytes (a context: the per-context overhead).
static __always_inline void admit(u64 id, struct cg_thread *t, u16 api, s32 dev, u64 size,
                                  int is_ctx, struct cg_control *ctl)
{
    if (lapsed(ctl))
        return;
    u32 tgid = id >> 32;
    if (tgid == ctl->exempt || tgid == ctl->measuring)
        return;
    // A process under the preload shim asks the enforcer before each allocation and waits in
    // the shim (or gets an out-of-memory error): a call made from inside a shim wrapper is
    // not stopped for its assignment, only above its limit (its credit page is its own to
    // scribble on). Its other calls are admitted as anyone's.
    u64 *m = members.lookup(&tgid);     // one lookup for that and for its container's state
    int shim = m && (*m & SHIM_MEMBER) && shim_calls.lookup(&id);
    if (is_ctx)
        size = ctl->ctx_overhead;
    u64 key = 0;
    struct cg_cgstate *s = member_state(m, dev, &key);
    struct cg_limit_key lk = {.container = key, .dev = dev};
    struct cg_assign *a = s ? assign.lookup(&lk) : 0;
    if (shim && !a)                 // placed at its hello: a GPU the enforcer does not manage
        return;
    t->call.want = size;
    t->call.wdev = dev;
    if (!a) {                       // not placed yet: wait for the enforcer to place it
        t->call.stalled = 1;
        stop_then_tell(id, api, OP_UNKNOWN, t->call.ordinal ? EF_ORDINAL : 0, dev, key, size, 0,
                       ctl, 0);
        return;
    }
    if (!quota_ok(tgid, t, key, ctl)) {
        quota_stop(id, t, api, dev, key, ctl, 0);
        t->call.want = size;
        return;
    }
    u64 r = __sync_fetch_and_add(&s->reserved, size) + size;
    t->call.reserved = size;
    t->call.container = key;
    t->call.rdev = dev;
    u64 total = charged(s, a, ctl) + r;
    if (total <= (shim ? a->limit : a->assigned))
        return;
    __sync_fetch_and_add(&s->stalls, 1);
    t->call.stalled = 1;
    // A stopped call holds no reservation: its siblings' calls must not stop on it, and a
    // sibling resumed first must pass its recheck. The recheck reserves again before it
    // compares, so racing threads still cannot pass together (the event carries the size).
    release(&t->call);
    stop_then_tell(id, api, stall_op(tgid, dev, size, a, t), 0, dev, key, size, total, ctl, 0);
}

// In the prologue of every admitted call, on the first emulated instruction after the entry
// (probes/prologue.py: push %r12 at +4 on driver 580). A call stopped at entry gets here once the
// process runs again: after the enforcer's grant (then it fits), or after a SIGCONT from anyone
// allowed to signal the process, e.g. a sibling in its container. Either way this runs before
// the call's body can allocate, so an unauthorized resume is stopped again here.
int recheck(struct pt_regs *ctx)
{
    u64 id = bpf_get_current_pid_tgid();
    struct cg_thread *t = threads.lookup(&id);
    if (!t || !t->call.stalled || retired())
        return 0;
    struct cg_control *ctl = enforcing();
    if (!ctl || lapsed(ctl)) {      // fail open: no enforcer, nothing holds it
        t->call.stalled = 0;
        held.delete(&id);
        return 0;
    }
    u32 tgid = id >> 32;
    s32 dev = t->call.wdev;
    if (t->call.ordinal)            // stopped for its placement, which mapped its ordinals
        t->call.wdev = dev = host_of(tgid, dev, t);
    u64 key = 0;
    struct cg_cgstate *s = state_of(tgid, dev, &key);
    struct cg_limit_key lk = {.container = key, .dev = dev};
    struct cg_assign *a = s ? assign.lookup(&lk) : 0;
    u8 op = OP_UNKNOWN, kept = 0;
    u64 total = 0;
    if (a && !quota_ok(tgid, t, key, ctl)) {
        op = OP_QUOTA;
    } else if (a) {
        if (!t->call.reserved) {    // stopped before it was placed: reserve like admit()
            __sync_fetch_and_add(&s->reserved, t->call.want);
            t->call.reserved = t->call.want;
            t->call.container = key;
            t->call.rdev = dev;
        }
        total = charged(s, a, ctl) + s->reserved;
        if (total <= a->assigned) {
            t->call.stalled = 0;
            held.delete(&id);
            return 0;
        }
        // Stopped again, it keeps its reservation: once let go it runs on from here, past this
        // check, and a sibling's call admitted meanwhile must see it (before, it ran unreserved:
        // eight CuPy threads on the H100 had five 256 MiB blocks live under a limit fitting
        // four, the freeing thread's next call admitted beside it). Over its limit it can
        // never fit: that holds nothing (admit()).
        op = stall_op(tgid, dev, t->call.want, a, t);
        if (op == OP_STALL)
            kept = EF_RESERVED;
        else
            release(&t->call);
    }
    stop_then_tell(id, t->call.api, op, EF_RESTALL | kept | (t->call.ordinal ? EF_ORDINAL : 0), dev,
                   key, t->call.want, total, ctl, 1);
    return 0;
}

// ---- sizes: what a call takes from the GPU (at its entry and at its return) ----

static __always_inline u64 elem_size(u32 fmt)
{
    switch (fmt) {
    case 0x01: case 0x08: case 0xc0: return 1;          // 8-bit ints, UNORM_INT8X1
    case 0x02: case 0x09: case 0x10: case 0xc1: case 0xc3: return 2;
    case 0x03: case 0x0a: case 0x20: case 0xc2: case 0xc4: return 4;
    case 0xc5: return 8;
    default: return 4;              // others are compressed/planar: estimate
    }
}

struct desc3d {                     // CUDA_ARRAY3D_DESCRIPTOR (CUDA_ARRAY_DESCRIPTOR = W,H,fmt,nch)
    u64 w, h, d;
    u32 fmt, nch, flags, pad;
};

// max(x, 1) without a branch: the mipmap loop below must not double the verifier's paths
// at every level.
static __always_inline u64 max1(u64 x)
{
    return x | ((x - 1) >> 63);
}

// What an array takes, from its descriptor (the driver pads rows: an estimate, EF_ESTIMATE).
// CUresult cuArrayCreate_v2(CUarray *pHandle, const CUDA_ARRAY_DESCRIPTOR *desc)
// CUresult cuArray3DCreate_v2(CUarray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *desc)
// CUresult cuMipmappedArrayCreate(CUmipmappedArray *pHandle,
//                                 const CUDA_ARRAY3D_DESCRIPTOR *desc, unsigned levels)
static __always_inline u64 array_bytes(u16 api, u64 desc, u32 levels)
{
    struct desc3d d = {};
    u64 bytes = 0;
    if (api != API_cuMipmappedArrayCreate)
        levels = 1;
    if (api == API_cuArrayCreate_v2) {     // {W, H, Format, NumChannels}: no depth
        bpf_probe_read_user(&d, 16, (void *)desc);
        bpf_probe_read_user(&d.fmt, 8, (void *)(desc + 16));
    } else {
        bpf_probe_read_user(&d, sizeof(d), (void *)desc);
    }
    u64 texel = elem_size(d.fmt) * max1(d.nch);
#pragma unroll
    for (int l = 0; l < 16; l++) {      // each mip level halves every dimension
        if (l < levels)
            bytes += max1(d.w >> l) * max1(d.h >> l) * max1(d.d >> l) * texel;
    }
    return launder(bytes);
}

// Calls admitted at their entry (probes/table.py ADMITTED): each one that takes device memory
// (issue 33: arrays were only accounted at their return, and 8 x 512 MiB arrays ran under a
// 256 MiB limit). Resolved at compile time: on_enter is inlined with a constant api.
static __always_inline int admitted(u16 api)
{
    switch (api) {
    case API_cuMemAlloc_v2: case API_cuMemAllocPitch_v2: case API_cuMemAllocManaged:
    case API_cuMemCreate: case API_cuMemAllocAsync: case API_cuMemAllocAsync_ptsz:
    case API_cuMemAllocFromPoolAsync: case API_cuMemAllocFromPoolAsync_ptsz:
    case API_cuArrayCreate_v2: case API_cuArray3DCreate_v2: case API_cuMipmappedArrayCreate:
    case API_cuDevicePrimaryCtxRetain: case API_cuCtxCreate_v2: case API_cuCtxCreate_v3:
    case API_cuCtxCreate_v4:
    // memory that is not an allocation, sized at the entry where it can be (indirect.bpf.c)
    case API_cuCtxSetLimit: case API_cuGraphInstantiateWithFlags: case API_cuGraphInstantiateWithParams:
    case API_cuGraphInstantiateWithParams_ptsz: case API_cuGraphInstantiate_v2:
    case API_cuModuleLoadData: case API_cuModuleLoadDataEx: case API_cuLibraryLoadData:
        return 1;
    }
    return 0;
}

// ---- entry: save the arguments; admit the calls that take device memory ----

// Which calls take device memory, how much, and on which device, read at entry.
static __always_inline void admit_call(struct pt_regs *ctx, u64 id, struct cg_thread *t, u16 api,
                                       struct cg_control *ctl)
{
    u32 tgid = id >> 32;
    // the thread is at hand; its process is looked up only when the thread has no device
    s32 dev = dev_of(t, t->dev >= 0 ? 0 : procs.lookup(&tgid));
    s32 loc[2] = {};
    switch (api) {
    case API_cuMemAlloc_v2: case API_cuMemAllocManaged: case API_cuMemAllocAsync:
    case API_cuMemAllocAsync_ptsz: case API_cuMemAllocFromPoolAsync:
    case API_cuMemAllocFromPoolAsync_ptsz:
        admit(id, t, api, dev, footprint(PT_REGS_PARM2(ctx)), 0, ctl);
        break;
    case API_cuMemAllocPitch_v2:    // the pitch is known only at return: width x height
        admit(id, t, api, dev, footprint(PT_REGS_PARM3(ctx) * PT_REGS_PARM4(ctx)), 0, ctl);
        break;
    case API_cuArrayCreate_v2: case API_cuArray3DCreate_v2: case API_cuMipmappedArrayCreate:
        admit(id, t, api, dev, array_bytes(api, PT_REGS_PARM2(ctx), PT_REGS_PARM3(ctx)), 0, ctl);
        break;
    case API_cuMemCreate:
        bpf_probe_read_user(loc, sizeof(loc), (void *)(PT_REGS_PARM3(ctx) + 8));
        admit(id, t, api, loc[0] == 1 ? host_of(tgid, loc[1], t) : dev, PT_REGS_PARM2(ctx), 0,
              ctl);
        break;
    case API_cuDevicePrimaryCtxRetain: {
        dev = host_of(tgid, (s32)PT_REGS_PARM2(ctx), t);
        struct cg_obj_key pk = {.tgid = tgid, .ns = NS_PRIMARY, .addr = dev};
        if (!objs.lookup(&pk))      // a second retain costs nothing
            admit(id, t, api, dev, 0, 1, ctl);
        break;
    }
    case API_cuCtxCreate_v2:
        admit(id, t, api, host_of(tgid, (s32)PT_REGS_PARM3(ctx), t), 0, 1, ctl);
        break;
    case API_cuCtxCreate_v3:
        admit(id, t, api, host_of(tgid, (s32)PT_REGS_PARM5(ctx), t), 0, 1, ctl);
        break;
    case API_cuCtxCreate_v4:
        admit(id, t, api, host_of(tgid, (s32)PT_REGS_PARM4(ctx), t), 0, 1, ctl);
        break;
    case API_cuCtxSetLimit: case API_cuGraphInstantiateWithFlags: case API_cuGraphInstantiateWithParams:
    case API_cuGraphInstantiateWithParams_ptsz: case API_cuGraphInstantiate_v2:
    case API_cuModuleLoadData: case API_cuModuleLoadDataEx: case API_cuLibraryLoadData: {
        // not an allocation: sized where it can be (indirect.bpf.c)
        u64 size = indirect_size(t, api, tgid, &dev);
        if (size)
            admit(id, t, api, dev, size, 0, ctl);
        break;
    }
    }
}

// A forwarded call's state (cg_thread.fwd): FWD_INNER, the call in the slot is the inner entry
// of the one it overwrote; FWD_OPEN, how many outer calls are still open under it.
#define FWD_INNER 0x8000
#define FWD_OPEN 0x7fff

// How many arguments an admitted call has (the slot keeps five): a forwarder passes them all
// alike, and past its own a register holds whatever its caller left there. Resolved at compile
// time, as admitted().
static __always_inline int arity(u16 api)
{
    switch (api) {
    case API_cuMemAllocPitch_v2: case API_cuCtxCreate_v3: case API_cuGraphInstantiate_v2:
    case API_cuModuleLoadDataEx: case API_cuLibraryLoadData:
        return 5;
    case API_cuMemCreate: case API_cuMemAllocFromPoolAsync: case API_cuMemAllocFromPoolAsync_ptsz:
    case API_cuCtxCreate_v4:
        return 4;
    case API_cuMemAllocManaged: case API_cuMemAllocAsync: case API_cuMemAllocAsync_ptsz:
    case API_cuMipmappedArrayCreate: case API_cuCtxCreate_v2: case API_cuGraphInstantiateWithFlags:
    case API_cuGraphInstantiateWithParams: case API_cuGraphInstantiateWithParams_ptsz:
        return 3;
    }
    return 2;
}

// The call in the slot has this entry's arguments: all an admitted call has, the first two of
// any other. An inner call that asks otherwise (a taller pitch, a VMM handle on another GPU) is
// no forward: the slot keeps the inner call's arguments, and an outer block settled with them
// would be charged the inner call's size or GPU.
static __always_inline int same_call(struct pt_regs *ctx, struct cg_call *c, u16 api)
{
    int n = admitted(api) ? arity(api) : 2;
    return c->a0 == PT_REGS_PARM1(ctx) && c->a1 == PT_REGS_PARM2(ctx) &&
           (n < 3 || c->a2 == PT_REGS_PARM3(ctx)) && (n < 4 || c->a3 == PT_REGS_PARM4(ctx)) &&
           (n < 5 || c->a4 == PT_REGS_PARM5(ctx));
}

static __always_inline void lost_free(u64 id, struct cg_thread *t);   // frees.bpf.c

// The thread's entry, with this call recorded in it; 0 where nothing was recorded.
static __always_inline struct cg_thread *call_enter(struct pt_regs *ctx, u16 api)
{
    u64 id = bpf_get_current_pid_tgid();
    count_hit(api);
    if ((id >> 32) == self_tgid() || retired())
        return 0;
    // A process the enforcer has not placed makes an entry only at an admitted call, which
    // stops it until it is placed (and counted): before, any probed call made one counted
    // nowhere, and threads that only called cuMemGetInfo_v2 filled the map (issue 33, attack 5).
    int denied = 0;
    struct cg_thread *t = get_thread(id, admitted(api), &denied);
    struct cg_control *ctl = enforcing();
    if (!t) {                       // no call that needs an entry runs untracked
        u64 key = ctl ? member_key(id >> 32) : 0;
        if (ctl && denied)          // its container is at its thread quota
            kill_unchecked(id, api, OP_QUOTA, 0, 0, key, 0, 0, UNTRACKED);
        else if (ctl && (key || admitted(api)) && !lapsed(ctl))    // the map is full
            kill_unchecked(id, api, OP_FULL, 0, 0, key, 0, 0, UNTRACKED);
        return 0;
    }
    if (t->call.stalled)            // its last call was stopped and is long over (no recheck probe)
        held.delete(&id);
    lost_free(id, t);               // a free the enforcer before us saw enter is over too
    // The same call with the same arguments still open on this thread, entered in another
    // library: that call, forwarded. A library that exports the driver's names and calls the
    // driver with its own arguments (a copy of the shim, which discovery must probe as a
    // driver; an interposer such as HAMi-core) is admitted at its entry and again here. This
    // entry is the one admitted, so the outer reservation is given back now; kept, it stayed
    // counted for good, and every pod, whose shim is such a copy, was held short of its claim
    // (docs/ENFORCE.md, "Forwarded calls"). The release is earned at the outer return
    // (forward_return): the inner call's reservation waits there, and a result that is not the
    // inner call's is an allocation of the outer call's own, charged (two probed driver
    // copies, the second called from a signal handler while the first ran: 400 MiB held, 200
    // charged). Any other nesting leaves the open reservation counted, too much held but never
    // too little: an interposer that passes arguments of its own, a call from a signal
    // handler at the same site, or any call between an inner return and its outer's.
    u32 site = PT_REGS_IP(ctx);
    u16 fwd = 0;
    if (t->call.api == api && t->call.site != site && same_call(ctx, &t->call, api)) {
        release(&t->call);
        u16 n = t->fwd & FWD_OPEN;  // outer calls open: one more if the open call was an inner one
        if (admitted(api))
            fwd = FWD_INNER | (t->fwd & FWD_INNER ? (n < FWD_OPEN ? n + 1 : n) : n ? n : 1);
    }
    t->fwd = fwd;
    t->call.site = site;
    t->call.a0 = PT_REGS_PARM1(ctx);
    t->call.a1 = PT_REGS_PARM2(ctx);
    t->call.a2 = PT_REGS_PARM3(ctx);
    t->call.a3 = PT_REGS_PARM4(ctx);
    t->call.a4 = PT_REGS_PARM5(ctx);
    t->call.api = api;
    t->call.reserved = 0;
    t->call.stalled = 0;
    graph_node_enter(ctx, t, api, id >> 32);   // a graph's memory node: read while it is at hand
    limit_enter(t, api, id);                    // a limit's context, likewise
    if (!ctl)
        return t;
    u64 key = t->quota ? 0 : member_key(id >> 32);  // a thread made before its process was placed
    if (key && !quota_ok(id >> 32, t, key, ctl))
        quota_stop(id, t, api, dev_of(t, 0), key, ctl, !admitted(api));
    else
        admit_call(ctx, id, t, api, ctl);
    return t;
}

// (A classic uprobe program's return is not ignored: nonzero would submit a perf sample.)
static __always_inline int on_enter(struct pt_regs *ctx, u16 api)
{
    call_enter(ctx, api);
    return 0;
}

#define ENTER(name) int enter_##name(struct pt_regs *ctx) { return on_enter(ctx, API_##name); }
ENTER(cuMemAlloc_v2) ENTER(cuMemAllocPitch_v2) ENTER(cuMemAllocManaged)
ENTER(cuMemCreate) ENTER(cuMemMap) ENTER(cuMemUnmap)
ENTER(cuMemAddressReserve) ENTER(cuMemAddressFree)
ENTER(cuMemAllocAsync) ENTER(cuMemAllocAsync_ptsz) ENTER(cuMemAllocFromPoolAsync)
ENTER(cuMemAllocFromPoolAsync_ptsz)
ENTER(cuArrayCreate_v2) ENTER(cuArray3DCreate_v2) ENTER(cuMipmappedArrayCreate)
ENTER(cuDevicePrimaryCtxRetain) ENTER(cuDevicePrimaryCtxRelease_v2)
ENTER(cuCtxCreate_v2) ENTER(cuCtxCreate_v3) ENTER(cuCtxCreate_v4) ENTER(cuCtxDestroy_v2)
ENTER(cuMemGetInfo_v2)
