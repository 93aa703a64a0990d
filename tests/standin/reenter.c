/*
 * reenter.c - one thread calls cuMemAlloc_v2 again, with the same arguments, from a signal
 * handler while its first call is still inside the driver (CONVGPU_STANDIN_ALLOC_MS keeps the
 * stand-in's body waiting before it allocates). The same call at the same site, nested: not a
 * forwarding library, so the first call's reservation must stay counted (bpf/admit.bpf.c
 * call_enter), or its allocation, which nothing settles at its return, goes uncounted.
 *
 * usage: reenter SIZE_BYTES DELAY_MS   (the signal comes DELAY_MS into the first call)
 * stdout: "allocated 2 BYTES pid=PID", "ready", then waits for a stdin line; exits 0.
 * An unexpected CUresult: "error API CODE" on stderr, exit status 2.
 */
#define _GNU_SOURCE
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

static void again(int sig)
{
    (void)sig;
    g_inner = cuMemAlloc_v2(&g_ptr, g_size);
}

int main(int argc, char **argv)
{
    if (argc != 3)
        return fprintf(stderr, "usage: reenter SIZE_BYTES DELAY_MS\n"), 2;
    g_size = strtoull(argv[1], NULL, 0);
    long delay_ms = strtol(argv[2], NULL, 0);
    CUdevice dev;
    CUcontext ctx;
    if (cuInit(0) || cuDeviceGet(&dev, 0) || cuDevicePrimaryCtxRetain(&ctx, dev) || cuCtxSetCurrent(ctx))
        return fprintf(stderr, "error setup\n"), 2;
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = again;
    sigaction(SIGALRM, &sa, NULL);
    struct itimerval it = {.it_value = {.tv_sec = delay_ms / 1000, .tv_usec = (delay_ms % 1000) * 1000}};
    setitimer(ITIMER_REAL, &it, NULL);
    CUresult outer = cuMemAlloc_v2(&g_ptr, g_size);
    if (outer || g_inner)
        return fprintf(stderr, "error cuMemAlloc_v2 %d %d\n", outer, g_inner), 2;
    printf("allocated 2 %zu pid=%d\nready\n", 2 * g_size, getpid());
    fflush(stdout);
    char line[16];
    if (!fgets(line, sizeof line, stdin)) { /* EOF: exit all the same */ }
    return 0;
}
