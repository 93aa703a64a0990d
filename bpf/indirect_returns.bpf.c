// indirect_returns.bpf.c (included by convgpu.bpf.c): the returns of the calls that take memory
// that is not an allocation (indirect.bpf.c sizes them at their entry), and their entries.

#define INDIRECT(name) int enter_##name(struct pt_regs *ctx) { return on_enter(ctx, API_##name); }
INDIRECT(cuCtxSetLimit) INDIRECT(cuGraphAddMemAllocNode) INDIRECT(cuGraphAddNode)
INDIRECT(cuGraphAddNode_v2) INDIRECT(cuGraphInstantiateWithFlags) INDIRECT(cuGraphInstantiateWithParams)
INDIRECT(cuGraphInstantiateWithParams_ptsz) INDIRECT(cuGraphInstantiate_v2)
INDIRECT(cuGraphExecDestroy) INDIRECT(cuGraphDestroy)
INDIRECT(cuModuleLoadData) INDIRECT(cuModuleLoadDataEx) INDIRECT(cuLibraryLoadData)
INDIRECT(cuModuleUnload) INDIRECT(cuLibraryUnload) INDIRECT(cuModuleLoad) INDIRECT(cuLibraryLoadFromFile)

// CUresult cuCtxSetLimit(CUlimit limit, size_t value): what the limit took before on that
// context goes, what it takes now comes (a2: its key, limit_enter). Given back when the context
// is destroyed (exit_ctx_destroy) or at exit.
int exit_ctx_limit(struct pt_regs *ctx)
{
    SETTLE();
    u64 key = c.a2, now = limit_bytes(c.a0, c.a1, dev);
    indirect_gone(id, p, c.api, NS_LIMIT, key);
    if (now)
        obj_add(id, p, c.api, NS_LIMIT, key, now, dev, 0);
    release(&c);
    return 0;
}

// A memory node added: its graph's bytes grow (nothing is taken until it is instantiated).
int exit_graph_node(struct pt_regs *ctx)
{
    SETTLE();
    if (!c.a4)
        goto out;
    struct cg_obj *g = own_obj(tgid, NS_GRAPH, c.a1, p);
    u64 total = c.a4;
    if (g) {
        total = __sync_fetch_and_add(&g->size, c.a4) + c.a4;
    } else {
        struct cg_obj_key k = {.tgid = tgid, .ns = NS_GRAPH, .addr = c.a1};
        struct cg_obj n = {.size = c.a4, .gen = p->gen, .dev = (s32)c.want, .api = c.api, .tid = (u32)id}, was;
        if (obj_put(&k, &n, p, &was))    // no room: its instantiate is charged nothing; the backstop sees it
            stat_inc(ST_UNRECORDED);
    }
    emit(id, c.api, OP_GRAPH, 0, (s32)c.want, c.a1, total, 0, 0);
out:
    release(&c);
    return 0;
}

// An executable graph: charged its memory nodes from its instantiation, before the launch
// that makes them real (driver 580 on an H200: +2,048 MiB at cuGraphLaunch, nothing at
// instantiate; docs/gpu-runs/2026-11-28), until it is destroyed. An allocation the graph does
// not free outlives the executable graph until cuMemFree and cuDeviceGraphMemTrim: NVML counts
// it for the process, its own container's charge, and the backstop's to stop.
int exit_graph_exec(struct pt_regs *ctx)
{
    SETTLE();
    struct cg_obj *g = own_obj(tgid, NS_GRAPH, c.a1, p);
    if (g) {
        u64 bytes = g->size;
        s32 gdev = g->dev;
        bpf_probe_read_user(&v, sizeof(v), (void *)c.a0);
        obj_add(id, p, c.api, NS_GEXEC, v, bytes, gdev, 0);
    }
    release(&c);
    return 0;
}

// CUresult cuGraphExecDestroy(CUgraphExec), cuGraphDestroy(CUgraph)
int exit_graph_gone(struct pt_regs *ctx)
{
    SETTLE();
    if (c.api == API_cuGraphExecDestroy) {
        indirect_gone(id, p, c.api, NS_GEXEC, c.a0);
    } else {
        struct cg_obj_key k = {.tgid = tgid, .ns = NS_GRAPH, .addr = c.a0};
        struct cg_obj *g = objs.lookup(&k);
        if (g && g->gen == p->gen)
            obj_del(&k, g->quota);
    }
    release(&c);
    return 0;
}

// A module or library loaded: its static data charged where its image says it, else only told
// (the backstop's to check); unloaded: given back.
int exit_module(struct pt_regs *ctx)
{
    SETTLE();
    u64 bytes = c.api == API_cuModuleLoad || c.api == API_cuLibraryLoadFromFile ? UNSIZED : image_bytes(c.a1);
    bpf_probe_read_user(&v, sizeof(v), (void *)c.a0);
    if (bytes == UNSIZED)
        emit(id, c.api, OP_UNSIZED, 0, dev, v, 0, 0, 0);
    else if (bytes >= DEV_PAGE)     // less: in the context's own pages (indirect.bpf.c)
        obj_add(id, p, c.api, NS_MODULE, v, bytes, dev, 0);
    release(&c);
    return 0;
}

int exit_module_unload(struct pt_regs *ctx)
{
    SETTLE();
    indirect_gone(id, p, c.api, NS_MODULE, c.a0);
    release(&c);
    return 0;
}
