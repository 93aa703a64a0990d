// alloc_bench SIZE ITERS: time ITERS x cuMemAlloc_v2, then ITERS x cuMemFree_v2, of SIZE bytes through
// whatever libcuda.so.1 the loader finds (LD_LIBRARY_PATH picks stand-in or driver).
// Prints "alloc_ns <median> free_ns <median> p99_alloc_ns <p99> p99_free_ns <p99>".
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include "../tests/standin/cuda_min.h"

// The driver's exported names (cuda.h maps cuMemAlloc to cuMemAlloc_v2 the same way).
CUresult cuInit(unsigned flags);
CUresult cuDeviceGet(CUdevice *dev, int ordinal);
CUresult cuDevicePrimaryCtxRetain(CUcontext *ctx, CUdevice dev);
CUresult cuCtxSetCurrent(CUcontext ctx);
CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t size);
CUresult cuMemFree_v2(CUdeviceptr p);

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

int main(int argc, char **argv)
{
    if (argc < 3) {
        fprintf(stderr, "usage: alloc_bench SIZE ITERS\n");
        return 2;
    }
    size_t size = strtoull(argv[1], 0, 0);
    int iters = atoi(argv[2]);
    CUdevice dev;
    CUcontext ctx;
    if (cuInit(0) || cuDeviceGet(&dev, 0) || cuDevicePrimaryCtxRetain(&ctx, dev) || cuCtxSetCurrent(ctx)) {
        fprintf(stderr, "CUDA set-up failed\n");
        return 2;
    }
    // All allocations first, then all frees, each call timed alone: the pattern of a caching
    // allocator growing and shrinking (alternating alloc/free pairs hit the driver's page
    // mapping every time and bury the probe cost in ~40 us of noise).
    long long *ta = malloc(sizeof(long long) * iters), *tf = malloc(sizeof(long long) * iters);
    CUdeviceptr *ps = malloc(sizeof(CUdeviceptr) * iters);
    for (int i = 0; i < iters; i++) {
        long long t0 = now_ns();
        if (cuMemAlloc_v2(&ps[i], size))
            return 3;
        ta[i] = now_ns() - t0;
    }
    for (int i = 0; i < iters; i++) {
        long long t0 = now_ns();
        cuMemFree_v2(ps[i]);
        tf[i] = now_ns() - t0;
    }
    qsort(ta, iters, sizeof(long long), cmp);
    qsort(tf, iters, sizeof(long long), cmp);
    printf("alloc_ns %lld free_ns %lld p99_alloc_ns %lld p99_free_ns %lld\n", ta[iters / 2], tf[iters / 2],
           ta[iters * 99 / 100], tf[iters * 99 / 100]);
    return 0;
}
