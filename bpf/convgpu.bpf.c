// convgpu.bpf.c: account every device-memory allocation of every process, in maps.
//
// Entry uprobes save the call's arguments per thread; one return probe (exit_call) settles the
// call once the driver has answered: CUresult != 0 changes nothing. Accounting lives in maps
// (exact, read by user space at any time); the ring buffer only carries events for the live
// view, without wake-ups (FACTS.md: a wake-up per event costs the caller 10-16 us).
//
// Contents (one file: bcc rewrites map calls such as threads.lookup() only in the main source)
//   maps and helpers ........... the accounting state (pinned under enforce), `held`, events
//   enforce .................... admission at entry, the recheck in the prologue, retired()
//   accounting helpers ......... objects, bytes and contexts in and out
//   entry (probes/table.py) .... saves arguments, admits; frees settle at entry
//   return ..................... one program per family settles the call
//   exit and exec .............. the kernel's tracepoints release everything a process held
//   discovery .................. a process opening a driver file waits until it is probed
#include <uapi/linux/ptrace.h>
#include "convgpu.h"

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
    u32 pad2;
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
    u16 pad3;                       // loses nothing, and a second program at the same entry
    u32 free_tid;                   // (two enforcers' during a take-over) cannot overwrite it
    u64 free_size;                  // the freed object, out of `objs` from the free's entry to
    u64 free_gen;                   //   its return (free_enter, handle_enter): what the return
    s32 free_dev;                   //   settles
    u32 free_how;                   // STASH_*: what the entry did
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

static __always_inline void stat_inc(u32 slot)
{
    u64 *v = stats.lookup(&slot);
    if (v)
        *v += 1;
}

static __always_inline s32 clamp_dev(s64 dev)
{
    return (dev >= 0 && dev < CG_MAX_DEV) ? (s32)dev : 0;
}

// The device a call names is the process's CUDA ordinal, local to it (FACTS.md, 2026-11-25:
// with CUDA_VISIBLE_DEVICES=3 or a container given GPU 3 it is 0); every map here keys by host
// GPU. The enforcer writes each process's ordinals while it is stopped at placement, before its
// first charge (probes/gpumap.py: from the /dev/nvidiaN nodes it opened, its environment as a
// hint). Without an entry the ordinal stands (`trace` maps it in user space), and t->call.ordinal
// says so, so that the recheck maps a call stopped for its placement once the entry exists.
STATE("hash", u64, struct cg_gpumap, gpumap, 16384);

static __always_inline s32 host_of(u32 tgid, s64 ordinal, struct cg_thread *t)
{
    s32 o = clamp_dev(ordinal);
    u64 k = (u64)tgid << 32 | (u32)o;
    struct cg_gpumap *g = gpumap.lookup(&k);
    if (t)
        t->call.ordinal = !g;
    return g ? clamp_dev(g->host) : o;
}

// ---- quotas: what one container may hold in the shared maps (convgpu.h, cg_quota) ----
// Issue 24 row 4: one container filled `objs` with 1-byte allocations, and every other
// process's objects went unrecorded. Each entry of objs, threads and procs now counts in its
// container's bucket (its key: the enforcer writes members and makes the bucket with the
// container); at the quota (cg_control.max_*) the container's own call is stopped or killed
// before it runs (quota_ok), and a put past it (racing threads) is refused (q_take).
STATE("hash", u32, u64, members, MAX_THREADS);
STATE("array", int, struct cg_control, control, 1);
STATE("hash", u64, struct cg_quota, quotas, 4096);
STATE("hash", u64, u64, swept, 4096);   // objects of exited processes the tracer deleted
#define Q_DENIED ((u64)-1)
enum { Q_OBJS, Q_THREADS, Q_PROCS };

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

// Room left in bucket s (its key) for `what`; 1 << 40 without a quota
static __always_inline s64 q_left(struct cg_quota *s, u64 key, int what, struct cg_control *ctl)
{
    u64 max = what == Q_OBJS ? ctl->max_objs : what == Q_THREADS ? ctl->max_threads : ctl->max_procs;
    if (!max)
        return 1LL << 40;
    s64 left = (s64)max - (s64)(what == Q_OBJS ? s->objs : what == Q_THREADS ? s->threads : s->procs);
    if (left > 0 || what != Q_OBJS)     // swept only gives room back: read it only when short
        return left;
    u64 *gone = swept.lookup(&key);
    return gone ? left + (s64)*gone : left;
}

// One entry more in the bucket `key`: returns what the entry records as its bucket (0: none,
// counted nowhere), or Q_DENIED where an enforcer runs and the container is at its quota.
static __always_inline u64 q_take(u64 key, int what)
{
    struct cg_quota *s = key ? quotas.lookup(&key) : 0;
    if (!s)
        return 0;
    u64 *f = what == Q_OBJS ? &s->objs : what == Q_THREADS ? &s->threads : &s->procs;
    __sync_fetch_and_add(f, 1);
    struct cg_control *ctl = enforcing();
    if (ctl && q_left(s, key, what, ctl) < 0) {
        __sync_fetch_and_add(f, -1);
        __sync_fetch_and_add(&s->denied, 1);
        stat_inc(ST_OVER_QUOTA);
        return Q_DENIED;
    }
    return key;
}

static __always_inline void q_give(u64 key, int what)
{
    struct cg_quota *s = key ? quotas.lookup(&key) : 0;
    if (s)
        __sync_fetch_and_add(what == Q_OBJS ? &s->objs : what == Q_THREADS ? &s->threads : &s->procs, -1);
}

static __always_inline struct cg_proc *find_proc(u32 tgid, int create)
{
    struct cg_proc *p = procs.lookup(&tgid);
    if (p || !create)
        return p;
    struct cg_proc z = {};
    z.quota = q_take(member_key(tgid), Q_PROCS);
    if (z.quota == Q_DENIED)
        return 0;
    z.gen = bpf_ktime_get_ns();
    z.cgroup_id = bpf_get_current_cgroup_id();
    z.last_dev = -1;
    bpf_get_current_comm(&z.comm, sizeof(z.comm));
    if (procs.insert(&tgid, &z) != 0) {     // a racing thread made it, or the map is full
        q_give(z.quota, Q_PROCS);
        stat_inc(ST_UNRECORDED);
    }
    return procs.lookup(&tgid);
}

// objs entries count in the bucket of the process that made them: put and del keep it exact.
// 0: recorded (*was: the entry it replaced, if any); -1: its container is at its quota; -2: the
// map is full.
static __always_inline int obj_put(struct cg_obj_key *k, struct cg_obj *o, struct cg_proc *p,
                                   struct cg_obj *was)
{
    u64 q = q_take(p->quota, Q_OBJS);   // 0: its process is counted nowhere (yet): quota_ok()
    if (q == Q_DENIED)
        return -1;
    o->quota = q;
    if (objs.insert(k, o) == 0)
        return 0;
    struct cg_obj *old = objs.lookup(k);    // the key is taken: replaced, and its place goes
    if (old) {
        *was = *old;
        if (objs.update(k, o) == 0) {
            q_give(was->quota, Q_OBJS);
            return 0;
        }
    }
    q_give(q, Q_OBJS);
    stat_inc(ST_UNRECORDED);
    return -2;
}

static __always_inline int obj_del(struct cg_obj_key *k, u64 quota)
{
    if (objs.delete(k) != 0)
        return -1;
    q_give(quota, Q_OBJS);
    return 0;
}

static __always_inline struct cg_usage *find_usage(u32 tgid, s32 dev, u64 gen)
{
    struct cg_usage_key k = {.tgid = tgid, .dev = dev};
    struct cg_usage *u = usage.lookup(&k);
    if (u && u->gen == gen)
        return u;
    struct cg_usage z = {};         // new, or left by an earlier process with this pid
    z.gen = gen;
    usage.update(&k, &z);
    return usage.lookup(&k);
}

// A call's device: its thread's current one, else its process's last, else 0.
static __always_inline s32 dev_of(struct cg_thread *t, struct cg_proc *p)
{
    if (t && t->dev >= 0)
        return t->dev;
    if (p && p->last_dev >= 0)
        return p->last_dev;
    return 0;
}

static __always_inline s32 current_dev(u64 id, struct cg_proc *p)
{
    return dev_of(threads.lookup(&id), p);
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

// A new entry counts in its container's bucket (a process not placed yet: at its first
// admitted call, quota_ok()). unplaced: whether a process the enforcer has not placed may
// make one: only at a call's entry, where admission then stops it until it is placed.
// *denied: its container is at its thread quota (else NULL is a full map: nobody's fault).
static __always_inline struct cg_thread *get_thread(u64 id, int unplaced, int *denied)
{
    struct cg_thread *t = threads.lookup(&id);
    if (t)
        return t;
    u64 key = member_key(id >> 32);
    if (!key && !unplaced && enforcing())
        return 0;
    struct cg_thread z = {.dev = -1};
    z.quota = q_take(key, Q_THREADS);
    *denied = z.quota == Q_DENIED;
    if (*denied)
        return 0;
    if (threads.update(&id, &z) != 0) {
        q_give(z.quota, Q_THREADS);
        stat_inc(ST_UNRECORDED);
    }
    return threads.lookup(&id);
}

static __always_inline void set_thread_dev(u64 id, s32 dev, int push, int pop)
{
    int denied = 0;
    struct cg_thread *t = get_thread(id, 0, &denied);
    if (!t)
        return;
    if (push) {
        u16 d = t->depth;
        if (d < 4)
            t->stack[d & 3] = t->dev;
        t->depth = d + 1;
    } else if (pop) {
        u16 d = t->depth;
        if (d > 0) {
            d -= 1;
            t->depth = d;
            dev = d < 4 ? t->stack[d & 3] : -1;
        } else {
            dev = -1;
        }
    }
    t->dev = dev;
}

// ---- enforce: admission before the call runs ----
// (Kept in this file: bcc rewrites map calls like members.lookup() only in the main source.)
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
#define SIGKILL 9
#define SIGSTOP 19

STATE("hash", struct cg_limit_key, struct cg_assign, assign, 4096);
STATE("hash", struct cg_limit_key, struct cg_cgstate, cgstate, 4096);
// An exited member's charge per device (generation -> cg_gone), read once by the enforcer:
// LRU, so exits nobody reads (the enforcer gone) never fill it.
STATE("lru_hash", u64, struct cg_gone, gone, 4096);

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

// While a container waits for memory, a free or an exit wakes the enforcer at once (the
// time to resume the waiter); otherwise events wait for its next poll.
static __always_inline u64 wake_if_waiting(void)
{
    u32 k = 0;
    struct cg_control *c = control.lookup(&k);
    return c && c->waiters ? BPF_RB_FORCE_WAKEUP : BPF_RB_NO_WAKEUP;
}

// The enforcer reads its numbers from maps; alloc and free events only feed views. With no
// view attached it asks for quiet, and then only the frees that may resume a waiter go out
// (at 10 k allocations/s the events alone cost it a tenth of a core).
static __always_inline int quiet(int is_free)
{
    u32 k = 0;
    struct cg_control *c = control.lookup(&k);
    return c && c->quiet && !(is_free && c->waiters);
}

// m: the process's `members` entry (its container, and whether the shim manages it)
static __always_inline struct cg_cgstate *member_state(u64 *m, s32 dev, u64 *key)
{
    if (!m)
        return 0;
    *key = *m & ~SHIM_MEMBER;
    struct cg_limit_key lk = {.container = *key, .dev = dev};
    return cgstate.lookup(&lk);
}

static __always_inline struct cg_cgstate *state_of(u32 tgid, s32 dev, u64 *key)
{
    return member_state(members.lookup(&tgid), dev, key);
}

// Bytes and contexts that landed (or left): kept per container as well as per process.
// A process whose GPUs the evidence did not tell apart counts on each it may use (gpumap `also`).
// Its own GPU is one lookup; only the `also` GPUs loop, and only where the process has them.
// others 0: its own GPU only (a caller inside a loop settles the others once, after it:
// charge_others). The verifier walks every inlined copy: a 16-GPU loop for the own GPU, inlined
// in each of exit_vmm_unmap's 32 iterations, was 0.28 s of every start (CPU machine).
static __always_inline void cg_add(struct cg_cgstate *s, s64 bytes, s64 contexts)
{
    if (!s)
        return;
    if (bytes)
        __sync_fetch_and_add(&s->used, bytes);
    if (contexts)
        __sync_fetch_and_add(&s->contexts, contexts);
}

static __always_inline void cg_charge_on(u32 tgid, s32 dev, s64 bytes, s64 contexts, int others)
{
    u64 key;
    u64 *m = members.lookup(&tgid);
    dev &= CG_MAX_DEV - 1;
    cg_add(member_state(m, dev, &key), bytes, contexts);
    u64 ak = (u64)tgid << 32 | CG_GPUMAP_ALSO;
    struct cg_gpumap *g = m && others ? gpumap.lookup(&ak) : 0;
    u32 also = g ? g->also & ~(1u << dev) : 0;
    for (int d = 0; d < CG_MAX_DEV && also; d++)
        cg_add((also >> d) & 1 ? member_state(m, d, &key) : 0, bytes, contexts);
}

static __always_inline void cg_charge(u32 tgid, s32 dev, s64 bytes, s64 contexts)
{
    cg_charge_on(tgid, dev, bytes, contexts, 1);
}

// What cg_charge_on(..., 0) left on its `also` GPUs: freed[d] bytes left GPU d, so each
// GPU of its `also` gives back all of them but its own (already given back).
static __always_inline void charge_others(u32 tgid, u64 *freed)
{
    u64 key, all = 0;
    u64 *m = members.lookup(&tgid);
    u64 ak = (u64)tgid << 32 | CG_GPUMAP_ALSO;
    struct cg_gpumap *g = m ? gpumap.lookup(&ak) : 0;
    u32 also = g ? g->also : 0;
    if (!also)
        return;
#pragma unroll
    for (int d = 0; d < CG_MAX_DEV; d++)
        all += freed[d];
#pragma unroll
    for (int d = 0; d < CG_MAX_DEV; d++) {
        struct cg_cgstate *s = (also >> d) & 1 && all != freed[d] ? member_state(m, d, &key) : 0;
        if (s)
            __sync_fetch_and_add(&s->used, -(s64)(all - freed[d]));
    }
}

// U_c without reservations. u64 arithmetic wraps: a process placed after it had allocated
// is adopted by the enforcer (a->adopted), and its later frees take those bytes from `used`,
// so `used` alone may "go below zero" while the sum stays exact. Every context costs the
// device's estimate from its first moment; extra_overhead turns it into NVML's measurement
// for the contexts measured. A sum below zero is a measured context gone before the enforcer
// saw it: it holds nothing.
static __always_inline u64 charged(struct cg_cgstate *s, struct cg_assign *a, struct cg_control *ctl)
{
    s64 v = s->used + a->adopted + (s->contexts + a->adopted_contexts) * a->ctx_charge
            + a->extra_overhead + (s64)(s->tearing - a->torn);
    return v < 0 ? 0 : v;
}

// Give back what a call reserved: at its return, after its bytes were charged (so the
// container is never briefly under-counted), or when its thread dies while stalled.
static __always_inline void release(struct cg_call *c)
{
    if (!c->reserved)
        return;
    struct cg_limit_key lk = {.container = c->container, .dev = c->rdev};
    struct cg_cgstate *s = cgstate.lookup(&lk);
    if (s)
        __sync_fetch_and_add(&s->reserved, -(s64)c->reserved);
    c->reserved = 0;
}

// The stop is sent before the event that tells the enforcer, never after: the enforcer may
// answer an event at once (a first context is placed and resumed within a millisecond) on
// another CPU, and a SIGCONT sent before the SIGSTOP is generated would be lost, leaving the
// process stopped for good. Sent first, the SIGSTOP is pending or taken when the event can be
// read, and the enforcer's SIGCONT discards or undoes it.
// final: no later check sees this call before its body runs (the recheck's own stop, or a stop
// at entry of a call without a recheck): there a thread traced by another process, which can
// swallow the SIGSTOP, gets a SIGKILL, which no tracer can (EF_TRACED, the tracer's pid in the
// event). UNTRACKED (a call with no `threads` entry: its thread past its container's thread
// quota, or the map full, OP_FULL): nothing can check or account it later (resumed, it ran
// unreserved and its bytes counted nowhere): killed, the event's result 0.
#define UNTRACKED 2
static __always_inline void stop_then_tell(u64 id, u16 api, u8 op, u8 flags, s32 dev, u64 key,
                                           u64 size, u64 total, struct cg_control *ctl, int final)
{
    // To this thread: a SIGSTOP sent to the process merges with one already pending for it,
    // which may be another thread's to take, and this thread would then return to its call
    // before that group stop reached it. Taken here, it stops the whole process all the same.
    // The stop's number (never 0, below HELD_OPEN), in `held` and the event: the enforcer's
    // release names the stop it ends, so a late one never lets a later stop's call run
    // (enforcer/failsafe/threadhold.py holds the thread under ptrace).
    u64 why = (u32)bpf_ktime_get_ns() | 1;
    u32 tracer = final ? foreign_tracer() : 0;
    int kill = tracer || final == UNTRACKED || ((op == OP_OVER_LIMIT || op == OP_QUOTA) && ctl->over_limit_kill);
    held.update(&id, &why);         // listed before it stops: the watchdog always finds it
    bpf_send_signal_thread(kill ? SIGKILL : SIGSTOP);
    emit_flags(id, api, op, flags | (tracer ? EF_TRACED : 0), dev, key, size, total,
               tracer ? tracer : final == UNTRACKED ? 0 : (u32)why, BPF_RB_FORCE_WAKEUP);
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
    if (t) {
        t->call.stalled = 1;        // recheck() lets it go once the container has room
        t->call.want = 0;
        t->call.wdev = dev;
    }
    stop_then_tell(id, api, OP_QUOTA, 0, dev, key, 0, 0, ctl, t ? final : UNTRACKED);
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

// ---- accounting helpers: objects, bytes and contexts in and out ----

// Bytes obtained: remember the object, add to the (process, device) totals.
static __always_inline void obj_add(u64 id, struct cg_proc *p, u16 api, u32 ns, u64 addr,
                                    u64 size, s32 dev, u8 flags)
{
    u32 tgid = id >> 32;
    struct cg_usage *u = find_usage(tgid, dev, p->gen);
    if (!u)
        return;
    struct cg_obj_key k = {.tgid = tgid, .ns = ns, .addr = addr};
    struct cg_obj o = {.size = size, .gen = p->gen, .dev = dev, .api = api, .tid = (u32)id}, old = {};
    // Not recorded, its free goes unseen. Past its own container's quota (threads racing past
    // quota_ok): charged to the process until it exits. The map full (more containers at their
    // quotas than the maps are sized for): charged nowhere, since the bytes of an innocent
    // process would stay charged for good (issue 24 row 4: a victim stalled holding nothing).
    int put = obj_put(&k, &o, p, &old);
    if (put == 0 && old.size && old.gen == p->gen && old.dev == dev) {   // freed unseen
        __sync_fetch_and_sub(&u->live, old.size);
        cg_charge(tgid, dev, -(s64)old.size, 0);
    }
    if (put == -2) {
        emit(id, api, OP_ALLOC, flags | EF_UNRECORDED, dev, addr, size, u->live, 0);
        return;
    }
    if (put)
        flags |= EF_UNRECORDED;
    cg_charge(tgid, dev, size, 0);
    struct cg_thread *t = threads.lookup(&id);
    if (t)
        __sync_fetch_and_add(&t->live, size);
    u64 live = __sync_fetch_and_add(&u->live, size) + size;
    u64 peak = u->peak;
    if (live > peak)
        __sync_val_compare_and_swap(&u->peak, peak, live);
    __sync_fetch_and_add(&u->n_alloc, 1);
    __sync_fetch_and_add(&u->bytes_alloc, size);
    u->last_ns = bpf_ktime_get_ns();
    if (!quiet(0))
        emit(id, api, OP_ALLOC, flags, dev, addr, size, live, 0);
}

// Bytes returned: only what this process generation was seen to obtain, exactly once
// (delete succeeds for one caller only, so racing frees cannot subtract twice).
static __always_inline u64 bytes_gone(u64 id, struct cg_proc *p, u16 api, struct cg_obj *o,
                                      u64 addr, int others)
{
    u32 tgid = id >> 32;
    struct cg_usage *u = find_usage(tgid, o->dev, p->gen);
    if (!u)
        return 0;
    u64 live = __sync_fetch_and_sub(&u->live, o->size) - o->size;
    cg_charge_on(tgid, o->dev, -(s64)o->size, 0, others);
    u64 owner = ((u64)tgid << 32) | o->tid;
    struct cg_thread *t = threads.lookup(&owner);
    if (t)
        __sync_fetch_and_add(&t->live, -(s64)o->size);
    __sync_fetch_and_add(&u->n_free, 1);
    __sync_fetch_and_add(&u->bytes_free, o->size);
    u->last_ns = bpf_ktime_get_ns();
    if (!quiet(1))
        emit_flags(id, api, OP_FREE, 0, o->dev, addr, o->size, live, 0, wake_if_waiting());
    return o->size;
}

// The bytes it gave back (on o.dev, its own GPU; others: on its `also` GPUs too), *dev that GPU
static __always_inline u64 obj_free_on(u64 id, struct cg_proc *p, u16 api, u32 ns, u64 addr, int others,
                                       s32 *dev)
{
    struct cg_obj_key k = {.tgid = id >> 32, .ns = ns, .addr = addr};
    struct cg_obj *found = objs.lookup(&k);
    if (!found || found->gen != p->gen) {
        stat_inc(ST_UNKNOWN_FREE);
        emit(id, api, OP_FREE, EF_UNKNOWN, current_dev(id, p), addr, 0, 0, 0);
        return 0;
    }
    struct cg_obj o = *found;
    *dev = o.dev;
    return obj_del(&k, o.quota) == 0 ? bytes_gone(id, p, api, &o, addr, others) : 0;
}

static __always_inline void obj_free(u64 id, struct cg_proc *p, u16 api, u32 ns, u64 addr)
{
    s32 dev;
    obj_free_on(id, p, api, ns, addr, 1, &dev);
}

static __always_inline void ctx_count(u64 id, struct cg_proc *p, s32 dev, s64 delta, u16 api,
                                      u64 ctx)
{
    struct cg_usage *u = find_usage(id >> 32, dev, p->gen);
    if (!u)
        return;
    s64 left = __sync_fetch_and_add(&u->contexts, delta) + delta;
    cg_charge(id >> 32, dev, 0, delta);
    u->last_ns = bpf_ktime_get_ns();
    emit(id, api, delta > 0 ? OP_CTX_CREATE : OP_CTX_DESTROY, 0, dev, ctx, 0, u->live,
         (u32)left);
}

static __always_inline void ctx_made(u64 id, struct cg_proc *p, u16 api, u64 ctx, s32 dev,
                                     int primary)
{
    u32 tgid = id >> 32;
    struct cg_obj_key ck = {.tgid = tgid, .ns = NS_CTX, .addr = ctx};
    struct cg_obj c = {.gen = p->gen, .dev = dev, .api = api, .released = primary};
    p->last_dev = dev;
    set_thread_dev(id, dev, 0, 0);
    if (primary) {                  // retain is refcounted: one context per device
        struct cg_obj_key pk = {.tgid = tgid, .ns = NS_PRIMARY, .addr = dev};
        struct cg_obj *pr = objs.lookup(&pk);
        if (pr && pr->gen == p->gen) {
            __sync_fetch_and_add(&pr->maps, 1);
            return;
        }
        struct cg_obj n = {.gen = p->gen, .ref = ctx, .dev = dev, .api = api, .maps = 1}, was;
        obj_put(&pk, &n, p, &was);
    }
    struct cg_obj was;
    obj_put(&ck, &c, p, &was);      // unrecorded: its context stays counted until exit
    ctx_count(id, p, dev, 1, api, ctx);
}

static __always_inline void ctx_gone(u64 id, struct cg_proc *p, u16 api, u32 ns, u64 key)
{
    struct cg_obj_key k = {.tgid = id >> 32, .ns = ns, .addr = key};
    struct cg_obj *c = objs.lookup(&k);
    if (!c || c->gen != p->gen)
        return;
    s32 dev = c->dev;
    u64 ctx = key, quota = c->quota;
    if (ns == NS_PRIMARY) {
        if (__sync_fetch_and_add(&c->maps, -1) != 1)
            return;                 // still retained elsewhere
        ctx = c->ref;
        struct cg_obj_key ck = {.tgid = id >> 32, .ns = NS_CTX, .addr = ctx};
        struct cg_obj *cc = objs.lookup(&ck);
        if (cc)
            obj_del(&ck, cc->quota);
    }
    if (obj_del(&k, quota) == 0)
        ctx_count(id, p, dev, -1, api, ctx);
}

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

// What a linear allocation really takes from the GPU: measured on an H100 with driver 580,
// NVML shows 23 x 3 MiB as 92 MiB and 123 MiB as 124 MiB, so requests above 1 MiB take whole
// 2 MiB pages; smaller ones share pages (their slack shows up in the context overhead).
static __always_inline u64 footprint(u64 size)
{
    return size > SUBALLOC_MAX ? (size + DEV_PAGE - 1) & ~(DEV_PAGE - 1) : size;
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
        return 1;
    }
    return 0;
}

// ---- entry: save arguments; the thread-state calls need no return probe ----

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
    }
}

// The thread's entry, with this call recorded in it; 0 where nothing was recorded.
static __always_inline struct cg_thread *call_enter(struct pt_regs *ctx, u16 api)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 slot = api;
    u64 *h = hits.lookup(&slot);
    if (h)
        *h += 1;
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
            quota_stop(id, 0, api, 0, key, ctl, 1);
        else if (ctl && (key || admitted(api)) && !lapsed(ctl))    // the map is full
            stop_then_tell(id, api, OP_FULL, 0, 0, key, 0, 0, ctl, UNTRACKED);
        return 0;
    }
    if (t->call.stalled)            // its last call was stopped and is long over (no recheck probe)
        held.delete(&id);
    t->call.a0 = PT_REGS_PARM1(ctx);
    t->call.a1 = PT_REGS_PARM2(ctx);
    t->call.a2 = PT_REGS_PARM3(ctx);
    t->call.a3 = PT_REGS_PARM4(ctx);
    t->call.a4 = PT_REGS_PARM5(ctx);
    t->call.api = api;
    t->call.reserved = 0;
    t->call.stalled = 0;
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

static __always_inline int ctx_switch(struct pt_regs *ctx, u16 api, int push, int pop)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 slot = api;
    u64 *h = hits.lookup(&slot);
    if (h)
        *h += 1;
    if (retired())                  // a successor's program does it (see retired())
        return 0;
    s32 dev = -1;
    if (!pop) {
        struct cg_obj_key k = {.tgid = id >> 32, .ns = NS_CTX, .addr = PT_REGS_PARM1(ctx)};
        struct cg_obj *c = objs.lookup(&k);
        if (!c)
            return 0;               // unknown or NULL context: keep what we had
        dev = c->dev;
    }
    set_thread_dev(id, dev, push, pop);
    return 0;
}

static __always_inline int rt_mark(struct pt_regs *ctx, u16 api)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 slot = api;
    u64 *h = hits.lookup(&slot);
    if (h)
        *h += 1;
    if (retired())                  // a successor's program does it (see retired())
        return 0;
    u32 tgid = id >> 32;
    set_thread_dev(id, current_dev(id, procs.lookup(&tgid)), 0, 0);
    struct cg_thread *t = threads.lookup(&id);
    if (t)
        t->rt_api = api;
    return 0;
}

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

// What a free's or a release's entry did with its object (cg_thread.free_how).
#define STASH_FREE 1                // a pointer's block, out of objs: settled at the return
#define STASH_TAKEN 2               // a handle's object, out of objs: dropped at the return, or put back
#define STASH_MARKED 3              // a handle still mapped, marked released (undone if the call fails)
static __always_inline void stash(struct cg_thread *t, u64 key, u16 api, struct cg_obj *o, u32 how)
{
    t->freeing = key;
    t->free_api = api;
    t->free_tid = o->tid;
    t->free_size = o->size;
    t->free_gen = o->gen;
    t->free_dev = o->dev;
    t->free_how = how;
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

// session: the program is a uprobe session's (free_session): 1 asks the kernel to skip the
// return (settled here), 0 to run this program again there.
static __always_inline int free_enter(struct pt_regs *ctx, u16 api, int session)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 slot = api;
    u64 *h = hits.lookup(&slot);
    if (h)
        *h += 1;
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
    stash(t, addr, api, &gone, STASH_FREE);
    struct cg_usage *u = find_usage(tgid, gone.dev, p->gen);
    if (u)                          // moving: NVML's measurement waits (Tracer.calls_in_flight)
        u->last_ns = bpf_ktime_get_ns();
    return 0;
}

// The object free_enter took out of `objs`: its bytes leave the books now, or, the free having
// failed, it is the books' again. A thread killed inside the free leaves them charged to its
// process until it exits.
static __always_inline int free_return(struct pt_regs *ctx)
{
    u64 id = bpf_get_current_pid_tgid();
    struct cg_thread *t = threads.lookup(&id);
    if (!t || !t->freeing || t->free_how != STASH_FREE || retired())
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

// CUresult cuCtxSetCurrent(CUcontext ctx)
int enter_cuCtxSetCurrent(struct pt_regs *ctx) { return ctx_switch(ctx, API_cuCtxSetCurrent, 0, 0); }
// CUresult cuCtxPushCurrent(CUcontext ctx)
int enter_cuCtxPushCurrent_v2(struct pt_regs *ctx) { return ctx_switch(ctx, API_cuCtxPushCurrent_v2, 1, 0); }
// CUresult cuCtxPopCurrent(CUcontext *pctx)
int enter_cuCtxPopCurrent_v2(struct pt_regs *ctx) { return ctx_switch(ctx, API_cuCtxPopCurrent_v2, 0, 1); }

// Runtime calls only mark the thread: the driver call they make is what gets accounted, and
// its event names the runtime call (never counted twice).
#define RT(name) int enter_##name(struct pt_regs *ctx) { return rt_mark(ctx, API_##name); }
RT(cudaMalloc) RT(cudaMallocManaged) RT(cudaMallocPitch) RT(cudaMalloc3D) RT(cudaFree)
RT(cudaMemGetInfo)

int exit_runtime(struct pt_regs *ctx)
{
    u64 id = bpf_get_current_pid_tgid();
    struct cg_thread *t = threads.lookup(&id);
    if (!t)
        return 0;
    if (t->rt_api == API_cudaMemGetInfo)
        emit(id, API_cudaMemGetInfo, OP_MEMINFO, 0, t->dev, 0, 0, 0, PT_REGS_RC(ctx));
    t->rt_api = 0;
    return 0;
}

// ---- return: settle the call (one return program per family keeps each one small
// enough for the verifier to explore quickly) ----

// Takes the saved call; on failure counts it and returns NULL (nothing is accounted).
static __always_inline struct cg_proc *settle(struct pt_regs *ctx, u64 id, struct cg_call *c,
                                              s32 *dev)
{
    struct cg_thread *t = threads.lookup(&id);
    if (!t)
        return 0;
    // Still stalled at its return: stopped again by its recheck, then let go. The recheck
    // probe does not fire twice, so its stop ends here, not at the thread's next call: a
    // `held` entry left until then made a sibling's seize take this thread for one stopped
    // at a call (enforcer/failsafe/threadhold.py), and kept its room counted as going.
    if (t->call.stalled) {
        t->call.stalled = 0;
        held.delete(&id);
    }
    if (!t->call.api)
        return 0;
    *c = t->call;
    t->call.api = 0;
    t->call.reserved = 0;           // handed to the exit program (DONE) or released below
    s32 tdev = t->dev;
    u32 rc = PT_REGS_RC(ctx);
    u32 tgid = id >> 32;
    if (rc != 0) {
        release(c);
        struct cg_proc *fp = find_proc(tgid, 0);
        *dev = tdev >= 0 ? tdev : fp && fp->last_dev >= 0 ? fp->last_dev : 0;
        if (fp) {
            struct cg_usage *u = find_usage(tgid, *dev, fp->gen);
            if (u)
                __sync_fetch_and_add(&u->n_failed, 1);
        }
        // a1 is the requested size for every allocating call that takes one
        emit(id, c->api, OP_FAILED, 0, *dev, 0, c->api == API_cuMemCreate ||
             c->api == API_cuMemAlloc_v2 || c->api == API_cuMemAllocManaged ||
             c->api == API_cuMemAllocAsync || c->api == API_cuMemAllocAsync_ptsz ||
             c->api == API_cuMemAllocFromPoolAsync || c->api == API_cuMemAllocFromPoolAsync_ptsz
             ? c->a1 : 0, 0, rc);
        return 0;
    }
    struct cg_proc *p = find_proc(tgid, 1);
    if (p)
        *dev = tdev >= 0 ? tdev : p->last_dev >= 0 ? p->last_dev : 0;
    return p;
}

#define SETTLE()                                   \
    u64 id = bpf_get_current_pid_tgid();           \
    struct cg_call c = {};                         \
    s32 dev = 0;                                   \
    u64 v = 0;                                     \
    struct cg_proc *p = settle(ctx, id, &c, &dev); \
    if (!p) {                                      \
        release(&c);                               \
        return 0;                                  \
    }                                              \
    u32 tgid = id >> 32;                           \
    (void)tgid; (void)v;

// CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize)
// CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned flags)
// CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream hStream)
// CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool, CUstream)
int exit_alloc(struct pt_regs *ctx)
{
    SETTLE();
    bpf_probe_read_user(&v, sizeof(v), (void *)c.a0);
    obj_add(id, p, c.api, NS_PTR, v, footprint(c.a1), dev, 0);
    release(&c);
    return 0;
}

// CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pPitch, size_t WidthInBytes,
//                             size_t Height, unsigned ElementSizeBytes)
int exit_pitch(struct pt_regs *ctx)
{
    SETTLE();
    u64 pitch = 0;
    bpf_probe_read_user(&v, sizeof(v), (void *)c.a0);
    bpf_probe_read_user(&pitch, sizeof(pitch), (void *)c.a1);
    obj_add(id, p, c.api, NS_PTR, v, footprint(pitch * c.a3), dev, 0);
    release(&c);
    return 0;
}

// CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size,
//                      const CUmemAllocationProp *prop, unsigned long long flags)
// Physical memory is taken here; location {type, id} sits at offset 8 of the prop.
int exit_vmm_create(struct pt_regs *ctx)
{
    SETTLE();
    s32 loc[2] = {};
    bpf_probe_read_user(&v, sizeof(v), (void *)c.a0);
    bpf_probe_read_user(loc, sizeof(loc), (void *)(c.a2 + 8));
    obj_add(id, p, c.api, NS_VMM, v, c.a1, loc[0] == 1 ? host_of(tgid, loc[1], 0) : dev, 0);
    release(&c);
    return 0;
}

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
    if (t && (t->free_how == STASH_TAKEN || t->free_how == STASH_MARKED)) {
        // this call's, or one whose return was lost (then dropped)
        how = t->freeing == c.a0 && t->free_api == c.api ? t->free_how : 0;
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

// CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset,
//                   CUmemGenericAllocationHandle handle, unsigned long long flags)
int exit_vmm_map(struct pt_regs *ctx)
{
    SETTLE();
    struct cg_obj_key k = {.tgid = tgid, .ns = NS_VMM, .addr = c.a3};
    struct cg_obj *o = objs.lookup(&k);
    struct cg_obj_key mk = {.tgid = tgid, .ns = NS_MAPPING, .addr = c.a0};
    struct cg_obj m = {.size = c.a1, .gen = p->gen, .ref = c.a3, .dev = o ? o->dev : dev,
                       .api = c.api};
    struct cg_obj was;
    if (obj_put(&mk, &m, p, &was) == 0 && o)  // unrecorded: the handle stays held until exit
        __sync_fetch_and_add(&o->maps, 1);
    emit(id, c.api, OP_MAP, 0, m.dev, c.a0, c.a1, 0, 0);
    release(&c);
    return 0;
}

// CUresult cuMemUnmap(CUdeviceptr ptr, size_t size): the range may span several mappings.
int exit_vmm_unmap(struct pt_regs *ctx)
{
    SETTLE();
    u64 at = c.a0, end = c.a0 + c.a1;
    u64 freed[CG_MAX_DEV] = {};     // per GPU: bytes of released handles whose last mapping went
    for (int i = 0; i < 32 && at < end; i++) {
        struct cg_obj_key mk = {.tgid = tgid, .ns = NS_MAPPING, .addr = at};
        struct cg_obj *m = objs.lookup(&mk);
        if (!m)
            break;
        u64 handle = m->ref, msize = m->size;
        obj_del(&mk, m->quota);
        emit(id, c.api, OP_UNMAP, 0, dev, at, msize, 0, 0);
        struct cg_obj_key k = {.tgid = tgid, .ns = NS_VMM, .addr = handle};
        struct cg_obj *o = objs.lookup(&k);
        if (o && __sync_fetch_and_add(&o->maps, -1) == 1 && o->released) {
            s32 od = 0;
            u64 f = obj_free_on(id, p, c.api, NS_VMM, handle, 0, &od);
            freed[od & (CG_MAX_DEV - 1)] += f;
        }
        if (!msize)
            break;
        at += msize;
    }
    charge_others(tgid, freed);
    release(&c);
    return 0;
}

// CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment,
//                              CUdeviceptr addr, unsigned long long flags)
// CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size)
// Virtual addresses only: shown, never counted.
int exit_va(struct pt_regs *ctx)
{
    SETTLE();
    if (c.api == API_cuMemAddressReserve) {
        bpf_probe_read_user(&v, sizeof(v), (void *)c.a0);
        emit(id, c.api, OP_RESERVE, 0, dev, v, c.a1, 0, 0);
    } else {
        emit(id, c.api, OP_UNRESERVE, 0, dev, c.a0, c.a1, 0, 0);
    }
    release(&c);
    return 0;
}

// CUresult cuArrayCreate_v2(CUarray *pHandle, const CUDA_ARRAY_DESCRIPTOR *desc)
// CUresult cuArray3DCreate_v2(CUarray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *desc)
// CUresult cuMipmappedArrayCreate(CUmipmappedArray *pHandle,
//                                 const CUDA_ARRAY3D_DESCRIPTOR *desc, unsigned levels)
// Sizes come from the descriptor: the driver pads rows, so they are flagged estimates.
int exit_array(struct pt_regs *ctx)
{
    SETTLE();
    bpf_probe_read_user(&v, sizeof(v), (void *)c.a0);
    obj_add(id, p, c.api, NS_ARRAY, v, array_bytes(c.api, c.a1, (u32)c.a2), dev, EF_ESTIMATE);
    release(&c);
    return 0;
}

// CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev)
// CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned flags, CUdevice dev)
// CUresult cuCtxCreate_v3(CUcontext *pctx, CUexecAffinityParam *p, int n, unsigned flags,
//                         CUdevice dev)
// CUresult cuCtxCreate_v4(CUcontext *pctx, CUctxCreateParams *p, unsigned flags, CUdevice dev)
int exit_ctx_create(struct pt_regs *ctx)
{
    SETTLE();
    u64 d = c.api == API_cuDevicePrimaryCtxRetain ? c.a1 : c.api == API_cuCtxCreate_v2 ? c.a2
          : c.api == API_cuCtxCreate_v3 ? c.a4 : c.a3;
    s32 cd = host_of(tgid, (s32)d, 0);
    bpf_probe_read_user(&v, sizeof(v), (void *)c.a0);
    ctx_made(id, p, c.api, v, cd, c.api == API_cuDevicePrimaryCtxRetain);
    if (c.api != API_cuDevicePrimaryCtxRetain)
        set_thread_dev(id, cd, 1, 0);   // cuCtxCreate pushes the new context current
    release(&c);
    return 0;
}

// CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev); cuCtxDestroy_v2(CUcontext ctx)
int exit_ctx_destroy(struct pt_regs *ctx)
{
    SETTLE();
    if (c.api == API_cuDevicePrimaryCtxRelease_v2)
        ctx_gone(id, p, c.api, NS_PRIMARY, host_of(tgid, (s32)c.a0, 0));
    else
        ctx_gone(id, p, c.api, NS_CTX, c.a0);
    release(&c);
    return 0;
}

// CUresult cuMemGetInfo_v2(size_t *free, size_t *total)
int exit_meminfo(struct pt_regs *ctx)
{
    SETTLE();
    emit(id, c.api, OP_MEMINFO, 0, dev, 0, 0, 0, 0);
    release(&c);
    return 0;
}

// ---- the kernel sees every exit: drop per-thread state; on the last thread, everything ----

// Its ordinals go with it (a reused pid is another process, with another environment): the
// enforcer writes the `also` entry for every process it maps, so one lookup tells.
static __always_inline void forget_gpus(u32 tgid)
{
    u64 k = (u64)tgid << 32 | CG_GPUMAP_ALSO;
    if (!gpumap.lookup(&k))
        return;
    gpumap.delete(&k);
    for (u32 o = 0; o < CG_MAX_DEV; o++) {
        k = (u64)tgid << 32 | o;
        gpumap.delete(&k);
    }
}

static __always_inline void process_gone(u32 tgid, u16 api, u8 op)
{
    struct cg_proc *p = procs.lookup(&tgid);
    if (!p) {
        // Placed before its procs entry was made (killed while stopped at its placement: mapped,
        // no call returned): the enforcer still learns it left. Before, it never did, and under
        // --stall freezer its container stayed frozen for good (issue 33, attack 6, on the H100's
        // path: a context that waits).
        // Only at its exit: an exec keeps its placement (a shim's hello before exec, say), as
        // before, and the enforcer drops a pid at an "exec" event.
        if (op == OP_EXIT) {
            if (members.lookup(&tgid)) {
                u64 id = ((u64)tgid << 32) | tgid;
                emit_flags(id, api, op, 0, -1, 0, 0, 0, 0, wake_if_waiting());
            }
            members.delete(&tgid);  // its membership too
        }
        forget_gpus(tgid);
        return;
    }
    q_give(p->quota, Q_PROCS);
    u64 freed = 0, contexts = 0;
    s64 ctx_all = 0;                // signed: a context count may have gone below zero
    u64 *m = members.lookup(&tgid);
    // What cg_charge() put on each GPU leaves it: its own GPU's bytes and contexts there, and
    // on each GPU of its `also` all of them (second loop). Not cg_charge per GPU: 16 x 16
    // inlined bodies made this the program the verifier took longest on.
    u64 ak = (u64)tgid << 32 | CG_GPUMAP_ALSO;
    struct cg_gpumap *gm = m ? gpumap.lookup(&ak) : 0;
    u32 also = gm ? gm->also : 0;
    struct cg_gone g = {};
    for (int d = 0; d < CG_MAX_DEV; d++) {
        struct cg_usage_key k = {.tgid = tgid, .dev = d};
        struct cg_usage *u = usage.lookup(&k);
        if (u) {
            freed += u->live;
            ctx_all += u->contexts;
            if (u->contexts > 0)
                contexts += u->contexts;
            // The driver frees the bytes only when the files close (the H100: ~55 ms after this
            // tracepoint): until the enforcer saw its pidfd fire, the container still holds
            // them, so neither a sibling's call nor a resumed waiter takes their place.
            struct cg_cgstate *s = member_state(m, d, &g.container);
            struct cg_limit_key lk = {.container = g.container, .dev = d};
            struct cg_assign *a = s ? assign.lookup(&lk) : 0;
            if (a) {
                u64 c = u->live + (u->contexts > 0 ? u->contexts * a->ctx_charge : 0);
                g.charge[d] = c;
                __sync_fetch_and_add(&s->tearing, c);
            }
            if (s && !((also >> d) & 1)) {
                __sync_fetch_and_add(&s->used, -(s64)u->live);
                __sync_fetch_and_add(&s->contexts, -u->contexts);
            }
            usage.delete(&k);
        }
    }
    u64 key;
    for (int d = 0; d < CG_MAX_DEV && also; d++) {
        struct cg_cgstate *s = (also >> d) & 1 ? member_state(m, d, &key) : 0;
        if (s) {
            __sync_fetch_and_add(&s->used, -(s64)freed);
            __sync_fetch_and_add(&s->contexts, -ctx_all);
        }
    }
    forget_gpus(tgid);              // after its bytes left every GPU they counted on
    if (m)
        gone.update(&p->gen, &g);
    members.delete(&tgid);
    // Objects of this generation are swept by user space (it iterates the map); the totals
    // above are already exact, and a reused pid gets a new generation. The driver frees the
    // bytes later (when the files close): the enforcer holds them until then.
    u64 id = ((u64)tgid << 32) | tgid;
    emit_flags(id, api, op, 0, -1, p->gen, freed, contexts, 0, wake_if_waiting());
    procs.delete(&tgid);
}

// Discovery by identity (below): what a process mapped since the tracer last checked it. Its
// entries go with the process (exit) or its image (exec).
BPF_HASH(exec_gen, u32, u64, MAX_THREADS);   // executable mappings counted since its first GPU open
BPF_HASH(checked, u32, u64, MAX_THREADS);    // the tracer's: the exec_gen it had checked
static __always_inline void forget_identity(u32 tgid)
{
    exec_gen.delete(&tgid);
    checked.delete(&tgid);
}

TRACEPOINT_PROBE(sched, sched_process_exit)
{
    u64 id = bpf_get_current_pid_tgid();
    struct cg_thread *t = threads.lookup(&id);
    if (t) {
        release(&t->call);          // killed while stalled: its reservation goes too
        q_give(t->quota, Q_THREADS);
    }
    threads.delete(&id);
    held.delete(&id);
    shim_calls.delete(&id);
#ifdef HAVE_GROUP_DEAD
    if (args->group_dead)
#else
    if ((u32)id == (id >> 32))      // older kernels: the leader's exit
#endif
    {
        process_gone(id >> 32, API_sched_process_exit, OP_EXIT);
        forget_identity(id >> 32);
    }
    return 0;
}

// exec replaces the image: the driver's file descriptors close and device memory goes.
TRACEPOINT_PROBE(sched, sched_process_exec)
{
    process_gone(bpf_get_current_pid_tgid() >> 32, API_sched_process_exec, OP_EXEC);
    forget_identity(bpf_get_current_pid_tgid() >> 32);
    return 0;
}

// ---- discovery: nobody calls into a driver file before it is probed ----
// A process that opens a file named like the driver (libcuda.so, libcuda.so.1, libcuda.so.580...)
// for reading is stopped when the open returns, before it can map the file, let alone call into
// it; the tracer checks the file's inode (/proc/PID/fd/FD), attaches the probes if it is new,
// self-tests them, and resumes it (probes/discovery.py). That is the early catch of a driver
// opened by its usual name; a copy under any other name (a memfd, /proc/self/fd/N) is caught by
// what it is, at its open of a GPU device node (below, "identity"). Stopped threads are listed
// in `held` until resumed: if the tracer dies, its watchdog resumes them all and zeroes `discovery`.

#define O_ACCMODE 3
#define NAME_MAX_BPF 256
// Nobody is stopped at an open while the tracer's loop has not run for this long: a hung loop
// (issue 24 row 3: bcc blocked on a container's FIFO) must not hold every new CUDA process.
// Beaten by every loop pass and between two attaches (probes/discovery.py); a pass of the
// enforcer takes milliseconds, attaching one driver copy well under a second.
#ifndef DISCOVERY_STALE_NS
#define DISCOVERY_STALE_NS 3000000000ULL
#endif

BPF_ARRAY(discovery, struct cg_discovery, 1);
BPF_TABLE("lru_hash", u64, u8, opening, 16384);   // threads inside an openat of a driver-named file (LRU: a thread killed inside the call never fills it)
struct cg_path { char s[NAME_MAX_BPF]; };
BPF_PERCPU_ARRAY(pathbuf, struct cg_path, 1);

static __always_inline struct cg_discovery *discovering(u32 tgid)
{
    u32 k = 0;
    struct cg_discovery *d = discovery.lookup(&k);
    return d && d->on && tgid != d->exempt && tgid != self_tgid() ? d : 0;
}

// The loop beat lately (DISCOVERY_STALE_NS). Asked after the name matched: read before it,
// the time made the verifier keep six times the states through driver_named's loop.
static __always_inline int discovery_fresh(void)
{
    u32 k = 0;
    struct cg_discovery *d = discovery.lookup(&k);
    return d && (s64)(bpf_ktime_get_ns() - d->beat_ns) <= (s64)DISCOVERY_STALE_NS;
}

// The last path component is "libcuda.so" with or without a version (".1", ".580.159.04").
// Matched from the end for each possible version length: a scan for the last '/' makes the
// verifier track its position through the whole loop and gives up (E2BIG).
static __always_inline int driver_named(const char *s, int n)
{
    const char want[] = "libcuda.so";
    int len = n - 1;                // n counts the NUL
    int w = sizeof(want) - 1;
#pragma unroll
    for (int k = 0; k < 16; k++) {  // k: the version's length
        int start = len - k - w;
        if (start < 0)
            return 0;
        if (k > 0 && s[(len - k) & (NAME_MAX_BPF - 1)] != '.')
            continue;
        if (start > 0 && s[(start - 1) & (NAME_MAX_BPF - 1)] != '/')
            continue;
        int same = 1;
#pragma unroll
        for (int j = 0; j < sizeof(want) - 1; j++)
            same &= s[(start + j) & (NAME_MAX_BPF - 1)] == want[j];
        if (same)
            return 1;
    }
    return 0;
}

#ifndef NO_OPEN_TRACEPOINTS   // a kernel without syscall tracepoints: the periodic scan only
TRACEPOINT_PROBE(syscalls, sys_enter_openat)
{
    u64 id = bpf_get_current_pid_tgid();
    if (!discovering(id >> 32) || (args->flags & O_ACCMODE) != 0)   // O_RDONLY: a loader's open
        return 0;
    u32 k = 0;
    struct cg_path *p = pathbuf.lookup(&k);
    if (!p)
        return 0;
    char *buf = p->s;
    int n = bpf_probe_read_user_str(buf, NAME_MAX_BPF, args->filename);
    if (n <= 0 || !driver_named(buf, n) || !discovery_fresh())
        return 0;
    u8 one = 1;
    opening.update(&id, &one);
    return 0;
}

// The `held` value of a stop at an open: HELD_OPEN, HELD_NODE for a GPU node, the fd in the low
// 32 bits, and this stop's stamp (the clock's low 30 bits) in the top ones. A resume reads the
// entry back after its SIGCONT and deletes it only if it is still the stop it resumed: without
// the stamp, a thread that closed the file and opened it again at once (the same fd: a reader of
// its symbols, then a dlopen) was stopped again with an equal value, its entry deleted, its
// event then taken for a stale one, and it stayed stopped for good (a pytest worker, a bench).
#define HELD_STAMP_SHIFT 34
static __always_inline void stop_at_open(u64 id, u64 fd, u64 node)
{
    u64 why = HELD_OPEN | node | (u32)fd | ((bpf_ktime_get_ns() & 0x3FFFFFFFULL) << HELD_STAMP_SHIFT);
    held.update(&id, &why);         // listed before it stops: a watchdog always finds it
    bpf_send_signal_thread(SIGSTOP);
    emit_flags(id, API_sys_openat, OP_LIB_OPEN, 0, -1, fd, node >> 33, 0, 0, BPF_RB_FORCE_WAKEUP);
}

// ---- identity: a driver is what it is, not what it is called (probes/nodes.py) ----
// An open of the GPU (a character device of NVIDIA's majors, by the device number the kernel
// has for the opened file: no path a container names decides it) stops the process unless the
// tracer checked it after its last executable mapping; the tracer then probes every file it
// maps that exports a driver entry point (or holds it: --unprobed) and resumes it. A driver
// opens the nodes in cuInit, before any call that allocates. An NVML-only tool (nvidia-smi,
// exporters) maps no driver: checked once, it is stopped again only after it maps new code.
#define HELD_NODE (1ULL << 33)      // a `held` value: stopped at its open of a GPU node
#define PROT_EXEC 4
#define SHM_EXEC 0100000
BPF_ARRAY(nodecfg, struct cg_nodes, 1);
BPF_TABLE("lru_hash", u64, u8, mapping, 16384);   // threads inside an executable mmap/mprotect/shmat

// The major of the file at fd of the current task: task->files->fdt->fd[fd]->f_inode->i_rdev,
// at the running kernel's offsets (its BTF); 0 if anything is unknown or unreadable.
static __always_inline u32 fd_major(struct cg_nodes *c, u64 fd)
{
    u64 task = bpf_get_current_task(), files = 0, fdt = 0, arr = 0, file = 0, inode = 0;
    u32 max = 0, rdev = 0;
    if (bpf_probe_read_kernel(&files, 8, (void *)(task + c->task_files)) || !files ||
        bpf_probe_read_kernel(&fdt, 8, (void *)(files + c->files_fdt)) || !fdt ||
        bpf_probe_read_kernel(&max, 4, (void *)(fdt + c->fdt_max)) || fd >= max ||
        bpf_probe_read_kernel(&arr, 8, (void *)(fdt + c->fdt_fd)) || !arr ||
        bpf_probe_read_kernel(&file, 8, (void *)(arr + fd * 8)) || !file ||
        bpf_probe_read_kernel(&inode, 8, (void *)(file + c->file_inode)) || !inode ||
        bpf_probe_read_kernel(&rdev, 4, (void *)(inode + c->inode_rdev)))
        return 0;
    return rdev >> 20;              // the kernel's dev_t: MINORBITS 20
}

static __always_inline void node_opened(u64 id, u64 fd)
{
    u32 k = 0, tgid = id >> 32;
    struct cg_nodes *c = nodecfg.lookup(&k);
    if (!c || !c->known)
        return;
    u32 major = fd_major(c, fd);
    if (!major || (major != c->major[0] && major != c->major[1]))
        return;
    if (!discovering(tgid) || !discovery_fresh())
        return;
    u64 *g = exec_gen.lookup(&tgid), *ok = checked.lookup(&tgid);
    if (g && ok && *g == *ok)
        return;                     // checked since its last executable mapping
    u64 one = 1;
    exec_gen.insert(&tgid, &one);   // counting starts before the tracer looks (full: never equal)
    stop_at_open(id, fd, HELD_NODE);
}

TRACEPOINT_PROBE(syscalls, sys_exit_openat)
{
    u64 id = bpf_get_current_pid_tgid();
    if (!opening.lookup(&id)) {
        if (args->ret >= 0)
            node_opened(id, args->ret);
        return 0;
    }
    opening.delete(&id);
    u32 tgid = id >> 32;
    if (args->ret < 0 || !discovering(tgid) || !discovery_fresh())
        return 0;
    stop_at_open(id, args->ret, 0);
    return 0;
}

// open(2) and openat2(2) reach a node too (musl's open() is SYS_open): the same check.
TRACEPOINT_PROBE(syscalls, sys_exit_open) { if (args->ret >= 0) node_opened(bpf_get_current_pid_tgid(), args->ret); return 0; }
TRACEPOINT_PROBE(syscalls, sys_exit_openat2) { if (args->ret >= 0) node_opened(bpf_get_current_pid_tgid(), args->ret); return 0; }

// Executable mappings of a process already stopped once at a GPU open, counted when the call
// returns (the mapping then exists: a check that read /proc/PID/maps before it sees a new count).
static __always_inline void mapping_enter(int exec)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32;
    if (exec && exec_gen.lookup(&tgid)) {
        u8 one = 1;
        mapping.update(&id, &one);
    }
}

static __always_inline void mapping_exit(void)
{
    u64 id = bpf_get_current_pid_tgid();
    if (!mapping.lookup(&id))
        return;
    mapping.delete(&id);
    u32 tgid = id >> 32;
    u64 *g = exec_gen.lookup(&tgid);
    if (g)
        __sync_fetch_and_add(g, 1);
}

TRACEPOINT_PROBE(syscalls, sys_enter_mmap) { mapping_enter(args->prot & PROT_EXEC); return 0; }
TRACEPOINT_PROBE(syscalls, sys_exit_mmap) { mapping_exit(); return 0; }
TRACEPOINT_PROBE(syscalls, sys_enter_mprotect) { mapping_enter(args->prot & PROT_EXEC); return 0; }
TRACEPOINT_PROBE(syscalls, sys_exit_mprotect) { mapping_exit(); return 0; }
TRACEPOINT_PROBE(syscalls, sys_enter_pkey_mprotect) { mapping_enter(args->prot & PROT_EXEC); return 0; }
TRACEPOINT_PROBE(syscalls, sys_exit_pkey_mprotect) { mapping_exit(); return 0; }
TRACEPOINT_PROBE(syscalls, sys_enter_shmat) { mapping_enter(args->shmflg & SHM_EXEC); return 0; }
TRACEPOINT_PROBE(syscalls, sys_exit_shmat) { mapping_exit(); return 0; }
#endif
