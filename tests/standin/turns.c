/*
 * turns.c - threads that take turns with device memory (issue 23): each of THREADS threads,
 * ROUNDS times, allocates SIZE with cuMemAlloc_v2, holds it HOLD_MS, and frees it. Under a
 * limit that fits only some of the allocations at once, it finishes only if a thread stopped
 * at its allocation does not stop the threads whose frees would make room.
 *
 * -n N: N allocations per round (freed together); -b: the threads wait for each other after
 * each allocation (each holds its i-th before any asks for its (i+1)-th: a circular wait
 * where the limit fits fewer).
 * -w MS: wait that long after the context, before the threads start (a framework's start-up:
 * CuPy's on the H100 takes long enough that four processes started together all make their
 * contexts before any allocates).
 * -v: VMM physical memory instead, cuMemCreate and cuMemRelease (expandable segments, NCCL):
 * a handle's value may be given out again while another thread's release still returns.
 * usage: turns [-t THREADS] [-r ROUNDS] [-n N] [-s SIZE] [-h HOLD_MS] [-b] [-w MS] [-v]
 * stdout: "done ALLOCS BYTES pid=PID" once every thread finished; exit 0.
 * Unexpected CUresult: "error API CODE" on stderr, exit status 2.
 * Linked against "libcuda.so.1" by name: the stand-in here, the real driver on a GPU host.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "cuda_min.h"

static int threads = 8, rounds = 3, per = 1, lockstep, vmm;
static pthread_barrier_t step;
static uint64_t size = 256ull << 20;
static long hold_ms = 500, wait_ms;
static CUcontext ctx;
static uint64_t allocs, bytes;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;

static void check(const char *api, CUresult r)
{
    if (r != CUDA_SUCCESS) {
        fprintf(stderr, "error %s %d\n", api, (int)r);
        _exit(2);
    }
}

static uint64_t parse_size(const char *s)
{
    char *end;
    uint64_t v = strtoull(s, &end, 10);
    switch (*end) {
    case 'K': case 'k': return v << 10;
    case 'M': case 'm': return v << 20;
    case 'G': case 'g': return v << 30;
    default: return v;
    }
}

/* size bytes: a pointer (cuMemAlloc_v2), or with -v a VMM handle (cuMemCreate, on device 0) */
static void get(CUdeviceptr *p)
{
    if (!vmm) {
        check("cuMemAlloc_v2", cuMemAlloc_v2(p, size));
        return;
    }
    CUmemAllocationProp prop = {0};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = 0;
    CUmemGenericAllocationHandle h;
    check("cuMemCreate", cuMemCreate(&h, size, &prop, 0));
    *p = (CUdeviceptr)h;
}

static void put(CUdeviceptr p)
{
    if (vmm)
        check("cuMemRelease", cuMemRelease((CUmemGenericAllocationHandle)p));
    else
        check("cuMemFree_v2", cuMemFree_v2(p));
}

static void *run(void *arg)
{
    (void)arg;
    check("cuCtxSetCurrent", cuCtxSetCurrent(ctx));
    for (int i = 0; i < rounds; i++) {
        CUdeviceptr p[64];
        for (int j = 0; j < per; j++) {
            get(&p[j]);
            if (lockstep)
                pthread_barrier_wait(&step);
        }
        usleep((useconds_t)hold_ms * 1000);
        for (int j = 0; j < per; j++)
            put(p[j]);
        pthread_mutex_lock(&mu);
        allocs += per, bytes += size * per;
        pthread_mutex_unlock(&mu);
    }
    return NULL;
}

int main(int argc, char **argv)
{
    int c;
    while ((c = getopt(argc, argv, "t:r:n:s:h:bw:v")) != -1) {
        switch (c) {
        case 't': threads = atoi(optarg); break;
        case 'r': rounds = atoi(optarg); break;
        case 's': size = parse_size(optarg); break;
        case 'h': hold_ms = atol(optarg); break;
        case 'n': per = atoi(optarg); break;
        case 'b': lockstep = 1; break;
        case 'w': wait_ms = atol(optarg); break;
        case 'v': vmm = 1; break;
        default:
            fprintf(stderr, "usage: turns [-t THREADS] [-r ROUNDS] [-n N] [-s SIZE] [-h HOLD_MS] [-b] [-w MS] [-v]\n");
            return 1;
        }
    }
    CUdevice dev;
    check("cuInit", cuInit(0));
    check("cuDeviceGet", cuDeviceGet(&dev, 0));
    check("cuDevicePrimaryCtxRetain", cuDevicePrimaryCtxRetain(&ctx, dev));
    usleep((useconds_t)wait_ms * 1000);
    pthread_t th[256];
    if (threads < 1 || threads > 256 || per < 1 || per > 64)
        return 1;
    pthread_barrier_init(&step, NULL, (unsigned)threads);
    for (int i = 0; i < threads; i++)
        if (pthread_create(&th[i], NULL, run, NULL) != 0)
            return 1;
    for (int i = 0; i < threads; i++)
        pthread_join(th[i], NULL);
    printf("done %llu %llu pid=%d\n", (unsigned long long)allocs, (unsigned long long)bytes, (int)getpid());
    return 0;
}
