// indirect.bpf.c (included by convgpu.bpf.c, before admit.bpf.c): memory a call takes that is
// not an allocation (issue 39), and what each such call takes, read at its entry. On an H200 one cuCtxSetLimit(CU_LIMIT_STACK_SIZE, 64 KiB) took 17,150 MiB (the
// stack is per thread, for every thread the device keeps resident), and a graph's memory node
// 2.5 GiB at its launch, both past a 1 GiB limit unseen. Each such call is sized at its entry
// and admitted there like an allocation where the size can be known; charged at its return as
// an object of its own namespace (NS_LIMIT, NS_GEXEC, NS_MODULE); given back by the call that
// ends it (indirect_returns.bpf.c). What no entry can size (a module from a file, a fat binary,
// PTX) is the backstop's: NVML's per-process count (enforcer/backstop.py), and its event names
// the call.

// Per host GPU: SMs x resident threads per SM, written by the enforcer (enforcer/devattrs.py);
// 0 unknown: RESIDENT_UNKNOWN, above every GPU's today (H100 and H200: 132 x 2048; B200: 148 x
// 2048), so an unknown GPU's stack is charged high (fail closed), never low.
BPF_ARRAY(resident, u64, CG_MAX_DEV);
#define RESIDENT_UNKNOWN (256ULL * 2048)
// CUlimit values and their defaults (cuda.h; cuCtxGetLimit on a fresh context): what the
// context already holds, measured in its overhead
#define CU_LIMIT_STACK_SIZE 0
#define CU_LIMIT_PRINTF_FIFO_SIZE 1
#define CU_LIMIT_MALLOC_HEAP_SIZE 2
#define STACK_DEFAULT 1024ULL
#define FIFO_DEFAULT (1ULL << 20)
#define HEAP_DEFAULT (8ULL << 20)
#define UNFITTABLE (1ULL << 62)     // a size past any card: admitted never (a hostile value)
#define CU_GRAPH_NODE_TYPE_MEM_ALLOC 10
#define ALLOC_NODE_BYTESIZE 104     // CUDA_MEM_ALLOC_NODE_PARAMS(_v2): poolProps (88), accessDescs,
#define NODE_PARAMS_UNION 16        // count, then bytesize; CUgraphNodeParams: type, int[3], union
#define UNSIZED ((u64)-1)           // an image no entry can size

static __always_inline u64 resident_threads(s32 dev)
{
    u32 k = dev;
    u64 *r = resident.lookup(&k);
    return r && *r ? *r : RESIDENT_UNKNOWN;
}

// What a context limit takes beyond what a fresh context holds. The stack: the per-thread
// bytes above the default for every resident thread (the H200: 270,336 x 63 KiB = 16,632 MiB,
// NVML 17,150 - 518 MiB of context); the heap and the printf FIFO: their size above the
// default (the driver takes the heap at the first launch that needs it: charged from the call).
static __always_inline u64 limit_bytes(u64 kind, u64 value, s32 dev)
{
    if (kind == CU_LIMIT_STACK_SIZE) {
        if (value <= STACK_DEFAULT)
            return 0;
        return value - STACK_DEFAULT > (1ULL << 32) ? UNFITTABLE : (value - STACK_DEFAULT) * resident_threads(dev);
    }
    if (kind == CU_LIMIT_PRINTF_FIFO_SIZE)
        return value > FIFO_DEFAULT ? value - FIFO_DEFAULT : 0;
    if (kind == CU_LIMIT_MALLOC_HEAP_SIZE)
        return value > HEAP_DEFAULT ? value - HEAP_DEFAULT : 0;
    return 0;
}

static __always_inline struct cg_obj *own_obj(u32 tgid, u32 ns, u64 addr, struct cg_proc *p)
{
    struct cg_obj_key k = {.tgid = tgid, .ns = ns, .addr = addr};
    struct cg_obj *o = objs.lookup(&k);
    return o && (!p || o->gen == p->gen) ? o : 0;
}

// The key of a limit in objs (NS_LIMIT): its context << 8 | CUlimit. The driver keeps limits per
// context (issue 47: four cuCtxCreate contexts with a 200 MiB heap each held 768 MiB while the
// books, one limit a process and device, said 192 MiB). The context is the thread's current one
// (curctx); with none made current by a probed call, its device's primary context (the
// runtime's, made current where no probe sees it), else the device itself (below any
// context's address); deeper in the stack than kept, or lost there, a key of the call's own,
// charged until exit: too much, never too little.
#define LIMIT_OWN (1ULL << 55)
static __always_inline u64 limit_key(u64 id, struct cg_proc *p, s32 dev, u64 kind)
{
    struct cg_ctxstack *s = curctx.lookup(&id);
    u32 d = s ? s->depth : 0;
    u64 ctx = (u32)dev;
    if (d > CTX_DEPTH || (s && s->lost)) {
        ctx = LIMIT_OWN | (bpf_ktime_get_ns() & (LIMIT_OWN - 1));
    } else if (d) {
        ctx = s->ctx[(d - 1) & (CTX_DEPTH - 1)];
    } else {
        struct cg_obj *pr = own_obj(id >> 32, NS_PRIMARY, (u32)dev, p);
        if (pr)
            ctx = pr->ref;
    }
    return ctx << 8 | (u8)kind;
}

// A graph memory node's bytes (in device pages, as an allocation's) and its device, from
// CUDA_MEM_ALLOC_NODE_PARAMS at `params` (poolProps.location {type, id} at offset 8).
static __always_inline u64 alloc_node_bytes(u64 params, u32 tgid, struct cg_thread *t, s32 *dev)
{
    u64 bytes = 0;
    s32 loc[2] = {};
    if (bpf_probe_read_user(&bytes, sizeof(bytes), (void *)(params + ALLOC_NODE_BYTESIZE)) ||
        bpf_probe_read_user(loc, sizeof(loc), (void *)(params + 8)))
        return UNFITTABLE;          // unreadable: an instantiate of it is never admitted
    if (loc[0] == 1)
        *dev = host_of(tgid, loc[1], t);
    return footprint(bytes);
}

// A module's static data (__device__ variables) where the image says it, charged from one device
// page up: less shares the context's own pages (JAX's and CuPy's JIT'd cubins carry a few bytes;
// NVML counts them in the context, as small allocations' slack). The stand-in's
// "CONVGPU-STANDIN-MODULE <bytes>\n", or an ELF cubin's .nv.global sections (uninitialized,
// NOBITS) and .nv.global.init. UNSIZED for anything else (a fat binary, compressed or not, PTX);
// UNFITTABLE for a size past any card (sections that sum past it, a number of 20 digits).
#define ELF_SECTIONS 64
static __always_inline u64 image_bytes(u64 img)
{
    char head[24] = {};
    if (bpf_probe_read_user(head, sizeof(head), (void *)img))
        return UNSIZED;
    // the stand-in's tag, "CONVGPU-STANDIN-MODULE " (23 bytes), as three little-endian words
    u64 w[3];
    __builtin_memcpy(w, head, sizeof(w));
    if (w[0] == 0x2d555047564e4f43ULL && w[1] == 0x2d4e49444e415453ULL && (w[2] & 0xffffffffffffffULL) == 0x20454c55444f4dULL) {
        char digits[20] = {};
        u64 n = 0;
        bpf_probe_read_user(digits, sizeof(digits), (void *)(img + 23));
#pragma clang loop unroll(disable)
        for (int i = 0; i < 20; i++) {
            if (digits[i] < '0' || digits[i] > '9')
                break;
            if (n > (UNFITTABLE - 9) / 10)  // 20 digits can wrap a u64: past any card instead
                return UNFITTABLE;
            n = n * 10 + (digits[i] - '0');
        }
        return n;
    }
    if (head[0] != 0x7f || head[1] != 'E' || head[2] != 'L' || head[3] != 'F' || head[4] != 2)
        return UNSIZED;
    struct { u64 shoff; u32 flags; u16 ehsize, phentsize, phnum, shentsize, shnum, shstrndx; } eh = {};
    if (bpf_probe_read_user(&eh, sizeof(eh), (void *)(img + 0x28)) || eh.shentsize != 64 ||
        eh.shnum > ELF_SECTIONS || eh.shstrndx >= eh.shnum)
        return UNSIZED;
    u64 strtab = 0, bytes = 0;
    if (bpf_probe_read_user(&strtab, sizeof(strtab), (void *)(img + eh.shoff + eh.shstrndx * 64ULL + 24)))
        return UNSIZED;
#pragma clang loop unroll(disable)
    for (int i = 0; i < ELF_SECTIONS; i++) {
        if (i >= eh.shnum)
            break;
        struct { u32 name, type; u64 flags, addr, offset, size; } sh = {};
        char name[11] = {};
        if (bpf_probe_read_user(&sh, sizeof(sh), (void *)(img + eh.shoff + i * 64ULL)) ||
            bpf_probe_read_user(name, 10, (void *)(img + strtab + sh.name)))
            return UNSIZED;
        if (name[0] == '.' && name[1] == 'n' && name[2] == 'v' && name[3] == '.' && name[4] == 'g' &&
            name[5] == 'l' && name[6] == 'o' && name[7] == 'b' && name[8] == 'a' && name[9] == 'l') {
            // summed without wrap-around (issue 47: sizes that wrapped to 64 MiB were charged
            // 64 MiB); a sum past any card is the fail-closed size, admitted never
            if (sh.size > UNFITTABLE - bytes)
                return UNFITTABLE;
            bytes += sh.size;
        }
    }
    return bytes;
}

// ---- at the entry ----

// A graph node's memory, read at its entry (the caller's parameters: in the trace too, not
// only while enforcing) and kept in the call until its return: bytes in a4, its device in want.
// Resolved at compile time: call_enter is inlined with a constant api.
static __always_inline void graph_node_enter(struct pt_regs *ctx, struct cg_thread *t, u16 api, u32 tgid)
{
    if (api != API_cuGraphAddMemAllocNode && api != API_cuGraphAddNode && api != API_cuGraphAddNode_v2)
        return;
    s32 dev = dev_of(t, 0);
    u64 params = api == API_cuGraphAddNode_v2 ? PT_REGS_PARM6(ctx) : t->call.a4;
    if (api == API_cuGraphAddMemAllocNode) {   // (CUgraphNode *, CUgraph, deps, n, CUDA_MEM_ALLOC_NODE_PARAMS *)
        t->call.a4 = alloc_node_bytes(params, tgid, t, &dev);
    } else {                        // (CUgraphNode *, CUgraph, deps, [edgeData,] n, CUgraphNodeParams *)
        u32 type = 0;
        bpf_probe_read_user(&type, sizeof(type), (void *)params);
        t->call.a4 = type == CU_GRAPH_NODE_TYPE_MEM_ALLOC ?
                     alloc_node_bytes(params + NODE_PARAMS_UNION, tgid, t, &dev) : 0;
    }
    t->call.want = dev;
}

// A limit's context, read at its entry (in the trace too) and kept in the call until its return:
// its key (limit_key) in a2, which cuCtxSetLimit(CUlimit, size_t) has no use for.
static __always_inline void limit_enter(struct cg_thread *t, u16 api, u64 id)
{
    if (api != API_cuCtxSetLimit)
        return;
    u32 tgid = id >> 32;
    struct cg_proc *p = procs.lookup(&tgid);
    t->call.a2 = limit_key(id, p, dev_of(t, p), t->call.a0);
}

// What an admitted call that is not an allocation takes (admit_call), on *dev.
static __always_inline u64 indirect_size(struct cg_thread *t, u16 api, u32 tgid, s32 *dev)
{
    struct cg_proc *p = procs.lookup(&tgid);
    if (api == API_cuCtxSetLimit) { // (CUlimit, size_t): what it adds to what that context's took
        struct cg_obj *o = own_obj(tgid, NS_LIMIT, t->call.a2, p);
        u64 now = limit_bytes(t->call.a0, t->call.a1, *dev), was = o ? o->size : 0;
        return now > was ? now - was : 0;
    }
    if (api == API_cuModuleLoadData || api == API_cuModuleLoadDataEx || api == API_cuLibraryLoadData) {   // (CUmodule * or CUlibrary *, const void *image, ...)
        u64 n = image_bytes(t->call.a1);
        return n == UNSIZED || n < DEV_PAGE ? 0 : n;
    }
    struct cg_obj *g = own_obj(tgid, NS_GRAPH, t->call.a1, p);   // instantiate: (CUgraphExec *, CUgraph, ...)
    if (!g)
        return 0;
    *dev = g->dev;
    return g->size;
}
