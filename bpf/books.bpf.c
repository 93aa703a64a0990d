// books.bpf.c (included by convgpu.bpf.c): the entries of the shared maps (threads, processes,
// objects, usage), each counted in its container's quota, and what each container is charged.
// Used at entry (admit.bpf.c), at return (account.bpf.c, frees.bpf.c) and at exit.

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
#define Q_DENIED ((u64)-1)
enum { Q_OBJS, Q_THREADS, Q_PROCS };

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

// The thread's context stack (curctx, maps.bpf.c), by the driver's rules: CTX_SET replaces the
// top (on an empty stack it pushes; NULL pops), CTX_PUSH pushes, CTX_POP pops, CTX_GONE pops the
// top if it is `ctx` (cuCtxDestroy of the current context). A context is kept as the value the
// call was given or returned, known to the books or not: the driver binds exactly that value.
// A value it refuses leaves the top wrong here; a limit set there then fails, or is charged on
// a key of its own: too much, never too little.
enum { CTX_SET, CTX_PUSH, CTX_POP, CTX_GONE };
static __always_inline void set_thread_ctx(u64 id, u64 ctx, int op)
{
    struct cg_ctxstack *s = curctx.lookup(&id);
    if (!s) {
        int denied = 0;             // as set_thread_dev: an entry where `threads` has (or makes) one
        if (op == CTX_POP || op == CTX_GONE || !get_thread(id, 0, &denied))
            return;
        struct cg_ctxstack z = {};
        curctx.update(&id, &z);     // the map full: this thread's limits count as unknown (limit_key)
        s = curctx.lookup(&id);
        if (!s)
            return;
    }
    u32 d = s->depth;
    if (op == CTX_GONE) {
        if (d > CTX_DEPTH)          // the top unknown: whether it went is too (until the stack empties)
            s->lost = 1;
        else if (d && s->ctx[(d - 1) & (CTX_DEPTH - 1)] == ctx)
            s->depth = d - 1;
        return;
    }
    if (op == CTX_SET && !ctx)
        op = CTX_POP;
    if (op == CTX_POP) {
        s->depth = d ? d - 1 : 0;
        if (d <= 1)
            s->lost = 0;
        return;
    }
    if (!ctx)                       // a NULL push: refused by the driver
        return;
    if (op == CTX_PUSH || !d)
        d += 1;
    s->depth = d;
    if (d <= CTX_DEPTH)
        s->ctx[(d - 1) & (CTX_DEPTH - 1)] = ctx;
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

// What a linear allocation really takes from the GPU: measured on an H100 with driver 580,
// NVML shows 23 x 3 MiB as 92 MiB and 123 MiB as 124 MiB, so requests above 1 MiB take whole
// 2 MiB pages; smaller ones share pages (their slack shows up in the context overhead).
static __always_inline u64 footprint(u64 size)
{
    return size > SUBALLOC_MAX ? (size + DEV_PAGE - 1) & ~(DEV_PAGE - 1) : size;
}
