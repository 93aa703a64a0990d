// maps.bpf.c (included by convgpu.bpf.c): what the parts share. The per-thread layout of a
// call in flight, every map more than one part reads or writes (the state the enforcer pins
// under PIN_DIR among them), the per-start config, and the event writer. The types that cross
// the kernel boundary are in convgpu.h; maps of one concern stay with it (shim_calls in
// admit.bpf.c, discovery's in discovery.bpf.c).

#ifndef RINGBUF_PAGES
#define RINGBUF_PAGES 4096          // 16 MiB: ~200 k events between two polls
#endif
// Map sizes: 16 containers at every quota at once (the enforcer's defaults: 16384 objects,
// 4096 threads, 1024 processes each; cli/enforce.py) still leave the others room (cg_quota).
#ifndef MAX_OBJS
#define MAX_OBJS 262144
#endif
#ifndef MAX_THREADS
#define MAX_THREADS 65536
#endif
#ifndef DEV_PAGE
#define DEV_PAGE (2ULL << 20)       // device page size of linear allocations
#endif
#ifndef SUBALLOC_MAX
#define SUBALLOC_MAX (1ULL << 20)   // at most this is sub-allocated inside shared pages
#endif

struct cg_call {                    // a driver call in flight on one thread
    u64 a0, a1, a2, a3, a4;
    u64 reserved;                   // enforce: bytes reserved for it in its container
    u64 container;                  // enforce: that container's key
    s32 rdev;                       //   and device
    u16 api;                        // 0: no call in flight
    u8 stalled;                     // enforce: stopped at entry, not yet let through
    u8 ordinal;                     // wdev is the process's ordinal: no mapping yet (host_of)
    u64 want;                       // enforce: what the stopped call needs
    s32 wdev;                       //   on this device
    u32 site;                       // low half of the entry's address: which library's copy of
                                    // the function it entered (call_enter: forwarded or re-entered)
};
struct cg_thread {                  // one entry per thread that ever called CUDA
    s32 dev;                        // current device, -1 unknown
    u16 rt_api;                     // runtime call in progress (cudaMalloc...)
    u16 depth;                      // context stack (cuCtxPush/Pop)
    s32 stack[4];
    u64 quota;                      // the cg_quota bucket it counts in (0: not counted yet)
    s64 live;                       // enforce: bytes it obtained, less those freed since (by
                                    // anyone): what no sibling thread can give back for it
    struct cg_call call;            // kept here, not in a map of its own: one hash lookup
                                    // at entry and one at return (probe cost, FACTS.md)
    u64 freeing;                    // a free in the driver: its pointer or handle (0: none),
    u16 free_api;                   // apart from `call`, so that a free inside another call
    u16 fwd;                        // loses nothing, and a second program at the same entry
    u32 free_tid;                   // (two enforcers' during a take-over) cannot overwrite it
    u64 free_size;                  // the freed object, out of `objs` from the free's entry to
    u64 free_gen;                   //   its return (free_enter, handle_enter): what the return
    s32 free_dev;                   //   settles
    u32 free_how;                   // STASH_*: what the entry did (and whose program: frees.bpf.c)
                                    // fwd (FWD_*, admit.bpf.c): the call in `call` was forwarded
                                    // (call_enter); in what was padding, so that a pinned
                                    // `threads` keeps its layout across a restart
};

// The enforcer pins the state (accounting, calls in flight, containers) under PIN_DIR: its
// watchdog keeps the probes attached after a crash, and a restarted enforcer loads this
// program over the same maps, so its accounting continues exactly where the other stopped.
#ifdef PIN_DIR
#define STATE(type, k, v, name, n) BPF_TABLE_PINNED(type, k, v, name, n, PIN_DIR "/" #name)
#else
#define STATE(type, k, v, name, n) BPF_TABLE(type, k, v, name, n)
#endif

STATE("hash", u64, struct cg_thread, threads, MAX_THREADS);
// The contexts current on a thread, as the driver keeps them (a stack: cuCtxCreate and
// cuCtxPushCurrent push, cuCtxPopCurrent pops, cuCtxSetCurrent replaces the top, NULL pops, and
// cuCtxDestroy pops the one destroyed if it is current): cuCtxSetLimit applies to the top one,
// and each context keeps its own limits (indirect.bpf.c). A map of its own, not in `threads`,
// whose layout a restarted enforcer must find unchanged; an entry only for a thread `threads`
// has (its quota bounds them), gone at the thread's exit.
#define CTX_DEPTH 8
struct cg_ctxstack {
    u64 ctx[CTX_DEPTH];             // ctx[d - 1]: the one current at depth d
    u32 depth;                      // pushes less pops; deeper than CTX_DEPTH: the top is unknown
    u32 lost;                       // 1: a context destroyed while deeper than that: every top is
                                    // unknown until the stack is empty
};
STATE("hash", u64, struct cg_ctxstack, curctx, MAX_THREADS);
STATE("hash", u32, struct cg_proc, procs, MAX_THREADS);
STATE("hash", struct cg_usage_key, struct cg_usage, usage, 65536);
STATE("hash", struct cg_obj_key, struct cg_obj, objs, MAX_OBJS);
BPF_PERCPU_ARRAY(stats, u64, ST_MAX);
BPF_PERCPU_ARRAY(hits, u64, CG_API_MAX);
BPF_RINGBUF_OUTPUT(events, RINGBUF_PAGES);
BPF_PERCPU_ARRAY(scratch, u64, 1);
// Who this program works for, per start (struct cg_config): written before any probe is
// attached, not compiled in, so one cached compile serves every start (probes/bpfcache.py).
// A lookup with a constant key in an array is inlined by the verifier: no helper call.
BPF_ARRAY(config, struct cg_config, 1);
// Every thread BPF has stopped and nobody has let go yet: pid_tgid -> HELD_OPEN | fd | a stamp
// (stopped at its open of a driver file, "discovery": stop_at_open) or the stop's number (an
// admission stall). If the enforcer or tracer dies, its watchdog resumes every process here: a
// stall the enforcer had no time to write into its state file is resumed too (seen on the
// H100: kill -9 within a millisecond of a stall left the process stopped for good).
#define HELD_OPEN (1ULL << 32)
BPF_HASH(held, u64, u64, MAX_THREADS);
BPF_ARRAY(layout_event, struct cg_event, 1);  // never written: its type lets tests compare
                                              // probes/events.py's ctypes mirror with the C one

// The device a call names is the process's CUDA ordinal, local to it (FACTS.md, 2026-11-25:
// with CUDA_VISIBLE_DEVICES=3 or a container given GPU 3 it is 0); every map here keys by host
// GPU. The enforcer writes each process's ordinals while it is stopped at placement, before its
// first charge (probes/gpumap.py: from the /dev/nvidiaN nodes it opened, its environment as a
// hint). Without an entry the ordinal stands (`trace` maps it in user space), and t->call.ordinal
// says so, so that the recheck maps a call stopped for its placement once the entry exists.
STATE("hash", u64, struct cg_gpumap, gpumap, 16384);

// What each container may hold and who belongs to it (books.bpf.c: quotas; admit.bpf.c).

STATE("hash", u32, u64, members, MAX_THREADS);
STATE("array", int, struct cg_control, control, 1);
STATE("hash", u64, struct cg_quota, quotas, 4096);
STATE("hash", u64, u64, swept, 4096);   // objects of exited processes the tracer deleted

// Each container's assignment and state per device (admit.bpf.c, books.bpf.c: cg_charge).

STATE("hash", struct cg_limit_key, struct cg_assign, assign, 4096);
STATE("hash", struct cg_limit_key, struct cg_cgstate, cgstate, 4096);
// An exited member's charge per device (generation -> cg_gone), read once by the enforcer:
// LRU, so exits nobody reads (the enforcer gone) never fill it.
STATE("lru_hash", u64, struct cg_gone, gone, 4096);

// Passes a value through a map so the verifier forgets how it was computed: after a loop
// with many exits, the paths then look alike and are pruned instead of explored one by one.
static __always_inline u64 launder(u64 x)
{
    u32 k = 0;
    u64 *s = scratch.lookup(&k);
    if (!s)
        return 0;
    *s = x;
    return *s;
}

static __always_inline u32 self_tgid(void)       // convgpu itself: never accounted
{
    u32 k = 0;
    struct cg_config *c = config.lookup(&k);
    return c ? c->self_tgid : 0;
}

static __always_inline u32 owner(void)           // the enforcer instance that may admit
{
    u32 k = 0;
    struct cg_config *c = config.lookup(&k);
    return c ? c->owner : 0;
}

static __always_inline void stat_inc(u32 slot)
{
    u64 *v = stats.lookup(&slot);
    if (v)
        *v += 1;
}

// Every probed call counts in `hits` (per API), whatever else it does: the self-test's proof
// that a probe fires (probes/loader.py read_hits).
static __always_inline void count_hit(u16 api)
{
    u32 slot = api;
    u64 *h = hits.lookup(&slot);
    if (h)
        *h += 1;
}

static __always_inline s32 clamp_dev(s64 dev)
{
    return (dev >= 0 && dev < CG_MAX_DEV) ? (s32)dev : 0;
}

static __always_inline struct cg_control *enforcing(void)
{
    u32 k = 0;
    struct cg_control *c = control.lookup(&k);
    return c && c->enforcing && c->owner == owner() ? c : 0;
}

static __always_inline u64 member_key(u32 tgid)
{
    u64 *m = members.lookup(&tgid);
    return m ? *m & ~SHIM_MEMBER : 0;
}

static __always_inline void emit_flags(u64 id, u16 api, u8 op, u8 flags, s32 dev, u64 addr,
                                       u64 size, u64 live, u32 result, u64 rb_flags)
{
    struct cg_event *e = events.ringbuf_reserve(sizeof(struct cg_event));
    if (!e) {
        stat_inc(ST_DROPS);         // visible in `convgpu trace`, never silent
        return;
    }
    e->ts_ns = bpf_ktime_get_ns();
    e->cgroup_id = bpf_get_current_cgroup_id();
    e->addr = addr;
    e->size = size;
    e->live = live;
    e->tgid = id >> 32;
    e->tid = (u32)id;
    e->dev = dev;
    e->result = result;
    e->api = api;
    struct cg_thread *t = threads.lookup(&id);
    e->rt_api = t ? t->rt_api : 0;
    e->op = op;
    e->flags = flags;
    e->pad[0] = e->pad[1] = 0;
    bpf_get_current_comm(&e->comm, sizeof(e->comm));
    events.ringbuf_submit(e, rb_flags);
}

// Events for the view are drained by polling: no wake-up per event (it costs the caller
// 10-16 us, FACTS.md). Only the enforcer's stall events wake it at once.
static __always_inline void emit(u64 id, u16 api, u8 op, u8 flags, s32 dev, u64 addr,
                                 u64 size, u64 live, u32 result)
{
    emit_flags(id, api, op, flags, dev, addr, size, live, result, BPF_RB_NO_WAKEUP);
}
