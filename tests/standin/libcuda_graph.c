/*
 * libcuda_graph.c - test-only stand-in for the CUDA driver, part 4: streams, stream capture,
 * graphs and their memory nodes, the graph memory pool.
 *
 * Graph memory as the driver keeps it (CUDA programming guide, "Graph Memory Nodes"): each
 * alloc node has a fixed address from the moment it is added (cuGraphAddMemAllocNode writes
 * it into dptr) and takes no memory then. The memory becomes real when the graph runs, from a
 * pool per process and device that keeps what it once held ("reserved") until
 * cuDeviceGraphMemTrim gives back what no live allocation uses. On the H200 (driver
 * 580.159.04, issue 39) a 2 GiB node, instantiated, launched and memset, added 2,048 MiB that
 * stayed after the launch. Which call makes it real, the launch or the instantiation, is to be
 * measured on the GPU (tests/gpu/probe_graph_timing.sh); CONVGPU_STANDIN_GRAPH_AT chooses here:
 *   launch (default)  the launch makes each alloc node's memory live;
 *   instantiate       an exec holds its alloc nodes' memory from its instantiation to its
 *                     destruction (the launch then finds it reserved).
 * The process's device memory counts the pool's reserved bytes; reserved = max(reserved,
 * live + held) after each step. A free node, cuMemFree_v2 or cuMemFreeAsync of a graph
 * address makes it not live; it stays reserved. Destroying an exec or a graph leaves live
 * allocations live, as the driver does (they are freed by a free call or at exit).
 *
 * Only memory nodes are known: cuGraphAddNode of any other type is CUDA_ERROR_NOT_SUPPORTED.
 * Same build rule as libcuda.c: -O0 so each exported function begins with `push %rbp`.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdlib.h>
#include <sys/mman.h>

#include "libcuda_int.h"
#include "standin_shm.h"

/* The memory of one alloc node, at its fixed address. */
struct galloc {
    struct obj o;   /* key = its device address, dev = its pool's device, size = bytes it takes */
    int live;       /* made real by a launch, not freed since */
    int held;       /* GRAPH_AT=instantiate: an exec of its graph exists */
    int refs;       /* nodes (of graphs and execs) that name it */
    const void *freed_by;   /* the one graph with a free node of it, if any */
};

struct node {
    CUgraphNodeType type;   /* MEM_ALLOC or MEM_FREE of `a` */
    struct galloc *a;
};

struct graph {
    struct obj o;           /* key = the handle */
    struct node **nodes;    /* node handles are these pointers */
    size_t n, cap;
    int execs;              /* execs instantiated from it and not destroyed */
    int destroyed;          /* cuGraphDestroy'ed, kept while its execs count on it */
};

struct gexec {
    struct obj o;
    struct graph *g;
    struct node *nodes;     /* copies, as an instantiation is */
    size_t n;
    unsigned long long flags;
};

struct stream {
    struct obj o;
    struct graph *capture;  /* while capturing */
};

/* Per device (process ordinal): bytes live, live + held ("demand"), reserved (charged). */
static struct pool {
    uint64_t live, demand, reserved, live_high, reserved_high;
} g_pool[SI_MAX_DEV];
static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER; /* all of this file's state; before tab_lock */
static __thread struct stream t_per_thread;              /* CU_STREAM_PER_THREAD's */

static struct obj *find(uintptr_t key, int kind)
{
    tab_lock();
    struct obj *o = tab_find(key, kind);
    tab_unlock();
    return o;
}

static void insert(struct obj *o, int kind)
{
    o->key = (uintptr_t)o;
    o->kind = kind;
    tab_lock();
    tab_insert(o);
    tab_unlock();
}

static void unlink_obj(struct obj *o)
{
    tab_lock();
    tab_remove(o->key, o->kind);
    tab_unlock();
}

/* --------------------------------------------------------------- the pool */

static void set_state(struct galloc *a, int live, int held)
{
    struct pool *p = &g_pool[a->o.dev];
    uint64_t sz = a->o.size;
    p->demand = p->demand - ((a->live || a->held) ? sz : 0) + ((live || held) ? sz : 0);
    p->live = p->live - (a->live ? sz : 0) + (live ? sz : 0);
    if (p->live > p->live_high)
        p->live_high = p->live;
    a->live = live;
    a->held = held;
}

/* Reserve demand + extra[d] on every device, all or nothing: out of memory changes nothing. */
static CUresult pools_grow(const uint64_t *extra)
{
    uint64_t took[SI_MAX_DEV] = {0};
    for (int d = 0; d < g_ndev; d++) {
        uint64_t need = g_pool[d].demand + extra[d];
        if (need <= g_pool[d].reserved)
            continue;
        CUresult rc = acct_charge(d, need - g_pool[d].reserved);
        if (rc != CUDA_SUCCESS) {
            for (int e = 0; e < d; e++)
                acct_uncharge(e, took[e]);
            return rc;
        }
        took[d] = need - g_pool[d].reserved;
    }
    for (int d = 0; d < g_ndev; d++) {
        g_pool[d].reserved += took[d];
        if (g_pool[d].reserved > g_pool[d].reserved_high)
            g_pool[d].reserved_high = g_pool[d].reserved;
    }
    return CUDA_SUCCESS;
}

/* A graph allocation nothing names and nothing uses is gone (its address with it). */
static void drop_if_unused(struct galloc *a)
{
    if (a->refs || a->live || a->held)
        return;
    unlink_obj(&a->o);
    munmap((void *)a->o.key, a->o.size);
    free(a);
}

int graph_mem_free(uintptr_t addr)
{
    pthread_mutex_lock(&g_mu);
    struct galloc *a = (struct galloc *)find(addr, K_GALLOC);
    int was = a && a->live;
    if (was) {
        set_state(a, 0, a->held);
        drop_if_unused(a);
    }
    pthread_mutex_unlock(&g_mu);
    return was;
}

int graph_mem_live(uintptr_t addr, uint64_t n)
{
    pthread_mutex_lock(&g_mu);
    struct galloc *a = (struct galloc *)find(addr, K_GALLOC);
    int ok = a && a->live && n <= a->o.size;
    pthread_mutex_unlock(&g_mu);
    return ok;
}

API CUresult cuDeviceGraphMemTrim(CUdevice device)
{
    CHECK_INIT();
    if (device < 0 || device >= g_ndev)
        return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&g_mu);
    struct pool *p = &g_pool[device];
    if (p->reserved > p->demand) {
        acct_uncharge(device, p->reserved - p->demand);
        p->reserved = p->demand;
    }
    pthread_mutex_unlock(&g_mu);
    return CUDA_SUCCESS;
}

/* CUresult cuDeviceGetGraphMemAttribute(CUdevice, CUgraphMem_attribute, void *value):
 * value is a cuuint64_t. */
API CUresult cuDeviceGetGraphMemAttribute(CUdevice device, CUgraphMem_attribute attr, void *value)
{
    CHECK_INIT();
    if (device < 0 || device >= g_ndev)
        return CUDA_ERROR_INVALID_DEVICE;
    if (!value || (unsigned)attr > CU_GRAPH_MEM_ATTR_RESERVED_MEM_HIGH)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    struct pool *p = &g_pool[device];
    const uint64_t v[] = {p->live, p->live_high, p->reserved, p->reserved_high};
    *(cuuint64_t *)value = v[attr];
    pthread_mutex_unlock(&g_mu);
    return CUDA_SUCCESS;
}

/* ----------------------------------------------------------------- graphs */

static CUresult graph_new(struct graph **out)
{
    struct graph *g = calloc(1, sizeof *g);
    if (!g)
        return CUDA_ERROR_OUT_OF_MEMORY;
    *out = g;
    return CUDA_SUCCESS;
}

static void graph_free(struct graph *g)
{
    for (size_t i = 0; i < g->n; i++) {
        if (g->nodes[i]->a->freed_by == g)
            g->nodes[i]->a->freed_by = NULL;
        g->nodes[i]->a->refs--;
        drop_if_unused(g->nodes[i]->a);
        free(g->nodes[i]);
    }
    free(g->nodes);
    free(g);
}

static struct graph *graph_of(CUgraph h)
{
    return h ? (struct graph *)find((uintptr_t)h, K_GRAPH) : NULL;
}

static int has_node(const struct graph *g, CUgraphNode h)
{
    for (size_t i = 0; i < g->n; i++)
        if ((CUgraphNode)g->nodes[i] == h)
            return 1;
    return 0;
}

static int deps_ok(const struct graph *g, const CUgraphNode *deps, size_t n)
{
    if (n && !deps)
        return 0;
    for (size_t i = 0; i < n; i++)
        if (!has_node(g, deps[i]))
            return 0;
    return 1;
}

static CUresult add_node(struct graph *g, CUgraphNodeType type, struct galloc *a, CUgraphNode *out)
{
    struct node *n = malloc(sizeof *n);
    if (g->n == g->cap) {
        size_t cap = g->cap ? 2 * g->cap : 8;
        struct node **nodes = realloc(g->nodes, cap * sizeof *nodes);
        if (!nodes) {
            free(n);
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
        g->nodes = nodes, g->cap = cap;
    }
    if (!n)
        return CUDA_ERROR_OUT_OF_MEMORY;
    n->type = type, n->a = a;
    a->refs++;
    g->nodes[g->n++] = n;
    if (out)
        *out = (CUgraphNode)n;
    return CUDA_SUCCESS;
}

/* An alloc node of `bytes` on device `dev`: a fresh address, no memory yet. */
static CUresult add_alloc(struct graph *g, uint64_t bytes, int dev, CUdeviceptr *dptr, CUgraphNode *out)
{
    if (!dptr || bytes == 0 || dev < 0 || dev >= g_ndev)
        return CUDA_ERROR_INVALID_VALUE;
    bytes = footprint(bytes);
    struct galloc *a = calloc(1, sizeof *a);
    void *p = mmap(NULL, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (!a || p == MAP_FAILED) {
        free(a);
        if (p != MAP_FAILED)
            munmap(p, bytes);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    a->o.key = (uintptr_t)p, a->o.kind = K_GALLOC, a->o.dev = dev, a->o.size = bytes;
    CUresult rc = add_node(g, CU_GRAPH_NODE_TYPE_MEM_ALLOC, a, out);
    if (rc != CUDA_SUCCESS) {
        munmap(p, bytes);
        free(a);
        return rc;
    }
    tab_lock();
    tab_insert(&a->o);
    tab_unlock();
    *dptr = (CUdeviceptr)(uintptr_t)p;
    return CUDA_SUCCESS;
}

/* A free node: only of an address an alloc node gave, in one graph only, once
 * (cuGraphAddMemFreeNode's and cuGraphAddMemAllocNode's documented rules). */
static CUresult add_free(struct graph *g, CUdeviceptr dptr, CUgraphNode *out)
{
    struct galloc *a = (struct galloc *)find((uintptr_t)dptr, K_GALLOC);
    if (!a || a->freed_by)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = add_node(g, CU_GRAPH_NODE_TYPE_MEM_FREE, a, out);
    if (rc == CUDA_SUCCESS)
        a->freed_by = g;
    return rc;
}

static int alloc_params_ok(const CUDA_MEM_ALLOC_NODE_PARAMS *p)
{
    return p->poolProps.allocType == CU_MEM_ALLOCATION_TYPE_PINNED &&
           p->poolProps.handleTypes == CU_MEM_HANDLE_TYPE_NONE &&
           p->poolProps.location.type == CU_MEM_LOCATION_TYPE_DEVICE;
}

API CUresult cuGraphCreate(CUgraph *phGraph, unsigned int flags)
{
    CHECK_INIT();
    if (!phGraph || flags)
        return CUDA_ERROR_INVALID_VALUE;
    struct graph *g;
    CUresult rc = graph_new(&g);
    if (rc == CUDA_SUCCESS) {
        insert(&g->o, K_GRAPH);
        *phGraph = (CUgraph)g;
    }
    return rc;
}

/* Both node calls, under g_mu: the graph and its dependencies checked, then the node. */
static CUresult node_call(CUgraphNode *phGraphNode, CUgraph hGraph, const CUgraphNode *deps,
                          size_t ndeps, CUgraphNodeType type, CUDA_MEM_ALLOC_NODE_PARAMS *alloc,
                          CUdeviceptr free_ptr)
{
    if (!phGraphNode || (type == CU_GRAPH_NODE_TYPE_MEM_ALLOC && (!alloc || !alloc_params_ok(alloc))))
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    struct graph *g = graph_of(hGraph);
    if (g && deps_ok(g, deps, ndeps))
        rc = type == CU_GRAPH_NODE_TYPE_MEM_ALLOC
                 ? add_alloc(g, alloc->bytesize, alloc->poolProps.location.id, &alloc->dptr, phGraphNode)
                 : add_free(g, free_ptr, phGraphNode);
    pthread_mutex_unlock(&g_mu);
    return rc;
}

API CUresult cuGraphAddMemAllocNode(CUgraphNode *phGraphNode, CUgraph hGraph,
                                    const CUgraphNode *dependencies, size_t numDependencies,
                                    CUDA_MEM_ALLOC_NODE_PARAMS *nodeParams)
{
    CHECK_INIT();
    return node_call(phGraphNode, hGraph, dependencies, numDependencies,
                     CU_GRAPH_NODE_TYPE_MEM_ALLOC, nodeParams, 0);
}

API CUresult cuGraphAddMemFreeNode(CUgraphNode *phGraphNode, CUgraph hGraph,
                                   const CUgraphNode *dependencies, size_t numDependencies,
                                   CUdeviceptr dptr)
{
    CHECK_INIT();
    return node_call(phGraphNode, hGraph, dependencies, numDependencies,
                     CU_GRAPH_NODE_TYPE_MEM_FREE, NULL, dptr);
}

/* cuGraphAddNode's two versions: the node's type picks the call. The alloc member of the union
 * (CUDA_MEM_ALLOC_NODE_PARAMS_v2) has the v1 struct's layout. */
static CUresult add_by_params(CUgraphNode *phGraphNode, CUgraph hGraph, const CUgraphNode *deps,
                              size_t ndeps, CUgraphNodeParams *p)
{
    if (!p)
        return CUDA_ERROR_INVALID_VALUE;
    if (p->type == CU_GRAPH_NODE_TYPE_MEM_ALLOC)
        return node_call(phGraphNode, hGraph, deps, ndeps, p->type,
                         (CUDA_MEM_ALLOC_NODE_PARAMS *)&p->alloc, 0);
    if (p->type == CU_GRAPH_NODE_TYPE_MEM_FREE)
        return node_call(phGraphNode, hGraph, deps, ndeps, p->type, NULL, p->free.dptr);
    return CUDA_ERROR_NOT_SUPPORTED;   /* kernels, copies...: not in the stand-in */
}

API CUresult cuGraphAddNode(CUgraphNode *phGraphNode, CUgraph hGraph, const CUgraphNode *dependencies,
                            size_t numDependencies, CUgraphNodeParams *nodeParams)
{
    CHECK_INIT();
    return add_by_params(phGraphNode, hGraph, dependencies, numDependencies, nodeParams);
}

API CUresult cuGraphAddNode_v2(CUgraphNode *phGraphNode, CUgraph hGraph, const CUgraphNode *dependencies,
                               const CUgraphEdgeData *dependencyData, size_t numDependencies,
                               CUgraphNodeParams *nodeParams)
{
    CHECK_INIT();
    (void)dependencyData;
    return add_by_params(phGraphNode, hGraph, dependencies, numDependencies, nodeParams);
}

API CUresult cuGraphDestroy(CUgraph hGraph)
{
    CHECK_INIT();
    pthread_mutex_lock(&g_mu);
    struct graph *g = graph_of(hGraph);
    if (g) {
        unlink_obj(&g->o);
        g->destroyed = 1;
        if (g->execs == 0)
            graph_free(g);
    }
    pthread_mutex_unlock(&g_mu);
    return g ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

/* ---------------------------------------------------------- instantiation */

static CUresult instantiate(CUgraphExec *phGraphExec, CUgraph hGraph, unsigned long long flags)
{
    int dev;
    CUresult rc = cur_dev(&dev);
    if (rc)
        return rc;
    if (!phGraphExec || (flags & ~0xfull))
        return CUDA_ERROR_INVALID_VALUE;
    struct gexec *x = calloc(1, sizeof *x);
    if (!x)
        return CUDA_ERROR_OUT_OF_MEMORY;
    pthread_mutex_lock(&g_mu);
    struct graph *g = graph_of(hGraph);
    /* a graph with memory nodes has at most one exec at a time (cuGraphInstantiateWithFlags);
     * the driver's error for a second one is not documented: invalid value here */
    if (!g || (g->n && g->execs))
        rc = CUDA_ERROR_INVALID_VALUE;
    else if (g->n && !(x->nodes = calloc(g->n, sizeof *x->nodes)))
        rc = CUDA_ERROR_OUT_OF_MEMORY;
    uint64_t extra[SI_MAX_DEV] = {0};
    for (size_t i = 0; rc == CUDA_SUCCESS && i < g->n; i++) {
        struct galloc *a = g->nodes[i]->a;
        x->nodes[i] = *g->nodes[i];
        if (g_graph_at_instantiate && x->nodes[i].type == CU_GRAPH_NODE_TYPE_MEM_ALLOC && !a->live && !a->held)
            extra[a->o.dev] += a->o.size;
    }
    if (rc == CUDA_SUCCESS && g_graph_at_instantiate)
        rc = pools_grow(extra);
    if (rc != CUDA_SUCCESS) {
        pthread_mutex_unlock(&g_mu);
        free(x->nodes);
        free(x);
        return rc;
    }
    x->g = g, x->n = g->n, x->flags = flags;
    g->execs++;
    for (size_t i = 0; i < x->n; i++) {
        struct galloc *a = x->nodes[i].a;
        a->refs++;
        if (g_graph_at_instantiate && x->nodes[i].type == CU_GRAPH_NODE_TYPE_MEM_ALLOC)
            set_state(a, a->live, 1);
    }
    insert(&x->o, K_GEXEC);
    pthread_mutex_unlock(&g_mu);
    *phGraphExec = (CUgraphExec)x;
    return CUDA_SUCCESS;
}

API CUresult cuGraphInstantiateWithFlags(CUgraphExec *phGraphExec, CUgraph hGraph, unsigned long long flags)
{
    CHECK_INIT();
    return instantiate(phGraphExec, hGraph, flags);
}

static CUresult with_params(CUgraphExec *phGraphExec, CUgraph hGraph, CUDA_GRAPH_INSTANTIATE_PARAMS *p)
{
    if (!p)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = instantiate(phGraphExec, hGraph, p->flags);
    p->hErrNode_out = NULL;
    p->result_out = rc == CUDA_SUCCESS ? CUDA_GRAPH_INSTANTIATE_SUCCESS : CUDA_GRAPH_INSTANTIATE_ERROR;
    return rc;
}

API CUresult cuGraphInstantiateWithParams(CUgraphExec *phGraphExec, CUgraph hGraph,
                                          CUDA_GRAPH_INSTANTIATE_PARAMS *instantiateParams)
{
    CHECK_INIT();
    return with_params(phGraphExec, hGraph, instantiateParams);
}

API CUresult cuGraphInstantiateWithParams_ptsz(CUgraphExec *phGraphExec, CUgraph hGraph,
                                               CUDA_GRAPH_INSTANTIATE_PARAMS *instantiateParams)
{
    CHECK_INIT();
    return with_params(phGraphExec, hGraph, instantiateParams);
}

/* The CUDA 10 and 11 ABIs (cuda.h's __CUDA_API_VERSION_INTERNAL section): no flags. */
static CUresult with_log(CUgraphExec *phGraphExec, CUgraph hGraph, CUgraphNode *phErrorNode,
                         char *logBuffer, size_t bufferSize)
{
    if (phErrorNode)
        *phErrorNode = NULL;
    if (logBuffer && bufferSize)
        logBuffer[0] = 0;
    return instantiate(phGraphExec, hGraph, 0);
}

API CUresult cuGraphInstantiate(CUgraphExec *phGraphExec, CUgraph hGraph, CUgraphNode *phErrorNode,
                                char *logBuffer, size_t bufferSize)
{
    CHECK_INIT();
    return with_log(phGraphExec, hGraph, phErrorNode, logBuffer, bufferSize);
}

API CUresult cuGraphInstantiate_v2(CUgraphExec *phGraphExec, CUgraph hGraph, CUgraphNode *phErrorNode,
                                   char *logBuffer, size_t bufferSize)
{
    CHECK_INIT();
    return with_log(phGraphExec, hGraph, phErrorNode, logBuffer, bufferSize);
}

API CUresult cuGraphExecDestroy(CUgraphExec hGraphExec)
{
    CHECK_INIT();
    pthread_mutex_lock(&g_mu);
    struct gexec *x = hGraphExec ? (struct gexec *)find((uintptr_t)hGraphExec, K_GEXEC) : NULL;
    if (x) {
        unlink_obj(&x->o);
        for (size_t i = 0; i < x->n; i++) {
            struct galloc *a = x->nodes[i].a;
            if (x->nodes[i].type == CU_GRAPH_NODE_TYPE_MEM_ALLOC && a->held)
                set_state(a, a->live, 0);       /* live allocations stay live */
            a->refs--;
            drop_if_unused(a);
        }
        if (--x->g->execs == 0 && x->g->destroyed)
            graph_free(x->g);
        free(x->nodes);
        free(x);
    }
    pthread_mutex_unlock(&g_mu);
    return x ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

/* ----------------------------------------------------------------- streams */

/* Under g_mu: the stream a handle names; the legacy stream (NULL) is none and never captures. */
static CUresult stream_of(CUstream h, struct stream **out)
{
    *out = NULL;
    if (h == NULL || h == CU_STREAM_LEGACY)
        return CUDA_SUCCESS;
    *out = h == CU_STREAM_PER_THREAD ? &t_per_thread : (struct stream *)find((uintptr_t)h, K_STREAM);
    return *out ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

/* ------------------------------------------------------------------ launch */

/* Under g_mu: is a (freed by a free node of x) live now or allocated by x itself? */
static int freeable(const struct gexec *x, const struct galloc *a)
{
    if (a->live)
        return 1;
    for (size_t i = 0; i < x->n; i++)
        if (x->nodes[i].type == CU_GRAPH_NODE_TYPE_MEM_ALLOC && x->nodes[i].a == a)
            return 1;
    return 0;
}

static CUresult launch(CUgraphExec hGraphExec, CUstream hStream)
{
    int dev;
    CUresult rc = cur_dev(&dev);
    if (rc)
        return rc;
    pthread_mutex_lock(&g_mu);
    struct stream *s;
    struct gexec *x = hGraphExec ? (struct gexec *)find((uintptr_t)hGraphExec, K_GEXEC) : NULL;
    rc = stream_of(hStream, &s);
    if (rc == CUDA_SUCCESS && !x)
        rc = CUDA_ERROR_INVALID_VALUE;
    if (rc == CUDA_SUCCESS && s && s->capture)
        rc = CUDA_ERROR_NOT_SUPPORTED;      /* a launch into a capture: not in the stand-in */
    uint64_t extra[SI_MAX_DEV] = {0};
    for (size_t i = 0; rc == CUDA_SUCCESS && i < x->n; i++) {
        struct galloc *a = x->nodes[i].a;
        if (x->nodes[i].type == CU_GRAPH_NODE_TYPE_MEM_FREE) {
            if (!freeable(x, a))
                rc = CUDA_ERROR_INVALID_VALUE;
        } else if (a->live) {   /* unfreed from the last launch (cuGraphLaunch's documented error) */
            if (!(x->flags & CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH))
                rc = CUDA_ERROR_INVALID_VALUE;
        } else if (!a->held) {
            extra[a->o.dev] += a->o.size;
        }
    }
    if (rc == CUDA_SUCCESS)
        rc = pools_grow(extra);
    /* the allocations first, then the frees: the pool has held them all at once */
    for (size_t i = 0; rc == CUDA_SUCCESS && i < x->n; i++)
        if (x->nodes[i].type == CU_GRAPH_NODE_TYPE_MEM_ALLOC)
            set_state(x->nodes[i].a, 1, x->nodes[i].a->held);
    for (size_t i = 0; rc == CUDA_SUCCESS && i < x->n; i++)
        if (x->nodes[i].type == CU_GRAPH_NODE_TYPE_MEM_FREE)
            set_state(x->nodes[i].a, 0, x->nodes[i].a->held);
    pthread_mutex_unlock(&g_mu);
    return rc;
}

API CUresult cuGraphLaunch(CUgraphExec hGraphExec, CUstream hStream)
{
    CHECK_INIT();
    return launch(hGraphExec, hStream);
}

API CUresult cuGraphLaunch_ptsz(CUgraphExec hGraphExec, CUstream hStream)
{
    CHECK_INIT();
    return launch(hGraphExec, hStream);
}

/* -------------------------------------------------------- stream capture */

API CUresult cuStreamCreate(CUstream *phStream, unsigned int Flags)
{
    CHECK_INIT();
    int dev;
    CUresult rc = cur_dev(&dev);
    if (rc)
        return rc;
    if (!phStream || (Flags & ~(unsigned)CU_STREAM_NON_BLOCKING))
        return CUDA_ERROR_INVALID_VALUE;
    struct stream *s = calloc(1, sizeof *s);
    if (!s)
        return CUDA_ERROR_OUT_OF_MEMORY;
    s->o.dev = dev;
    insert(&s->o, K_STREAM);
    *phStream = (CUstream)s;
    return CUDA_SUCCESS;
}

API CUresult cuStreamDestroy_v2(CUstream hStream)
{
    CHECK_INIT();
    pthread_mutex_lock(&g_mu);
    struct stream *s = hStream ? (struct stream *)find((uintptr_t)hStream, K_STREAM) : NULL;
    if (s) {
        unlink_obj(&s->o);
        if (s->capture)
            graph_free(s->capture);     /* the capture ends with it */
        free(s);
    }
    pthread_mutex_unlock(&g_mu);
    return s ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

static CUresult begin_capture(CUstream hStream, CUstreamCaptureMode mode)
{
    int dev;
    CUresult rc = cur_dev(&dev);
    if (rc)
        return rc;
    if ((unsigned)mode > CU_STREAM_CAPTURE_MODE_RELAXED)
        return CUDA_ERROR_INVALID_VALUE;
    if (hStream == NULL || hStream == CU_STREAM_LEGACY)
        return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;   /* "may not be initiated" on the legacy stream */
    pthread_mutex_lock(&g_mu);
    struct stream *s;
    rc = stream_of(hStream, &s);
    if (rc == CUDA_SUCCESS && s->capture)
        rc = CUDA_ERROR_ILLEGAL_STATE;                  /* already capturing */
    if (rc == CUDA_SUCCESS)
        rc = graph_new(&s->capture);
    pthread_mutex_unlock(&g_mu);
    return rc;
}

static CUresult end_capture(CUstream hStream, CUgraph *phGraph)
{
    if (!phGraph)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    struct stream *s;
    CUresult rc = stream_of(hStream, &s);
    if (rc == CUDA_SUCCESS && (!s || !s->capture))
        rc = CUDA_ERROR_ILLEGAL_STATE;                  /* not capturing */
    if (rc == CUDA_SUCCESS) {
        insert(&s->capture->o, K_GRAPH);
        *phGraph = (CUgraph)s->capture;
        s->capture = NULL;
    }
    pthread_mutex_unlock(&g_mu);
    return rc;
}

static CUresult is_capturing(CUstream hStream, CUstreamCaptureStatus *status)
{
    if (!status)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    struct stream *s;
    CUresult rc = stream_of(hStream, &s);
    if (rc == CUDA_SUCCESS)
        *status = s && s->capture ? CU_STREAM_CAPTURE_STATUS_ACTIVE : CU_STREAM_CAPTURE_STATUS_NONE;
    pthread_mutex_unlock(&g_mu);
    return rc;
}

API CUresult cuStreamBeginCapture_v2(CUstream hStream, CUstreamCaptureMode mode)
{
    CHECK_INIT();
    return begin_capture(hStream, mode);
}

API CUresult cuStreamBeginCapture_v2_ptsz(CUstream hStream, CUstreamCaptureMode mode)
{
    CHECK_INIT();
    return begin_capture(hStream, mode);
}

API CUresult cuStreamEndCapture(CUstream hStream, CUgraph *phGraph)
{
    CHECK_INIT();
    return end_capture(hStream, phGraph);
}

API CUresult cuStreamEndCapture_ptsz(CUstream hStream, CUgraph *phGraph)
{
    CHECK_INIT();
    return end_capture(hStream, phGraph);
}

API CUresult cuStreamIsCapturing(CUstream hStream, CUstreamCaptureStatus *captureStatus)
{
    CHECK_INIT();
    return is_capturing(hStream, captureStatus);
}

API CUresult cuStreamIsCapturing_ptsz(CUstream hStream, CUstreamCaptureStatus *captureStatus)
{
    CHECK_INIT();
    return is_capturing(hStream, captureStatus);
}

CUresult capture_alloc(CUstream hStream, CUdeviceptr *dptr, uint64_t bytes, int dev, int *captured)
{
    pthread_mutex_lock(&g_mu);
    struct stream *s;
    CUresult rc = stream_of(hStream, &s);
    *captured = rc == CUDA_SUCCESS && s && s->capture;
    if (*captured)
        rc = add_alloc(s->capture, bytes, dev, dptr, NULL);
    pthread_mutex_unlock(&g_mu);
    return *captured ? rc : CUDA_SUCCESS;   /* an unknown stream: as before, not checked */
}

CUresult capture_free(CUstream hStream, CUdeviceptr dptr, int *captured)
{
    pthread_mutex_lock(&g_mu);
    struct stream *s;
    CUresult rc = stream_of(hStream, &s);
    *captured = rc == CUDA_SUCCESS && s && s->capture;
    if (*captured)
        rc = add_free(s->capture, dptr, NULL);
    pthread_mutex_unlock(&g_mu);
    return *captured ? rc : CUDA_SUCCESS;
}
