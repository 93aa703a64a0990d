// frees.bpf.c (included by convgpu.bpf.c): frees and handles. A pointer's block or a handle's
// object leaves `objs` at the call's entry and the books at its return (or at the entry, where
// that cannot matter: settle_now); a failed call puts it back.

// CUresult cuMemFree_v2(CUdeviceptr dptr); cuMemFreeAsync(CUdeviceptr dptr, CUstream hStream)
// Settled at the return where it matters: until the driver has given the memory back it is on
// the card, and its container's. Settled at the entry (as before, to spare a return trap), a
// thread stopped at an allocation was resumed into the room while the free still ran: on the
// stand-in with a 20 ms free, eight threads taking turns under a limit fitting four had all
// eight blocks live at once; on the H100 eight CuPy threads, five (a 256 MiB cuMemFree takes
// milliseconds there). A thread the thread quota leaves no entry for is settled at entry.
//
// Where it cannot matter it is settled at the entry, and with a uprobe session (Linux >= 6.13,
// free_session) the return is then never trapped at all: issue 32, a no-caching framework's
// free paid a return trap and a program for nothing. It cannot matter while nobody waits (no
// stalled call can be resumed into the room) and its container keeps room to spare
// (settle_now), and the block is small: a sibling's allocation admitted while the driver still
// frees can then overshoot, for the microseconds of a small free, by that block at most, and
// only by asking for more than the spare room. A block above SETTLE_NOW_MAX always settles at
// its return: its free takes the driver far longer than a return trap, so sparing the trap
// saves nothing there, while a container racing its own large free with an allocation could
// have held both for milliseconds.
#define SPARE_SHIFT 3       // the spare room: an eighth of the container's assignment...
#define SPARE_BLOCKS 2      // ...and at least twice the block being freed
#define SETTLE_NOW_MAX DEV_PAGE
static __always_inline int settle_now(u32 tgid, struct cg_obj *o, struct cg_control *ctl)
{
    if (!ctl)                       // tracing only: no limit to keep
        return 1;
    if (ctl->waiters || o->size > SETTLE_NOW_MAX)
        return 0;
    u64 key = 0;
    struct cg_cgstate *s = state_of(tgid, o->dev, &key);
    struct cg_limit_key lk = {.container = key, .dev = o->dev};
    struct cg_assign *a = s ? assign.lookup(&lk) : 0;
    if (!a)                         // charged nowhere: nothing to keep exact
        return 1;
    u64 taken = charged(s, a, ctl) + s->reserved;   // the block included: it is still charged
    u64 spare = a->assigned >> SPARE_SHIFT;
    if (spare < SPARE_BLOCKS * o->size)
        spare = SPARE_BLOCKS * o->size;
    return taken + spare <= a->assigned;
}

// What a free's or a release's entry did with its object (cg_thread.free_how, its low byte;
// above it, the stamp of the enforcer whose program made the stash: lost_free).
#define STASH_FREE 1                // a pointer's block, out of objs: settled at the return
#define STASH_TAKEN 2               // a handle's object, out of objs: dropped at the return, or put back
#define STASH_MARKED 3              // a handle still mapped, marked released (undone if the call fails)
#define STASH_HOW(t) ((t)->free_how & 0xff)
#define STASH_STAMP (owner() << 8)  // the low 24 bits of its owner (0: tracing only, or older programs)
static __always_inline void stash(struct cg_thread *t, u64 key, u16 api, struct cg_obj *o, u32 how)
{
    t->freeing = key;
    t->free_api = api;
    t->free_tid = o->tid;
    t->free_size = o->size;
    t->free_gen = o->gen;
    t->free_dev = o->dev;
    t->free_how = how | STASH_STAMP;
}

// The stash, taken back at its call's return (the slot free again).
static __always_inline void unstash(struct cg_thread *t, struct cg_obj *o)
{
    o->size = t->free_size, o->gen = t->free_gen, o->dev = t->free_dev, o->tid = t->free_tid;
    t->freeing = 0;
    t->free_how = 0;
}

// A stashed object at its call's return: its bytes leave the books or, the call having failed,
// it is the books' again (unrecorded: its bytes stay charged until the process exits).
static __always_inline void settle_stashed(u64 id, u16 api, u32 ns, u64 key, struct cg_obj *o, int failed)
{
    u32 tgid = id >> 32;
    struct cg_proc *p = procs.lookup(&tgid);
    if (!p || p->gen != o->gen)
        return;
    if (failed) {
        struct cg_obj_key k = {.tgid = tgid, .ns = ns, .addr = key};
        struct cg_obj was = {};
        obj_put(&k, o, p, &was);
        return;
    }
    bytes_gone(id, p, api, o, key, 1);
}

// A free the enforcer before us stashed (another stamp) that is still in the slot at this
// thread's next call: its return reached no program that settles it. A uprobe session's return
// runs only in the link whose entry ran; that link (the old enforcer's, kept by its watchdog)
// steps aside once we own admission in programs before this one (retired()), and is detached
// once we took over. A process stopped whole inside a free across the restart (its held call
// handed over, or stopped at any call of a sibling) returned from it to nobody, and its block
// stayed charged for good (the kill -9 torture with --handover: books one 128 MiB block above
// the driver's count). The thread calling again is past that free: settled as done (a free of
// a block the books know does not fail; the driver's count is the last word if one did). A
// thread that makes no call again keeps it charged until its process exits: too much, never
// too little. Our own stamp is a free of ours: its return comes here (and a nested call from a
// signal handler mid-free must not settle it early).
static __always_inline void lost_free(u64 id, struct cg_thread *t)
{
    if (!t->freeing || STASH_HOW(t) != STASH_FREE || (t->free_how & ~0xffu) == STASH_STAMP)
        return;
    u64 addr = t->freeing;
    u16 api = t->free_api;
    struct cg_obj o = {.api = API_cuMemAlloc_v2};
    unstash(t, &o);
    settle_stashed(id, api, NS_PTR, addr, &o, 0);
}

// session: the program is a uprobe session's (free_session): 1 asks the kernel to skip the
// return (settled here), 0 to run this program again there.
static __always_inline int free_enter(struct pt_regs *ctx, u16 api, int session)
{
    u64 id = bpf_get_current_pid_tgid();
    count_hit(api);
    if (retired())                  // a successor's program does it (see retired())
        return 1;
    u32 tgid = id >> 32;
    struct cg_proc *p = procs.lookup(&tgid);
    if (!p || tgid == self_tgid())
        return 1;
    u64 addr = PT_REGS_PARM1(ctx);
    struct cg_obj_key k = {.tgid = tgid, .ns = NS_PTR, .addr = addr};
    struct cg_obj *o = objs.lookup(&k);
    if (o && o->gen == p->gen && session && settle_now(tgid, o, enforcing())) {
        struct cg_obj now = *o;     // settled here: the object found is the one to take
        if (obj_del(&k, now.quota) == 0)
            bytes_gone(id, p, api, &now, addr, 1);
        return 1;
    }
    int denied = 0;
    struct cg_thread *t = o ? get_thread(id, 1, &denied) : 0;
    if (!t) {                       // unknown (an error event, as always), or no thread entry
        obj_free(id, p, api, NS_PTR, addr);
        return 1;
    }
    // Out of `objs` from here: the driver may give the address out again before this free
    // returns, and an allocation there, settled first, is another object. Its bytes stay
    // charged until the return (the memory is the driver's until then). Before, exit_free
    // looked the address up and settled whatever was there: the torture (bench/torture.py) found
    // containers holding a 128 MiB block their books no longer had, over the limit by that.
    struct cg_obj gone = *o;
    if (obj_del(&k, gone.quota) != 0)   // a racing free of the same pointer took it first
        return 1;
    lost_free(id, t);               // before this stash takes the slot
    stash(t, addr, api, &gone, STASH_FREE);
    struct cg_usage *u = find_usage(tgid, gone.dev, p->gen);
    if (u)                          // moving: NVML's measurement waits (Tracer.calls_in_flight)
        u->last_ns = bpf_ktime_get_ns();
    return 0;
}

// The object free_enter took out of `objs`: its bytes leave the books now, or, the free having
// failed, it is the books' again. A thread killed inside the free leaves them charged to its
// process until it exits. Settled in whichever program returns first, retired or not (the
// other finds the slot empty): with a uprobe session only the program whose entry stashed it
// sees this return.
static __always_inline int free_return(struct pt_regs *ctx)
{
    u64 id = bpf_get_current_pid_tgid();
    struct cg_thread *t = threads.lookup(&id);
    if (!t || !t->freeing || STASH_HOW(t) != STASH_FREE)
        return 0;
    u64 addr = t->freeing;
    u16 api = t->free_api;
    struct cg_obj o = {.api = API_cuMemAlloc_v2};
    unstash(t, &o);
    settle_stashed(id, api, NS_PTR, addr, &o, (u32)PT_REGS_RC(ctx) != 0);
    return 0;
}

int exit_free(struct pt_regs *ctx) { return free_return(ctx); }
int enter_cuMemFree_v2(struct pt_regs *ctx) { return free_enter(ctx, API_cuMemFree_v2, 0); }
int enter_cuMemFreeAsync(struct pt_regs *ctx) { return free_enter(ctx, API_cuMemFreeAsync, 0); }
int enter_cuMemFreeAsync_ptsz(struct pt_regs *ctx) { return free_enter(ctx, API_cuMemFreeAsync_ptsz, 0); }

// One program at a free's entry and its return (a uprobe session link, probes/links.py). At
// the return the registers are the caller's, past the call: the ip differs from the entry
// address bpf_get_func_ip gives at both ends (at the entry the two are the same address).
static __always_inline int free_session(struct pt_regs *ctx, u16 api)
{
    if (PT_REGS_IP(ctx) != bpf_get_func_ip(ctx))
        return free_return(ctx);
    return free_enter(ctx, api, 1);
}
int sess_cuMemFree_v2(struct pt_regs *ctx) { return free_session(ctx, API_cuMemFree_v2); }
int sess_cuMemFreeAsync(struct pt_regs *ctx) { return free_session(ctx, API_cuMemFreeAsync); }
int sess_cuMemFreeAsync_ptsz(struct pt_regs *ctx) { return free_session(ctx, API_cuMemFreeAsync_ptsz); }

// CUresult cuMemRelease(CUmemGenericAllocationHandle handle)
// CUresult cuArrayDestroy(CUarray hArray); cuMipmappedArrayDestroy(CUmipmappedArray h)
// A handle is taken out of `objs` at the entry, as a free's pointer is (free_enter): the driver
// may give the same handle value to another thread's cuMemCreate (cuArrayCreate) before this
// call returns, and that create, settled first, is another object. Looked up at the return, as
// before, the new object was the one released: its bytes left the books while the driver
// held them. Between the two ends the bytes stay charged. The object waits in the thread's
// free slot (stash), not in the call's spare arguments: while two enforcers' programs both
// act at an entry (a take-over), the second one's record of the call overwrote those, and the
// return found nothing to settle (the kill -9 torture with VMM jobs: books over the driver's
// count for good). A handle still mapped is only marked released: its bytes go at the last unmap.
static __always_inline int handle_enter(struct pt_regs *ctx, u16 api, u32 ns)
{
    struct cg_thread *t = call_enter(ctx, api);
    if (!t)
        return 0;
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32;
    struct cg_proc *p = procs.lookup(&tgid);
    u64 handle = t->call.a0;
    struct cg_obj_key k = {.tgid = tgid, .ns = ns, .addr = handle};
    struct cg_obj *o = p ? objs.lookup(&k) : 0;
    if (!o || o->gen != p->gen)     // not ours (or another program at this entry took it first)
        return 0;
    if (o->maps > 0) {
        if (!o->released) {
            o->released = 1;
            stash(t, handle, api, o, STASH_MARKED);
        }
        return 0;
    }
    struct cg_obj gone = *o;
    if (obj_del(&k, gone.quota) == 0)   // else a racing release of the same handle took it first
        stash(t, handle, api, &gone, STASH_TAKEN);
    return 0;
}
int enter_cuMemRelease(struct pt_regs *ctx) { return handle_enter(ctx, API_cuMemRelease, NS_VMM); }
int enter_cuArrayDestroy(struct pt_regs *ctx) { return handle_enter(ctx, API_cuArrayDestroy, NS_ARRAY); }
int enter_cuMipmappedArrayDestroy(struct pt_regs *ctx)
{
    return handle_enter(ctx, API_cuMipmappedArrayDestroy, NS_ARRAY);
}

static __always_inline int handle_return(struct pt_regs *ctx, u32 ns)
{
    u64 id = bpf_get_current_pid_tgid();
    struct cg_call c = {};
    s32 dev = 0;
    struct cg_proc *p = settle(ctx, id, &c, &dev);   // NULL: failed (c is the call all the same)
    release(&c);
    if (!c.api)
        return 0;
    u32 tgid = id >> 32;
    struct cg_thread *t = threads.lookup(&id);
    u32 how = 0;
    struct cg_obj o = {.api = c.api};
    if (t && (STASH_HOW(t) == STASH_TAKEN || STASH_HOW(t) == STASH_MARKED)) {
        // this call's, or one whose return was lost (then dropped)
        how = t->freeing == c.a0 && t->free_api == c.api ? STASH_HOW(t) : 0;
        unstash(t, &o);
    }
    int failed = (u32)PT_REGS_RC(ctx) != 0;
    if (how == STASH_TAKEN) {
        settle_stashed(id, c.api, ns, c.a0, &o, failed);
    } else if (how == STASH_MARKED) {
        struct cg_obj_key k = {.tgid = tgid, .ns = ns, .addr = c.a0};
        struct cg_obj *m = objs.lookup(&k);
        if (failed && m && m->released)
            m->released = 0;
        else if (!failed && m)
            emit(id, c.api, OP_FREE, EF_DEFERRED, m->dev, c.a0, 0, 0, 0);
    } else if (p && !failed) {      // not ours at the entry: nothing to settle
        stat_inc(ST_UNKNOWN_FREE);
        emit(id, c.api, OP_FREE, EF_UNKNOWN, current_dev(id, p), c.a0, 0, 0, 0);
    }
    return 0;
}
int exit_vmm_release(struct pt_regs *ctx) { return handle_return(ctx, NS_VMM); }
int exit_array_destroy(struct pt_regs *ctx) { return handle_return(ctx, NS_ARRAY); }
