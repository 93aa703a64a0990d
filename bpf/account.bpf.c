// account.bpf.c (included by convgpu.bpf.c): accounting. Objects, bytes and contexts in and
// out of the books; the thread's current device and runtime call; the return programs that
// settle each call once the driver has answered (CUresult != 0 changes nothing).

// ---- accounting helpers: objects, bytes and contexts in and out ----

// Memory that is not an allocation (indirect.bpf.c): rare calls, always told, so that the
// enforcer can name them when the driver's count finds a container over its limit.
static __always_inline int indirect(u16 api)
{
    return (api >= API_cuCtxSetLimit && api <= API_cuGraphInstantiate_v2) ||
           (api >= API_cuGraphExecDestroy && api <= API_cuLibraryLoadFromFile);
}

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
    if (!quiet(0) || indirect(api))
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

// An object of ours that a call ends: given back where it was recorded (most graphs and
// modules hold none: that is no unknown free).
static __always_inline void indirect_gone(u64 id, struct cg_proc *p, u16 api, u32 ns, u64 addr)
{
    if (own_obj(id >> 32, ns, addr, p))
        obj_free(id, p, api, ns, addr);
}

// A context gone takes its limits with it (limit_key): the driver frees what they took, and a
// primary context retained again starts from the defaults.
static __always_inline void limits_gone(u64 id, struct cg_proc *p, u16 api, u64 ctx)
{
#pragma unroll
    for (u64 k = CU_LIMIT_STACK_SIZE; k <= CU_LIMIT_MALLOC_HEAP_SIZE; k++)
        indirect_gone(id, p, api, NS_LIMIT, ctx << 8 | k);
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
    if (obj_del(&k, quota) == 0) {
        ctx_count(id, p, dev, -1, api, ctx);
        if (ns == NS_PRIMARY)       // its last release (a created context's: exit_ctx_destroy)
            limits_gone(id, p, api, ctx);
    }
}

// ---- the thread's device and runtime call: entries that need no return probe ----

static __always_inline int ctx_switch(struct pt_regs *ctx, u16 api, int push, int pop)
{
    u64 id = bpf_get_current_pid_tgid();
    count_hit(api);
    if (retired())                  // a successor's program does it (see retired())
        return 0;
    set_thread_ctx(id, PT_REGS_PARM1(ctx), push ? CTX_PUSH : pop ? CTX_POP : CTX_SET);
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
    count_hit(api);
    if (retired())                  // a successor's program does it (see retired())
        return 0;
    u32 tgid = id >> 32;
    set_thread_dev(id, current_dev(id, procs.lookup(&tgid)), 0, 0);
    struct cg_thread *t = threads.lookup(&id);
    if (t)
        t->rt_api = api;
    return 0;
}

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

// Where an admitted call's result (at its first argument) is in the books; 0: it has none.
static __always_inline u32 result_ns(u16 api)
{
    switch (api) {
    case API_cuCtxSetLimit:
        return 0;
    case API_cuMemCreate:
        return NS_VMM;
    case API_cuArrayCreate_v2: case API_cuArray3DCreate_v2: case API_cuMipmappedArrayCreate:
        return NS_ARRAY;
    case API_cuDevicePrimaryCtxRetain: case API_cuCtxCreate_v2: case API_cuCtxCreate_v3:
    case API_cuCtxCreate_v4:
        return NS_CTX;
    case API_cuGraphInstantiateWithFlags: case API_cuGraphInstantiateWithParams:
    case API_cuGraphInstantiateWithParams_ptsz: case API_cuGraphInstantiate_v2:
        return NS_GEXEC;
    case API_cuModuleLoadData: case API_cuModuleLoadDataEx: case API_cuLibraryLoadData:
        return NS_MODULE;
    }
    return NS_PTR;
}

// A return of a forwarded call (call_enter). The innermost settles as any call; its reservation
// stays in the slot, with its result (want), for the outer calls still open. An outer call
// settles only a result of its own: the inner call's pointer or handle, still in the books, is
// the forward (a forwarder returns what the driver gave: the shim, HAMi-core); anything else is
// an allocation the outer call made itself, charged here. The last outer return closes the
// slot and gives its reservation back. 1: settle c as any call.
#define NO_RESULT ((u64)-1)         // the inner call failed: any outer success is its own
static __always_inline int forward_return(struct cg_thread *t, struct cg_call *c, u32 rc, u32 tgid)
{
    u16 f = t->fwd, n = f & FWD_OPEN;
    u64 v = 0;
    bpf_probe_read_user(&v, sizeof(v), (void *)c->a0);
    if (f & FWD_INNER) {
        t->fwd = n;
        t->call.want = rc ? NO_RESULT : v;
        c->reserved = 0;            // kept for the outer calls
        return 1;
    }
    u32 ns = result_ns(c->api);
    int forwarded = v == t->call.want && (!ns || own_obj(tgid, ns, v, procs.lookup(&tgid)));
    if (!rc)
        t->call.want = v;           // what the next outer call forwards, if it does
    t->fwd = n - 1;
    if (n > 1) {
        c->reserved = 0;            // still open under the next one
    } else {
        t->call.api = 0;
        t->call.reserved = 0;
    }
    return !rc && !forwarded;
}

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
    u32 rc = PT_REGS_RC(ctx);
    u32 tgid = id >> 32;
    if (!t->fwd) {
        t->call.api = 0;
        t->call.reserved = 0;       // handed to the exit program (DONE) or released below
    } else if (!forward_return(t, c, rc, tgid)) {
        return 0;                   // an outer call that brings nothing of its own
    }
    s32 tdev = t->dev;
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
    if (c.api != API_cuDevicePrimaryCtxRetain) {
        set_thread_dev(id, cd, 1, 0);   // cuCtxCreate pushes the new context current
        set_thread_ctx(id, v, CTX_PUSH);
    }
    release(&c);
    return 0;
}

// CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev); cuCtxDestroy_v2(CUcontext ctx)
// A destroyed context's limits go with it, whether the books knew the context or not, and the
// driver pops it if it was the calling thread's current one.
int exit_ctx_destroy(struct pt_regs *ctx)
{
    SETTLE();
    if (c.api == API_cuDevicePrimaryCtxRelease_v2) {
        ctx_gone(id, p, c.api, NS_PRIMARY, host_of(tgid, (s32)c.a0, 0));
    } else {
        ctx_gone(id, p, c.api, NS_CTX, c.a0);
        limits_gone(id, p, c.api, c.a0);
        set_thread_ctx(id, c.a0, CTX_GONE);
    }
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
