/*
 * cgcaller.c - drives one family of CUDA memory APIs so tests can check what
 * convgpu's probes saw.  Linked against "libcuda.so.1" by name with no
 * rpath: LD_LIBRARY_PATH picks the stand-in (build/standin) or, on a GPU
 * machine, the real driver, so only real-driver semantics are used here.
 *
 * usage: cgcaller FAMILY [-n COUNT] [-s SIZE] [-t THREADS] [-d DEVICE]
 *                 [--hold] [--no-free] [--hold-freed]
 * FAMILY: alloc pitch managed vmm async array ctx fail runtime
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
#include <string.h>
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
} O = {NULL, 1, 1 << 20, 0, 1, 0, 0, 0};

static CUdevice g_dev;
static CUcontext g_prim;
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

static const struct {
    const char *name;
    void (*fn)(struct ts *, int);
} g_fams[] = {
    {"alloc", fam_alloc}, {"pitch", fam_pitch}, {"managed", fam_managed},
    {"vmm", fam_vmm},     {"async", fam_async}, {"array", fam_array},
    {"ctx", fam_ctx},     {"runtime", fam_runtime},
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

static void usage(void)
{
    fprintf(stderr, "usage: cgcaller FAMILY [-n COUNT] [-s SIZE] [-t THREADS] [-d DEVICE]"
                    " [--hold] [--no-free] [--hold-freed]\n"
                    "FAMILY: alloc pitch managed vmm async array ctx fail runtime\n");
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
        else if (!v) usage();
        else if (!strcmp(a, "-n")) O.count = atol(v), i++;
        else if (!strcmp(a, "-s")) O.size = parse_size(v), O.size_set = 1, i++;
        else if (!strcmp(a, "-t")) O.threads = atoi(v), i++;
        else if (!strcmp(a, "-d")) O.device = atoi(v), i++;
        else usage();
    }
    if (O.count < 1 || O.threads < 1)
        usage();
    setvbuf(stdout, NULL, _IOLBF, 0);

    CK("cuInit", cuInit(0));
    CK("cuDeviceGet", cuDeviceGet(&g_dev, O.device));
    CK("cuDevicePrimaryCtxRetain", cuDevicePrimaryCtxRetain(&g_prim, g_dev));
    CK("cuCtxSetCurrent", cuCtxSetCurrent(g_prim));

    if (!strcmp(O.family, "fail")) {
        if (!O.size_set)
            O.size = 1ull << 40; /* 1 TiB: fails on any real GPU too */
        return run_fail();
    }
    for (size_t i = 0; i < sizeof g_fams / sizeof g_fams[0]; i++)
        if (!strcmp(O.family, g_fams[i].name))
            g_fn = g_fams[i].fn;
    if (!g_fn)
        usage();
    if (g_fn == fam_runtime)
        load_runtime();
    if (g_fn == fam_ctx) {
        *(void **)&p_ctx_v4 = dlsym(RTLD_DEFAULT, "cuCtxCreate_v4");
        *(void **)&p_ctx_v2 = dlsym(RTLD_DEFAULT, "cuCtxCreate_v2");
        if (!p_ctx_v4 && !p_ctx_v2)
            die("dlsym(cuCtxCreate)", -1);
        fprintf(stderr, "info ctx-create %s\n", p_ctx_v4 ? "cuCtxCreate_v4" : "cuCtxCreate_v2");
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
