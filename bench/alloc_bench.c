// alloc_bench: time CUDA memory calls one by one, through whatever libcuda.so.1 the loader finds
// (LD_LIBRARY_PATH picks the stand-in or the driver) and a libcudart found at run time.
//
//   alloc_bench --list              one line per API: "api NAME KIND ok" or "api NAME KIND
//                                   unavailable WHY" (KIND: alloc, or call for an info API),
//                                   then "runtime PATH" for the libcudart opened
//   alloc_bench ITERS API:SIZE...   per cell: ITERS allocations of SIZE bytes, each timed, and
//                                   the matching frees; an info API (SIZE ignored): ITERS calls
//
// Per cell it prints "cell API SIZE bytes B n N alloc_ns MED alloc_p99_ns P99 free_ns MED
// free_p99_ns P99" (info APIs: "call_ns" / "call_p99_ns" instead), or "unavailable API WHY";
// B is what one call asks the driver for (cuMemCreate rounds up to the granularity). Each line
// ends with "ref_ns R": the median time of a fixed piece of CPU work, timed just before and just
// after the cell. On the GPU machines the host runs a vCPU at one speed or 1.3-1.85x slower for
// seconds at a time (docs/BENCHMARKS.md, "The GPU machines' CPU regimes"), and the modes' cells
// run seconds apart: R lets the report put every cell at bare's speed (bench/latency_report.py).
//
// Before the first cell it waits until no thread of it is traced (TracerPid 0): under `convgpu
// enforce` a new CUDA process is held at its first context until placed, and the enforcer's
// ptrace holder keeps it seized for LINGER (0.5 s) after (enforcer/failsafe/threadhold.py). That
// is a cost of each placement, not of each call; a cell timed inside it measured the holder's
// polling beside the calls. It prints "untraced_ms MS" (or "still_traced_ms MS") to stderr;
// $CONVGPU_BENCH_UNTRACED_MS bounds the wait (default 5000; 0: no wait, the old behaviour).
//
// The runtime is dlopen'ed, never linked, so that its absence is reported, not faked:
// $CONVGPU_CUDART (a path; then only that one), else libcudart.so.13, .12, .11.0, libcudart.so.
// It is opened RTLD_GLOBAL and its functions are looked up in the global scope, so a preloaded
// shim's cudaMalloc is the one called, as in a program linked with -lcudart.
#define _GNU_SOURCE
#include <dirent.h>
#include <dlfcn.h>
#include <link.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "../tests/standin/cuda_min.h"

// Allocations of a cell are held at once in batches of at most this much (then freed), so the
// pattern is a caching allocator growing and shrinking (alternating alloc/free pairs hit the
// driver's page mapping every time and bury the probe cost in ~40 us of noise), without
// holding ITERS x 256 MiB.
#define HOLD_BYTES (8ull << 30)
#define ROW 4096   // pitched and 3D allocations are rows of 4 KiB (narrower sizes: one row)

struct slot {
    CUdeviceptr p;
    CUmemGenericAllocationHandle h;
};
typedef int (*op_fn)(struct slot *s, size_t bytes);

static struct {
    PFN_cudaMalloc Malloc;
    PFN_cudaMallocManaged MallocManaged;
    PFN_cudaMallocPitch MallocPitch;
    PFN_cudaMalloc3D Malloc3D;
    PFN_cudaFree Free;
    PFN_cudaMemGetInfo MemGetInfo;
} R;
static const char *rt_missing;   // why the runtime APIs are unavailable (NULL: they are not)
static void *rt_handle;

static size_t rows(size_t n) { return n > ROW ? n / ROW : 1; }
static size_t width(size_t n) { return n > ROW ? ROW : n; }

// ---- driver ----
static int a_mem(struct slot *s, size_t n) { return cuMemAlloc_v2(&s->p, n); }
static int a_managed(struct slot *s, size_t n) { return cuMemAllocManaged(&s->p, n, CU_MEM_ATTACH_GLOBAL); }
static int a_pitch(struct slot *s, size_t n)
{
    size_t pitch;
    return cuMemAllocPitch_v2(&s->p, &pitch, width(n), rows(n), 4);
}
static int f_mem(struct slot *s, size_t n) { (void)n; return cuMemFree_v2(s->p); }

// What PyTorch's expandable segments do per granule, made usable: address range, physical
// memory, mapping, access; and undone in the order the driver requires.
static const CUmemAllocationProp vmm_prop = {.type = CU_MEM_ALLOCATION_TYPE_PINNED,
                                             .location = {CU_MEM_LOCATION_TYPE_DEVICE, 0}};
static int a_vmm(struct slot *s, size_t n)
{
    const CUmemAccessDesc rw = {{CU_MEM_LOCATION_TYPE_DEVICE, 0}, CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
    return cuMemAddressReserve(&s->p, n, 0, 0, 0) || cuMemCreate(&s->h, n, &vmm_prop, 0) ||
           cuMemMap(s->p, n, 0, s->h, 0) || cuMemSetAccess(s->p, n, &rw, 1);
}
static int f_vmm(struct slot *s, size_t n)
{
    return cuMemUnmap(s->p, n) || cuMemRelease(s->h) || cuMemAddressFree(s->p, n);
}
static int i_info(struct slot *s, size_t n)
{
    (void)s, (void)n;
    size_t free_b, total;
    return cuMemGetInfo_v2(&free_b, &total);
}

// ---- runtime ----
static int a_rmalloc(struct slot *s, size_t n) { return R.Malloc((void **)&s->p, n); }
static int a_rmanaged(struct slot *s, size_t n) { return R.MallocManaged((void **)&s->p, n, cudaMemAttachGlobal); }
static int a_rpitch(struct slot *s, size_t n)
{
    size_t pitch;
    return R.MallocPitch((void **)&s->p, &pitch, width(n), rows(n));
}
static int a_r3d(struct slot *s, size_t n)
{
    struct cudaPitchedPtr pp;
    int rc = R.Malloc3D(&pp, (struct cudaExtent){width(n), 1, rows(n)});
    s->p = (CUdeviceptr)(uintptr_t)pp.ptr;
    return rc;
}
static int f_rfree(struct slot *s, size_t n) { (void)n; return R.Free((void *)(uintptr_t)s->p); }
static int i_rinfo(struct slot *s, size_t n)
{
    (void)s, (void)n;
    size_t free_b, total;
    return R.MemGetInfo(&free_b, &total);
}

static const struct api {
    const char *name;
    int runtime;
    op_fn alloc, free;   // free NULL: an info call, timed alone
} apis[] = {
    {"cuMemAlloc_v2", 0, a_mem, f_mem},
    {"cuMemAllocManaged", 0, a_managed, f_mem},
    {"cuMemAllocPitch_v2", 0, a_pitch, f_mem},
    {"cuMemCreate+Map", 0, a_vmm, f_vmm},
    {"cuMemGetInfo_v2", 0, i_info, NULL},
    {"cudaMalloc", 1, a_rmalloc, f_rfree},
    {"cudaMallocManaged", 1, a_rmanaged, f_rfree},
    {"cudaMallocPitch", 1, a_rpitch, f_rfree},
    {"cudaMalloc3D", 1, a_r3d, f_rfree},
    {"cudaMemGetInfo", 1, i_rinfo, NULL},
};
#define NAPIS (sizeof(apis) / sizeof(apis[0]))

static void load_runtime(void)
{
    static char why[512];
    const char *env = getenv("CONVGPU_CUDART");
    const char *names[] = {"libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0", "libcudart.so"};
    void *h = NULL;
    if (env && *env)
        h = dlopen(env, RTLD_NOW | RTLD_GLOBAL);
    for (size_t i = 0; !h && !(env && *env) && i < sizeof(names) / sizeof(names[0]); i++)
        h = dlopen(names[i], RTLD_NOW | RTLD_GLOBAL);
    rt_handle = h;
    if (!h) {
        snprintf(why, sizeof(why), "no-libcudart:%s", env && *env ? env : "libcudart.so.13/.12/.11.0/.so");
        rt_missing = why;
        return;
    }
#define SYM(field, name)                                                   \
    if (!(*(void **)&R.field = dlsym(RTLD_DEFAULT, name))) {               \
        snprintf(why, sizeof(why), "no-symbol:%s", name);                  \
        rt_missing = why;                                                  \
        return;                                                            \
    }
    SYM(Malloc, "cudaMalloc");
    SYM(MallocManaged, "cudaMallocManaged");
    SYM(MallocPitch, "cudaMallocPitch");
    SYM(Malloc3D, "cudaMalloc3D");
    SYM(Free, "cudaFree");
    SYM(MemGetInfo, "cudaMemGetInfo");
#undef SYM
    if (R.Free(NULL)) {   // cudaFree(0): the runtime's own initialisation, kept out of the timings
        snprintf(why, sizeof(why), "init-failed");
        rt_missing = why;
    }
}

static long long now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static int cmp(const void *a, const void *b)
{
    long long x = *(const long long *)a, y = *(const long long *)b;
    return (x > y) - (x < y);
}

// Sorts t in place; median and p99 as index n/2 and n*99/100 (with n < 100, p99 is the maximum).
static void stats(long long *t, int n, long long *med, long long *p99)
{
    qsort(t, n, sizeof(long long), cmp);
    *med = t[n / 2];
    *p99 = t[(long long)n * 99 / 100];
}

static long long ref_once(void)
{
    volatile unsigned long long x = 88172645463325252ull;   // volatile: the work is done, not folded
    long long t0 = now_ns();
    for (int i = 0; i < 20000; i++) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
    }
    return now_ns() - t0;
}

static long long ref_ns(void)
{
    long long r[9], med, p99;
    for (int i = 0; i < 9; i++)
        r[i] = ref_once();
    stats(r, 9, &med, &p99);
    return med;
}

static size_t vmm_bytes(size_t n)
{
    size_t g = 0;
    if (cuMemGetAllocationGranularity(&g, &vmm_prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM) || !g)
        return 0;
    return (n + g - 1) / g * g;
}

// One cell: returns 0, or prints why it could not be measured and returns 3.
static int run_cell(const struct api *a, size_t size, int iters, long long *ta, long long *tf, struct slot *sl)
{
    size_t bytes = a->alloc == a_vmm ? vmm_bytes(size) : size;
    long long m1, p1, m2, p2, ref;
    if (a->runtime && rt_missing) {
        printf("unavailable %s %s\n", a->name, rt_missing);
        return 0;
    }
    ref = ref_ns();
    if (!a->free) {
        if (a->alloc(sl, 0))   // one untimed call first: lazy set-up of the path is not the cost
            goto failed;
        for (int i = 0; i < iters; i++) {
            long long t0 = now_ns();
            if (a->alloc(sl, 0))
                goto failed;
            ta[i] = now_ns() - t0;
        }
        stats(ta, iters, &m1, &p1);
        printf("cell %s 0 bytes 0 n %d call_ns %lld call_p99_ns %lld ref_ns %lld\n", a->name, iters, m1, p1,
               (ref + ref_ns()) / 2);
        return 0;
    }
    if (!bytes || a->alloc(sl, bytes) || a->free(sl, bytes))   // untimed warm-up pair
        goto failed;
    size_t fit = HOLD_BYTES / bytes;
    int batch = fit < 1 ? 1 : fit < (size_t)iters ? (int)fit : iters;
    for (int done = 0; done < iters; done += batch) {
        int k = iters - done < batch ? iters - done : batch;
        for (int i = 0; i < k; i++) {
            long long t0 = now_ns();
            if (a->alloc(&sl[i], bytes))
                goto failed;
            ta[done + i] = now_ns() - t0;
        }
        for (int i = 0; i < k; i++) {
            long long t0 = now_ns();
            if (a->free(&sl[i], bytes))
                goto failed;
            tf[done + i] = now_ns() - t0;
        }
    }
    stats(ta, iters, &m1, &p1);
    stats(tf, iters, &m2, &p2);
    printf("cell %s %zu bytes %zu n %d alloc_ns %lld alloc_p99_ns %lld free_ns %lld free_p99_ns %lld ref_ns %lld\n",
           a->name, size, bytes, iters, m1, p1, m2, p2, (ref + ref_ns()) / 2);
    return 0;
failed:   // a benchmark that cannot allocate says so and stops: its numbers would be wrong
    fprintf(stderr, "alloc_bench: %s of %zu bytes failed\n", a->name, bytes);
    return 3;
}

static int traced_threads(void)
{
    DIR *d = opendir("/proc/self/task");
    struct dirent *e;
    int n = 0;
    char path[64], line[128];
    while (d && (e = readdir(d))) {
        if (e->d_name[0] == '.')
            continue;
        snprintf(path, sizeof path, "/proc/self/task/%.20s/status", e->d_name);
        FILE *f = fopen(path, "r");
        while (f && fgets(line, sizeof line, f))
            if (!strncmp(line, "TracerPid:", 10)) {
                n += atoi(line + 10) != 0;
                break;
            }
        if (f)
            fclose(f);
    }
    if (d)
        closedir(d);
    return n;
}

static void wait_untraced(void)
{
    const char *env = getenv("CONVGPU_BENCH_UNTRACED_MS");
    long long limit = env ? atoll(env) : 5000, t0 = now_ns();
    if (limit <= 0)
        return;
    while (traced_threads() && now_ns() - t0 < limit * 1000000)
        nanosleep(&(struct timespec){0, 5000000}, NULL);
    fprintf(stderr, "%s %lld\n", traced_threads() ? "still_traced_ms" : "untraced_ms", (now_ns() - t0) / 1000000);
}

static const struct api *find_api(const char *name, size_t len)
{
    for (size_t i = 0; i < NAPIS; i++)
        if (strlen(apis[i].name) == len && !strncmp(apis[i].name, name, len))
            return &apis[i];
    return NULL;
}

int main(int argc, char **argv)
{
    int list = argc == 2 && !strcmp(argv[1], "--list");
    if (argc < 3 && !list) {
        fprintf(stderr, "usage: alloc_bench --list | alloc_bench ITERS API:SIZE...\n");
        return 2;
    }
    CUdevice dev;
    CUcontext ctx;
    if (cuInit(0) || cuDeviceGet(&dev, 0) || cuDevicePrimaryCtxRetain(&ctx, dev) || cuCtxSetCurrent(ctx)) {
        fprintf(stderr, "CUDA set-up failed\n");
        return 2;
    }
    load_runtime();
    if (list) {
        for (size_t i = 0; i < NAPIS; i++) {
            const char *kind = apis[i].free ? "alloc" : "call";
            if (apis[i].runtime && rt_missing)
                printf("api %s %s unavailable %s\n", apis[i].name, kind, rt_missing);
            else
                printf("api %s %s ok\n", apis[i].name, kind);
        }
        struct link_map *lm;
        if (rt_handle && !dlinfo(rt_handle, RTLD_DI_LINKMAP, &lm))
            printf("runtime %s\n", lm->l_name);
        return 0;
    }
    int iters = atoi(argv[1]);
    if (iters < 1) {
        fprintf(stderr, "alloc_bench: ITERS must be at least 1\n");
        return 2;
    }
    wait_untraced();
    long long *ta = malloc(sizeof(long long) * iters), *tf = malloc(sizeof(long long) * iters);
    struct slot *sl = calloc(iters, sizeof(struct slot));
    for (int c = 2; c < argc; c++) {
        const char *colon = strchr(argv[c], ':');
        const struct api *a = colon ? find_api(argv[c], colon - argv[c]) : NULL;
        if (!a) {
            fprintf(stderr, "alloc_bench: unknown cell %s (API:SIZE; --list names the APIs)\n", argv[c]);
            return 2;
        }
        if (run_cell(a, strtoull(colon + 1, 0, 0), iters, ta, tf, sl))
            return 3;
        fflush(stdout);
    }
    return 0;
}
