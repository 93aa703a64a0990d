/*
 * cgcaller.c - drives one family of CUDA memory APIs so tests can check what
 * convgpu's probes saw.  Linked against "libcuda.so.1" by name with no
 * rpath: LD_LIBRARY_PATH picks the stand-in (build/standin) or, on a GPU
 * machine, the real driver, so only real-driver semantics are used here.
 *
 * usage: cgcaller FAMILY [-n COUNT] [-s SIZE] [-t THREADS] [-d DEVICE]
 *                 [--hold] [--no-free] [--hold-freed] [--image FILE [--from-file]] [--orphan]
 *                 [--limit stack|heap|fifo]
 * FAMILY: alloc pitch managed vmm async array ctx fail runtime
 *         stack heap fifo ctxlimit graph capture module graphprobe
 * SIZE accepts a K/M/G/T suffix (powers of 1024).
 *
 * stdout protocol (line-buffered):
 *   allocated COUNT_TOTAL BYTES_TOTAL pid=PID   after every thread allocated
 *   ready
 *   (--hold: waits for one stdin line or EOF here)
 *   freed COUNT BYTES                            (--no-free: "freed 0 0")
 *   (--hold-freed: waits for one stdin line or EOF here, freed but alive)
 *   exit
 * fail family: first "failed cuMemAlloc_v2 CODE", then the protocol above
 *   with "allocated 0 0 ..." and "freed 0 0"; exit status 0 iff CODE != 0.
 * --orphan: a child forked before cuInit (it makes no CUDA call) is sent every descriptor of
 *   this process over a unix socket (SCM_RIGHTS) after "allocated ... ready"; it prints
 *   "holding N pid=CHILD" and keeps them until stdin ends, while this process prints
 *   "orphaned pid=CHILD" and leaves with _exit(0): nothing freed, no exit handler run. The
 *   driver's files outlive the process that allocated (issue 47 finding 2).
 * graphprobe family: "started pid=PID", then one "step NAME ..." line after each step of a
 *   graph's life (--hold: waits for a stdin line after each), then "exit".
 * The primary context is retained once and, like cudart does, never
 * released: process exit cleans it up.
 * Unexpected CUresult: "error API CODE" on stderr, exit status 2.
 * Informational lines go to stderr, prefixed "info ".
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <dirent.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "cuda_min.h"

static struct {
    const char *family;
    long count;
    uint64_t size;
    int size_set;
    int threads;
    int device;
    int hold;
    int nofree;
    int hold_freed;
    const char *image;
    int from_file;
    int orphan;
    CUlimit limit;      /* ctxlimit: which one */
} O = {NULL, 1, 1 << 20, 0, 1, 0, 0, 0, 0, NULL, 0, 0, CU_LIMIT_MALLOC_HEAP_SIZE};

static CUdevice g_dev;
static CUcontext g_prim;
static size_t g_old_limit;          /* stack/heap/fifo: the value before, restored at the free */
static void *g_image;               /* module: the image cuModuleLoadData is given */
static uint64_t g_image_bytes;      /* ...and the device bytes it says it takes (0: not known) */
static pthread_barrier_t b_start, b_alloc, b_free;

static struct {
    PFN_cudaMalloc Malloc;
    PFN_cudaMallocManaged MallocManaged;
    PFN_cudaMallocPitch MallocPitch;
    PFN_cudaMalloc3D Malloc3D;
    PFN_cudaFree Free;
    PFN_cudaMemGetInfo MemGetInfo;
    PFN_cudaSetDevice SetDevice;
} RT;
static PFN_cuCtxCreate_v4 p_ctx_v4;
static PFN_cuCtxCreate_v2 p_ctx_v2;

/* Per-thread state: what it allocated, so the free phase can undo it. */
struct ts {
    pthread_t th;
    uint64_t acount, abytes, fcount, fbytes;
    CUdeviceptr *ptrs; /* alloc/pitch/managed/async/ctx: 2*count slots */
    void **rptrs;      /* runtime: count + 3 */
    CUmemGenericAllocationHandle *handles;
    CUarray *arr;      /* 2 per iteration */
    CUmipmappedArray *mip;
    CUdeviceptr resv;
    size_t resv_size, vsize;
    CUcontext ctx;
    CUcontext *ctxs;    /* ctxlimit: count each */
    CUgraph *graphs;    /* graph/capture: count each */
    CUgraphExec *execs;
    CUmodule *mods;     /* module */
    CUstream stream;
};

static void die(const char *api, long code)
{
    fflush(stdout);
    fprintf(stderr, "error %s %ld\n", api, code);
    fflush(stderr);
    _exit(2);
}

#define CK(api, call)                          \
    do {                                       \
        CUresult r_ = (call);                  \
        if (r_ != CUDA_SUCCESS)                \
            die(api, (long)r_);                \
    } while (0)
#define RK(api, call)                          \
    do {                                       \
        cudaError_t r_ = (call);               \
        if (r_ != cudaSuccess)                 \
            die(api, (long)r_);                \
    } while (0)

static void *xcalloc(size_t n, size_t sz)
{
    void *p = calloc(n ? n : 1, sz);
    if (!p)
        die("calloc", ENOMEM);
    return p;
}

/* ---------------------------------------------------------------- families */

static void fam_alloc(struct ts *t, int free_phase)
{
    for (long i = 0; i < O.count; i++) {
        if (!free_phase) {
            CK("cuMemAlloc_v2", cuMemAlloc_v2(&t->ptrs[i], O.size));
            t->acount++, t->abytes += O.size;
        } else {
            CK("cuMemFree_v2", cuMemFree_v2(t->ptrs[i]));
            t->fcount++, t->fbytes += O.size;
        }
    }
}

static void fam_pitch(struct ts *t, int free_phase)
{
    static __thread size_t pitch; /* same for every call of a thread */
    for (long i = 0; i < O.count; i++) {
        if (!free_phase) {
            CK("cuMemAllocPitch_v2", cuMemAllocPitch_v2(&t->ptrs[i], &pitch, O.size, 4, 4));
            t->acount++, t->abytes += (uint64_t)pitch * 4;
        } else {
            CK("cuMemFree_v2", cuMemFree_v2(t->ptrs[i]));
            t->fcount++, t->fbytes += (uint64_t)pitch * 4;
        }
    }
}

static void fam_managed(struct ts *t, int free_phase)
{
    for (long i = 0; i < O.count; i++) {
        if (!free_phase) {
            CK("cuMemAllocManaged", cuMemAllocManaged(&t->ptrs[i], O.size, CU_MEM_ATTACH_GLOBAL));
            t->acount++, t->abytes += O.size;
        } else {
            CK("cuMemFree_v2", cuMemFree_v2(t->ptrs[i]));
            t->fcount++, t->fbytes += O.size;
        }
    }
}

static void fam_vmm(struct ts *t, int free_phase)
{
    if (!free_phase) {
        CUmemAllocationProp prop;
        memset(&prop, 0, sizeof prop);
        prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_NONE;
        prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        prop.location.id = g_dev;
        size_t g = 0;
        CK("cuMemGetAllocationGranularity",
           cuMemGetAllocationGranularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
        t->vsize = (O.size + g - 1) / g * g;
        t->resv_size = t->vsize * (size_t)O.count;
        CK("cuMemAddressReserve", cuMemAddressReserve(&t->resv, t->resv_size, 0, 0, 0));
        CUmemAccessDesc acc;
        acc.location = prop.location;
        acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
        for (long i = 0; i < O.count; i++) {
            CUdeviceptr at = t->resv + (CUdeviceptr)i * t->vsize;
            CK("cuMemCreate", cuMemCreate(&t->handles[i], t->vsize, &prop, 0));
            CK("cuMemMap", cuMemMap(at, t->vsize, 0, t->handles[i], 0));
            CK("cuMemSetAccess", cuMemSetAccess(at, t->vsize, &acc, 1));
            t->acount++, t->abytes += t->vsize;
        }
        return;
    }
    for (long i = 0; i < O.count; i++) {
        CUdeviceptr at = t->resv + (CUdeviceptr)i * t->vsize;
        if (i % 2 == 0) {
            CK("cuMemUnmap", cuMemUnmap(at, t->vsize));
            CK("cuMemRelease", cuMemRelease(t->handles[i]));
        } else { /* release while mapped: the free happens at the unmap */
            CK("cuMemRelease", cuMemRelease(t->handles[i]));
            CK("cuMemUnmap", cuMemUnmap(at, t->vsize));
        }
        t->fcount++, t->fbytes += t->vsize;
    }
    CK("cuMemAddressFree", cuMemAddressFree(t->resv, t->resv_size));
}

static void fam_async(struct ts *t, int free_phase)
{
    if (!free_phase) {
        CUmemoryPool pool;
        CK("cuDeviceGetDefaultMemPool", cuDeviceGetDefaultMemPool(&pool, g_dev));
        for (long i = 0; i < O.count; i++) {
            CK("cuMemAllocAsync", cuMemAllocAsync(&t->ptrs[i], O.size, 0));
            t->acount++, t->abytes += O.size;
        }
        for (long i = 0; i < O.count; i++) {
            CK("cuMemAllocFromPoolAsync",
               cuMemAllocFromPoolAsync(&t->ptrs[O.count + i], O.size, pool, 0));
            t->acount++, t->abytes += O.size;
        }
    } else {
        for (long i = 0; i < 2 * O.count; i++) {
            CK("cuMemFreeAsync", cuMemFreeAsync(t->ptrs[i], 0));
            t->fcount++, t->fbytes += O.size;
        }
    }
    CK("cuStreamSynchronize", cuStreamSynchronize(0));
}

/* Arrays: fixed shapes (SIZE is ignored), bytes by the stand-in's formula
 * W*max(H,1)*max(D,1)*channels*elemsize, mipmaps summed over halved levels. */
#define ARR2D_BYTES (256ull * 256 * 4)
#define ARR3D_BYTES (64ull * 64 * 16 * 4)
#define MIP_BYTES (256ull * 256 * 4 + 128ull * 128 * 4 + 64ull * 64 * 4)

static void fam_array(struct ts *t, int free_phase)
{
    for (long i = 0; i < O.count; i++) {
        if (!free_phase) {
            CUDA_ARRAY_DESCRIPTOR d2 = {256, 256, CU_AD_FORMAT_FLOAT, 1};
            CUDA_ARRAY3D_DESCRIPTOR d3 = {64, 64, 16, CU_AD_FORMAT_FLOAT, 1, 0};
            CUDA_ARRAY3D_DESCRIPTOR dm = {256, 256, 0, CU_AD_FORMAT_FLOAT, 1, 0};
            CK("cuArrayCreate_v2", cuArrayCreate_v2(&t->arr[2 * i], &d2));
            CK("cuArray3DCreate_v2", cuArray3DCreate_v2(&t->arr[2 * i + 1], &d3));
            CK("cuMipmappedArrayCreate", cuMipmappedArrayCreate(&t->mip[i], &dm, 3));
            t->acount += 3, t->abytes += ARR2D_BYTES + ARR3D_BYTES + MIP_BYTES;
        } else {
            CK("cuArrayDestroy", cuArrayDestroy(t->arr[2 * i]));
            CK("cuArrayDestroy", cuArrayDestroy(t->arr[2 * i + 1]));
            CK("cuMipmappedArrayDestroy", cuMipmappedArrayDestroy(t->mip[i]));
            t->fcount += 3, t->fbytes += ARR2D_BYTES + ARR3D_BYTES + MIP_BYTES;
        }
    }
}

static void fam_ctx(struct ts *t, int free_phase)
{
    if (!free_phase) {
        if (p_ctx_v4)
            CK("cuCtxCreate_v4", p_ctx_v4(&t->ctx, NULL, 0, g_dev));
        else
            CK("cuCtxCreate_v2", p_ctx_v2(&t->ctx, 0, g_dev));
        /* Creation made it current; pop and push it back explicitly. */
        CUcontext popped = NULL;
        CK("cuCtxPopCurrent_v2", cuCtxPopCurrent_v2(&popped));
        if (popped != t->ctx)
            die("cuCtxPopCurrent_v2(wrong-context)", -1);
        CK("cuCtxPushCurrent_v2", cuCtxPushCurrent_v2(t->ctx));
        for (long i = 0; i < O.count; i++) {
            CK("cuMemAlloc_v2", cuMemAlloc_v2(&t->ptrs[i], O.size));
            t->acount++, t->abytes += O.size;
        }
        return;
    }
    for (long i = 0; i < O.count; i++) {
        CK("cuMemFree_v2", cuMemFree_v2(t->ptrs[i]));
        t->fcount++, t->fbytes += O.size;
    }
    CUcontext popped = NULL;
    CK("cuCtxPopCurrent_v2", cuCtxPopCurrent_v2(&popped));
    CK("cuCtxDestroy_v2", cuCtxDestroy_v2(t->ctx));
}

static void fam_runtime(struct ts *t, int free_phase)
{
    long n = O.count;
    if (free_phase) {
        for (long i = 0; i < n + 3; i++)
            RK("cudaFree", RT.Free(t->rptrs[i]));
        t->fcount = t->acount, t->fbytes = t->abytes;
        return;
    }
    RK("cudaSetDevice", RT.SetDevice(g_dev));
    for (long i = 0; i < n; i++) {
        RK("cudaMalloc", RT.Malloc(&t->rptrs[i], O.size));
        t->acount++, t->abytes += O.size;
    }
    size_t pitch = 0;
    RK("cudaMallocPitch", RT.MallocPitch(&t->rptrs[n], &pitch, O.size, 4));
    t->acount++, t->abytes += (uint64_t)pitch * 4;
    struct cudaPitchedPtr pp;
    struct cudaExtent ext = {O.size, 2, 2};
    RK("cudaMalloc3D", RT.Malloc3D(&pp, ext));
    t->rptrs[n + 1] = pp.ptr;
    t->acount++, t->abytes += (uint64_t)pp.pitch * 2 * 2;
    RK("cudaMallocManaged", RT.MallocManaged(&t->rptrs[n + 2], O.size, cudaMemAttachGlobal));
    t->acount++, t->abytes += O.size;
    size_t fr = 0, tot = 0;
    RK("cudaMemGetInfo", RT.MemGetInfo(&fr, &tot));
}

/* stack/heap/fifo: memory the driver takes for a context limit (issue 39). Every thread sets
 * the same value of the one primary context; the free sets back the value read before the
 * threads started. Counted bytes: the value (the driver's cost is its own: README.md). */
static void set_limit(struct ts *t, int free_phase, CUlimit which)
{
    CK("cuCtxSetLimit", cuCtxSetLimit(which, free_phase ? g_old_limit : O.size));
    size_t now = 0;
    CK("cuCtxGetLimit", cuCtxGetLimit(&now, which));
    if (!free_phase)
        t->acount++, t->abytes += O.size;
    else
        t->fcount++, t->fbytes += O.size;
}

static void fam_stack(struct ts *t, int free_phase) { set_limit(t, free_phase, CU_LIMIT_STACK_SIZE); }
static void fam_heap(struct ts *t, int free_phase) { set_limit(t, free_phase, CU_LIMIT_MALLOC_HEAP_SIZE); }
static void fam_fifo(struct ts *t, int free_phase) { set_limit(t, free_phase, CU_LIMIT_PRINTF_FIFO_SIZE); }

/* ctxlimit: COUNT contexts made first (each cuCtxCreate makes it current; popped back at once),
 * then each given the --limit of SIZE (pushed, cuCtxSetLimit, popped): the driver keeps limits
 * per context, so COUNT of them take COUNT times. Free: the first context destroyed (its limit
 * with it); the others go at exit. Counted bytes: SIZE per context. */
static void fam_ctxlimit(struct ts *t, int free_phase)
{
    CUcontext popped = NULL;
    if (free_phase) {
        CK("cuCtxDestroy_v2", cuCtxDestroy_v2(t->ctxs[0]));
        t->fcount++, t->fbytes += O.size;
        return;
    }
    for (long i = 0; i < O.count; i++) {
        if (p_ctx_v4)
            CK("cuCtxCreate_v4", p_ctx_v4(&t->ctxs[i], NULL, 0, g_dev));
        else
            CK("cuCtxCreate_v2", p_ctx_v2(&t->ctxs[i], 0, g_dev));
        CK("cuCtxPopCurrent_v2", cuCtxPopCurrent_v2(&popped));
    }
    for (long i = 0; i < O.count; i++) {
        CK("cuCtxPushCurrent_v2", cuCtxPushCurrent_v2(t->ctxs[i]));
        CK("cuCtxSetLimit", cuCtxSetLimit(O.limit, O.size));
        fprintf(stderr, "info limit %ld set\n", i);
        CK("cuCtxPopCurrent_v2", cuCtxPopCurrent_v2(&popped));
        t->acount++, t->abytes += O.size;
    }
}

/* graph/capture: COUNT graphs of one alloc node of SIZE each, instantiated, launched into a
 * stream of the thread's own, then memset on the legacy stream so the memory is touched (on a
 * GPU). Free: cuMemFreeAsync each (allowed for graph memory outside its graph), then the
 * execs and graphs destroyed and the device's graph memory trimmed, so it is given back. */
static void graph_run(struct ts *t, long i)
{
    CK("cuGraphInstantiateWithFlags", cuGraphInstantiateWithFlags(&t->execs[i], t->graphs[i], 0));
    CK("cuGraphLaunch", cuGraphLaunch(t->execs[i], t->stream));
    t->acount++, t->abytes += O.size;
}

static void graph_touch_or_free(struct ts *t, int free_phase)
{
    if (!free_phase) {
        CK("cuStreamSynchronize", cuStreamSynchronize(t->stream));
        for (long i = 0; i < O.count; i++)
            CK("cuMemsetD8_v2", cuMemsetD8_v2(t->ptrs[i], 0, O.size));
        CK("cuStreamSynchronize", cuStreamSynchronize(0));
        return;
    }
    for (long i = 0; i < O.count; i++) {
        CK("cuMemFreeAsync", cuMemFreeAsync(t->ptrs[i], t->stream));
        t->fcount++, t->fbytes += O.size;
    }
    CK("cuStreamSynchronize", cuStreamSynchronize(t->stream));
    for (long i = 0; i < O.count; i++) {
        CK("cuGraphExecDestroy", cuGraphExecDestroy(t->execs[i]));
        CK("cuGraphDestroy", cuGraphDestroy(t->graphs[i]));
    }
    CK("cuDeviceGraphMemTrim", cuDeviceGraphMemTrim(g_dev));
    CK("cuStreamDestroy_v2", cuStreamDestroy_v2(t->stream));
}

static void alloc_node_params(CUDA_MEM_ALLOC_NODE_PARAMS *p, uint64_t bytes)
{
    memset(p, 0, sizeof *p);
    p->poolProps.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
    p->poolProps.handleTypes = CU_MEM_HANDLE_TYPE_NONE;
    p->poolProps.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    p->poolProps.location.id = g_dev;
    p->bytesize = bytes;
}

static void fam_graph(struct ts *t, int free_phase)
{
    if (!free_phase) {
        CK("cuStreamCreate", cuStreamCreate(&t->stream, CU_STREAM_NON_BLOCKING));
        for (long i = 0; i < O.count; i++) {
            CUDA_MEM_ALLOC_NODE_PARAMS p;
            CUgraphNode node;
            alloc_node_params(&p, O.size);
            CK("cuGraphCreate", cuGraphCreate(&t->graphs[i], 0));
            CK("cuGraphAddMemAllocNode", cuGraphAddMemAllocNode(&node, t->graphs[i], NULL, 0, &p));
            t->ptrs[i] = p.dptr;
            graph_run(t, i);
        }
    }
    graph_touch_or_free(t, free_phase);
}

/* The graph made by capturing one cuMemAllocAsync (relaxed mode: no other call of the
 * process is affected by the capture). */
static void fam_capture(struct ts *t, int free_phase)
{
    if (!free_phase) {
        CK("cuStreamCreate", cuStreamCreate(&t->stream, CU_STREAM_NON_BLOCKING));
        for (long i = 0; i < O.count; i++) {
            CK("cuStreamBeginCapture_v2", cuStreamBeginCapture_v2(t->stream, CU_STREAM_CAPTURE_MODE_RELAXED));
            CK("cuMemAllocAsync", cuMemAllocAsync(&t->ptrs[i], O.size, t->stream));
            CK("cuStreamEndCapture", cuStreamEndCapture(t->stream, &t->graphs[i]));
            graph_run(t, i);
        }
    }
    graph_touch_or_free(t, free_phase);
}

/* COUNT x cuModuleLoadData of the image (the stand-in's of SIZE bytes, or --image FILE's
 * bytes: a real cubin or fatbin on a GPU host), or with --from-file cuModuleLoad of FILE (no
 * probe can read a file's size at the call: the backstop's case) / cuModuleUnload. */
static void fam_module(struct ts *t, int free_phase)
{
    for (long i = 0; i < O.count; i++) {
        if (!free_phase && O.from_file) {
            CK("cuModuleLoad", cuModuleLoad(&t->mods[i], O.image));
            t->acount++, t->abytes += g_image_bytes;
        } else if (!free_phase) {
            CK("cuModuleLoadData", cuModuleLoadData(&t->mods[i], g_image));
            t->acount++, t->abytes += g_image_bytes;
        } else {
            CK("cuModuleUnload", cuModuleUnload(t->mods[i]));
            t->fcount++, t->fbytes += g_image_bytes;
        }
    }
}

static const struct {
    const char *name;
    void (*fn)(struct ts *, int);
} g_fams[] = {
    {"alloc", fam_alloc}, {"pitch", fam_pitch}, {"managed", fam_managed},
    {"vmm", fam_vmm},     {"async", fam_async}, {"array", fam_array},
    {"ctx", fam_ctx},     {"runtime", fam_runtime}, {"stack", fam_stack},
    {"heap", fam_heap},   {"fifo", fam_fifo},   {"graph", fam_graph},
    {"capture", fam_capture}, {"module", fam_module}, {"ctxlimit", fam_ctxlimit},
};
static void (*g_fn)(struct ts *, int);

/* ------------------------------------------------------------------ driver */

static void *thread_main(void *arg)
{
    struct ts *t = arg;
    CK("cuCtxSetCurrent", cuCtxSetCurrent(g_prim)); /* contexts are per thread */
    pthread_barrier_wait(&b_start);
    g_fn(t, 0);
    pthread_barrier_wait(&b_alloc);
    if (O.nofree)
        return NULL;
    pthread_barrier_wait(&b_free);
    g_fn(t, 1);
    return NULL;
}

static void load_runtime(void)
{
    void *h = dlopen("libcudart.so.13", RTLD_NOW | RTLD_LOCAL);
    if (!h)
        h = dlopen("libcudart.so", RTLD_NOW | RTLD_LOCAL);
    if (!h)
        die("dlopen(libcudart)", -1);
#define RSYM(f, n)                                  \
    if (!(*(void **)&RT.f = dlsym(h, n)))           \
        die("dlsym(" n ")", -1);
    RSYM(Malloc, "cudaMalloc");
    RSYM(MallocManaged, "cudaMallocManaged");
    RSYM(MallocPitch, "cudaMallocPitch");
    RSYM(Malloc3D, "cudaMalloc3D");
    RSYM(Free, "cudaFree");
    RSYM(MemGetInfo, "cudaMemGetInfo");
    RSYM(SetDevice, "cudaSetDevice");
#undef RSYM
}

/* --hold: wait for one line on stdin, or EOF. */
static void wait_for_go(void)
{
    char line[256];
    if (O.hold && !fgets(line, sizeof line, stdin))
        clearerr(stdin); /* EOF is a go as well */
}

/* One allocation that must fail (the test sets a capacity below SIZE; on
 * a GPU the default 1 TiB fails).  Then the usual protocol with nothing
 * allocated, so a test can inspect the process while it holds. */
static int run_fail(void)
{
    CUdeviceptr p = 0;
    CUresult r = cuMemAlloc_v2(&p, O.size);
    printf("failed cuMemAlloc_v2 %d\n", (int)r);
    if (r == CUDA_SUCCESS) {
        cuMemFree_v2(p);
        fprintf(stderr, "error cuMemAlloc_v2 0 (expected a failure)\n");
    }
    printf("allocated 0 0 pid=%d\n", (int)getpid());
    printf("ready\n");
    wait_for_go();
    printf("freed 0 0\n");
    printf("exit\n");
    return r == CUDA_SUCCESS ? 1 : 0;
}

/* graphprobe: which call makes graph memory real on this driver? One step at a time, each
 * followed by a line with the driver's own graph-memory figures and device free memory (and,
 * with --hold, a wait, so that a script reads NVML's per-process memory there:
 * tests/gpu/probe_graph_timing.sh). SIZE: the alloc node's bytes. */
static void step(const char *name)
{
    cuuint64_t used = 0, reserved = 0;
    size_t fr = 0, tot = 0;
    CK("cuDeviceGetGraphMemAttribute",
       cuDeviceGetGraphMemAttribute(g_dev, CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT, &used));
    CK("cuDeviceGetGraphMemAttribute",
       cuDeviceGetGraphMemAttribute(g_dev, CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT, &reserved));
    CK("cuMemGetInfo_v2", cuMemGetInfo_v2(&fr, &tot));
    printf("step %s graph_used=%llu graph_reserved=%llu device_free=%zu\n", name,
           (unsigned long long)used, (unsigned long long)reserved, fr);
    wait_for_go();
}

static int run_graphprobe(void)
{
    CUgraph g;
    CUgraphNode node;
    CUgraphExec x;
    CUstream s;
    CUDA_MEM_ALLOC_NODE_PARAMS p;
    printf("started pid=%d\n", (int)getpid());
    step("context");
    CK("cuCtxSetLimit", cuCtxSetLimit(CU_LIMIT_STACK_SIZE, 64 << 10));
    step("stack-64KiB");
    CK("cuStreamCreate", cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
    CK("cuGraphCreate", cuGraphCreate(&g, 0));
    alloc_node_params(&p, O.size);
    CK("cuGraphAddMemAllocNode", cuGraphAddMemAllocNode(&node, g, NULL, 0, &p));
    step("node-added");
    CK("cuGraphInstantiateWithFlags", cuGraphInstantiateWithFlags(&x, g, 0));
    step("instantiated");
    CK("cuGraphLaunch", cuGraphLaunch(x, s));
    CK("cuStreamSynchronize", cuStreamSynchronize(s));
    step("launched");
    CK("cuMemsetD8_v2", cuMemsetD8_v2(p.dptr, 0, O.size));
    CK("cuStreamSynchronize", cuStreamSynchronize(0));
    step("memset");
    CK("cuGraphExecDestroy", cuGraphExecDestroy(x));
    step("exec-destroyed");
    CK("cuGraphDestroy", cuGraphDestroy(g));
    step("graph-destroyed");
    CK("cuDeviceGraphMemTrim", cuDeviceGraphMemTrim(g_dev));
    step("trimmed");
    CK("cuMemFree_v2", cuMemFree_v2(p.dptr));
    step("freed");
    CK("cuDeviceGraphMemTrim", cuDeviceGraphMemTrim(g_dev));
    step("trimmed-after-free");
    CK("cuCtxSetLimit", cuCtxSetLimit(CU_LIMIT_MALLOC_HEAP_SIZE, 4ull << 30));
    step("heap-4GiB");
    CK("cuStreamDestroy_v2", cuStreamDestroy_v2(s));
    printf("exit\n");
    return 0;
}

/* --image FILE: its bytes, whole (this caller's own file). */
static void *read_image(const char *path)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        die("fopen(--image)", errno);
    size_t cap = 1 << 20, n = 0, got;
    char *buf = malloc(cap + 1);
    while (buf && (got = fread(buf + n, 1, cap - n, f)) > 0)
        if ((n += got) == cap && !(buf = realloc(buf, (cap *= 2) + 1)))
            break;
    if (!buf)
        die("malloc(--image)", ENOMEM);
    fclose(f);
    buf[n] = 0;         /* PTX images are NUL-terminated text */
    fprintf(stderr, "info module-image %s %zu bytes\n", path, n);
    return buf;
}

static uint64_t parse_size(const char *s)
{
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 0);
    int sh = 0;
    switch (*end) {
    case 'k': case 'K': sh = 10; end++; break;
    case 'm': case 'M': sh = 20; end++; break;
    case 'g': case 'G': sh = 30; end++; break;
    case 't': case 'T': sh = 40; end++; break;
    }
    if (errno || *end || end == s) {
        fprintf(stderr, "bad size: %s\n", s);
        exit(64);
    }
    return (uint64_t)v << sh;
}

/* --orphan: the holder, forked before cuInit. It takes what it is sent and keeps it. */
static int orphan_sock = -1;
static pid_t orphan_pid;

static void orphan_fork(void)
{
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0, sv) != 0)
        die("socketpair", errno);
    orphan_pid = fork();
    if (orphan_pid < 0)
        die("fork", errno);
    if (orphan_pid > 0) {
        close(sv[1]);
        orphan_sock = sv[0];
        return;
    }
    close(sv[0]);
    char byte, ctl[CMSG_SPACE(253 * sizeof(int))];
    struct iovec iov = {&byte, 1};
    struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl, .msg_controllen = sizeof ctl};
    if (recvmsg(sv[1], &m, 0) != 1)
        _exit(3);
    struct cmsghdr *c = CMSG_FIRSTHDR(&m);
    size_t n = c ? (c->cmsg_len - CMSG_LEN(0)) / sizeof(int) : 0;
    printf("holding %zu pid=%d\n", n, (int)getpid());
    char line[256];
    while (fgets(line, sizeof line, stdin))   /* until stdin ends: the test's word */
        ;
    _exit(0);
}

static void orphan_leave(void)
{
    int fds[253], n = 0;
    DIR *d = opendir("/proc/self/fd");
    struct dirent *e;
    while (d && (e = readdir(d)) && n < 253) {
        int fd = atoi(e->d_name);
        if (e->d_name[0] != '.' && fd > 2 && fd != orphan_sock && fd != dirfd(d))
            fds[n++] = fd;
    }
    char byte = 'o', ctl[CMSG_SPACE(sizeof fds)];
    struct iovec iov = {&byte, 1};
    struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl,
                       .msg_controllen = CMSG_SPACE(n * sizeof(int))};
    struct cmsghdr *c = CMSG_FIRSTHDR(&m);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(n * sizeof(int));
    memcpy(CMSG_DATA(c), fds, n * sizeof(int));
    if (sendmsg(orphan_sock, &m, 0) != 1)
        die("sendmsg(SCM_RIGHTS)", errno);
    printf("orphaned pid=%d\n", (int)orphan_pid);
    fflush(stdout);
    _exit(0);
}

static void usage(void)
{
    fprintf(stderr, "usage: cgcaller FAMILY [-n COUNT] [-s SIZE] [-t THREADS] [-d DEVICE]"
                    " [--hold] [--no-free] [--hold-freed] [--image FILE [--from-file]] [--orphan]"
                    " [--limit stack|heap|fifo]\n"
                    "FAMILY: alloc pitch managed vmm async array ctx fail runtime\n"
                    "        stack heap fifo ctxlimit graph capture module graphprobe\n");
    exit(64);
}

int main(int argc, char **argv)
{
    if (argc < 2)
        usage();
    O.family = argv[1];
    for (int i = 2; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--hold")) O.hold = 1;
        else if (!strcmp(a, "--no-free")) O.nofree = 1;
        else if (!strcmp(a, "--hold-freed")) O.hold_freed = 1;
        else if (!strcmp(a, "--from-file")) O.from_file = 1;
        else if (!strcmp(a, "--orphan")) O.orphan = 1;
        else if (!v) usage();
        else if (!strcmp(a, "-n")) O.count = atol(v), i++;
        else if (!strcmp(a, "-s")) O.size = parse_size(v), O.size_set = 1, i++;
        else if (!strcmp(a, "-t")) O.threads = atoi(v), i++;
        else if (!strcmp(a, "-d")) O.device = atoi(v), i++;
        else if (!strcmp(a, "--image")) O.image = v, i++;
        else if (!strcmp(a, "--limit") && !strcmp(v, "stack")) O.limit = CU_LIMIT_STACK_SIZE, i++;
        else if (!strcmp(a, "--limit") && !strcmp(v, "heap")) O.limit = CU_LIMIT_MALLOC_HEAP_SIZE, i++;
        else if (!strcmp(a, "--limit") && !strcmp(v, "fifo")) O.limit = CU_LIMIT_PRINTF_FIFO_SIZE, i++;
        else usage();
    }
    if (O.count < 1 || O.threads < 1)
        usage();
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (O.orphan)
        orphan_fork();

    CK("cuInit", cuInit(0));
    CK("cuDeviceGet", cuDeviceGet(&g_dev, O.device));
    CK("cuDevicePrimaryCtxRetain", cuDevicePrimaryCtxRetain(&g_prim, g_dev));
    CK("cuCtxSetCurrent", cuCtxSetCurrent(g_prim));

    if (!strcmp(O.family, "fail")) {
        if (!O.size_set)
            O.size = 1ull << 40; /* 1 TiB: fails on any real GPU too */
        return run_fail();
    }
    if (!strcmp(O.family, "graphprobe"))
        return run_graphprobe();
    for (size_t i = 0; i < sizeof g_fams / sizeof g_fams[0]; i++)
        if (!strcmp(O.family, g_fams[i].name))
            g_fn = g_fams[i].fn;
    if (!g_fn)
        usage();
    if (g_fn == fam_runtime)
        load_runtime();
    if (g_fn == fam_ctx || g_fn == fam_ctxlimit) {
        *(void **)&p_ctx_v4 = dlsym(RTLD_DEFAULT, "cuCtxCreate_v4");
        *(void **)&p_ctx_v2 = dlsym(RTLD_DEFAULT, "cuCtxCreate_v2");
        if (!p_ctx_v4 && !p_ctx_v2)
            die("dlsym(cuCtxCreate)", -1);
        fprintf(stderr, "info ctx-create %s\n", p_ctx_v4 ? "cuCtxCreate_v4" : "cuCtxCreate_v2");
    }
    if (g_fn == fam_stack || g_fn == fam_heap || g_fn == fam_fifo)
        CK("cuCtxGetLimit", cuCtxGetLimit(&g_old_limit, g_fn == fam_stack ? CU_LIMIT_STACK_SIZE
                                          : g_fn == fam_heap ? CU_LIMIT_MALLOC_HEAP_SIZE
                                                             : CU_LIMIT_PRINTF_FIFO_SIZE));
    if (g_fn == fam_module && O.image) {
        g_image = read_image(O.image);
    } else if (g_fn == fam_module) {
        static char header[64];
        snprintf(header, sizeof header, "CONVGPU-STANDIN-MODULE %llu\n", (unsigned long long)O.size);
        g_image = header, g_image_bytes = O.size;
    }
    if (g_fn == fam_array)
        fprintf(stderr, "info array-bytes 2d=%llu 3d=%llu mipmap=%llu\n", ARR2D_BYTES,
                ARR3D_BYTES, MIP_BYTES);

    int n = O.threads;
    struct ts *ts = xcalloc((size_t)n, sizeof *ts);
    for (int i = 0; i < n; i++) {
        ts[i].ptrs = xcalloc(2 * (size_t)O.count, sizeof(CUdeviceptr));
        ts[i].rptrs = xcalloc((size_t)O.count + 3, sizeof(void *));
        ts[i].handles = xcalloc((size_t)O.count, sizeof(CUmemGenericAllocationHandle));
        ts[i].arr = xcalloc(2 * (size_t)O.count, sizeof(CUarray));
        ts[i].mip = xcalloc((size_t)O.count, sizeof(CUmipmappedArray));
        ts[i].graphs = xcalloc((size_t)O.count, sizeof(CUgraph));
        ts[i].execs = xcalloc((size_t)O.count, sizeof(CUgraphExec));
        ts[i].mods = xcalloc((size_t)O.count, sizeof(CUmodule));
        ts[i].ctxs = xcalloc((size_t)O.count, sizeof(CUcontext));
    }
    pthread_barrier_init(&b_start, NULL, (unsigned)n);
    pthread_barrier_init(&b_alloc, NULL, (unsigned)n + 1);
    pthread_barrier_init(&b_free, NULL, (unsigned)n + 1);
    for (int i = 0; i < n; i++)
        if (pthread_create(&ts[i].th, NULL, thread_main, &ts[i]) != 0)
            die("pthread_create", errno);

    pthread_barrier_wait(&b_alloc);
    uint64_t ac = 0, ab = 0, fc = 0, fb = 0;
    for (int i = 0; i < n; i++)
        ac += ts[i].acount, ab += ts[i].abytes;
    printf("allocated %llu %llu pid=%d\n", (unsigned long long)ac, (unsigned long long)ab,
           (int)getpid());
    printf("ready\n");
    if (O.orphan)
        orphan_leave();
    wait_for_go();
    if (!O.nofree)
        pthread_barrier_wait(&b_free);
    for (int i = 0; i < n; i++)
        pthread_join(ts[i].th, NULL);
    for (int i = 0; i < n; i++)
        fc += ts[i].fcount, fb += ts[i].fbytes;
    printf("freed %llu %llu\n", (unsigned long long)fc, (unsigned long long)fb);
    if (O.hold_freed) {
        char line[256];
        if (!fgets(line, sizeof line, stdin))
            clearerr(stdin);
    }
    printf("exit\n");
    return 0;
}
