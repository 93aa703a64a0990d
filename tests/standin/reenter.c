/*
 * reenter.c - one thread calls cuMemAlloc_v2 again, with the same arguments, from a signal
 * handler while its first call is still inside the driver (CONVGPU_STANDIN_ALLOC_MS keeps the
 * stand-in's body waiting before it allocates).
 *
 * Without COPY: the same call at the same site, nested: not a forwarding library, so the first
 * call's reservation must stay counted (bpf/admit.bpf.c call_enter), or its allocation, which
 * nothing settles at its return, goes uncounted.
 * With COPY (another file of the driver, dlopen'ed on its own: a second driver in the process,
 * with its own context and its own slot in the stand-in's segment): the handler calls COPY's
 * cuMemAlloc_v2, another site with the same arguments, which looks like a forward; the first
 * call still allocates a block of its own after it, and its return must be charged for it
 * (issue 47: 400 MiB held, 200 charged).
 *
 * With "free" after COPY, the handler frees its block (COPY's cuMemFree_v2) before it returns: the
 * first call's block may then get the same address, which must not pass for the handler's.
 *
 * usage: reenter SIZE_BYTES DELAY_MS [COPY [free]]   (the signal comes DELAY_MS into the first call)
 * stdout: "allocated 2 BYTES pid=PID", with free "reused 0|1" (the first block at the freed
 * one's address), "ready", then waits for a stdin line; exits 0.
 * An unexpected CUresult: "error API CODE" on stderr, exit status 2.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>
#include <unistd.h>

#include "cuda_min.h"

static CUdeviceptr g_ptr;           /* both calls write here: the same first argument */
static size_t g_size;
static volatile CUresult g_inner = 999;
static CUresult (*g_alloc)(CUdeviceptr *, size_t) = cuMemAlloc_v2;   /* the handler's */
static CUresult (*g_free)(CUdeviceptr);                               /* free: COPY's */
static int g_free_asked;
static CUdeviceptr g_freed;

static void again(int sig)
{
    (void)sig;
    g_inner = g_alloc(&g_ptr, g_size);
    if (!g_inner && g_free) {
        g_freed = g_ptr;
        g_inner = g_free(g_ptr);
    }
}

/* COPY's own cuInit and primary context, current on this thread (its own stack of contexts) */
static int open_copy(const char *path)
{
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!h)
        return fprintf(stderr, "error dlopen %s\n", dlerror()), -1;
    CUresult (*init)(unsigned) = (CUresult (*)(unsigned))dlsym(h, "cuInit");
    CUresult (*get)(CUdevice *, int) = (CUresult (*)(CUdevice *, int))dlsym(h, "cuDeviceGet");
    CUresult (*retain)(CUcontext *, CUdevice) = (CUresult (*)(CUcontext *, CUdevice))dlsym(h, "cuDevicePrimaryCtxRetain");
    CUresult (*set)(CUcontext) = (CUresult (*)(CUcontext))dlsym(h, "cuCtxSetCurrent");
    *(void **)&g_alloc = dlsym(h, "cuMemAlloc_v2");
    if (g_free_asked && !(*(void **)&g_free = dlsym(h, "cuMemFree_v2")))
        return fprintf(stderr, "error dlsym cuMemFree_v2\n"), -1;
    CUdevice dev;
    CUcontext ctx;
    if (!init || !get || !retain || !set || !g_alloc || init(0) || get(&dev, 0) || retain(&ctx, dev) || set(ctx))
        return fprintf(stderr, "error setup %s\n", path), -1;
    return 0;
}

int main(int argc, char **argv)
{
    if (argc < 3 || argc > 5 || (argc == 5 && strcmp(argv[4], "free")))
        return fprintf(stderr, "usage: reenter SIZE_BYTES DELAY_MS [COPY [free]]\n"), 2;
    g_free_asked = argc == 5;
    g_size = strtoull(argv[1], NULL, 0);
    long delay_ms = strtol(argv[2], NULL, 0);
    CUdevice dev;
    CUcontext ctx;
    if (cuInit(0) || cuDeviceGet(&dev, 0) || cuDevicePrimaryCtxRetain(&ctx, dev) || cuCtxSetCurrent(ctx))
        return fprintf(stderr, "error setup\n"), 2;
    if (argc >= 4 && open_copy(argv[3]))
        return 2;
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = again;
    sigaction(SIGALRM, &sa, NULL);
    struct itimerval it = {.it_value = {.tv_sec = delay_ms / 1000, .tv_usec = (delay_ms % 1000) * 1000}};
    setitimer(ITIMER_REAL, &it, NULL);
    CUresult outer = cuMemAlloc_v2(&g_ptr, g_size);
    if (outer || g_inner)
        return fprintf(stderr, "error cuMemAlloc_v2 %d %d\n", outer, g_inner), 2;
    printf("allocated 2 %zu pid=%d\n", 2 * g_size, getpid());
    if (g_free)
        printf("reused %d\n", g_ptr == g_freed);
    printf("ready\n");
    fflush(stdout);
    char line[16];
    if (!fgets(line, sizeof line, stdin)) { /* EOF: exit all the same */ }
    return 0;
}
