/*
 * cpctl.c - a checkpointing process: the driver's cuCheckpointProcess* calls on another
 * process by pid (issue 46). Linked against "libcuda.so.1" by name like cgcaller, so it runs
 * on the stand-in (LD_LIBRARY_PATH=build/standin) or on the real driver of a GPU host.
 *
 * usage: cpctl OP PID [TIMEOUT_MS]     one call; exit 0 iff it returned CUDA_SUCCESS
 *        cpctl                         one "OP PID [TIMEOUT_MS]" a line on stdin
 * OP: lock (TIMEOUT_MS: CUcheckpointLockArgs.timeoutMs; none: NULL args), checkpoint,
 *     restore, unlock, state, tid
 * Each call answers one line (flushed):
 *   OP rc=CODE state=STATE ms=MILLISECONDS     (state: cuCheckpointProcessGetState after
 *                                               the call, -1 where it failed)
 *   tid rc=CODE tid=TID ms=MILLISECONDS
 * cuInit failing: "error cuInit CODE" on stderr, status 2; bad usage: status 64.
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cuda_min.h"

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

/* -1: not an op */
static int call(const char *op, int pid, const char *timeout)
{
    CUresult rc;
    int tid = 0;
    double t0 = now_ms();
    if (!strcmp(op, "lock")) {
        CUcheckpointLockArgs a;
        memset(&a, 0, sizeof a);
        a.timeoutMs = timeout ? (unsigned)strtoul(timeout, NULL, 10) : 0;
        rc = cuCheckpointProcessLock(pid, timeout ? &a : NULL);
    } else if (!strcmp(op, "checkpoint")) {
        rc = cuCheckpointProcessCheckpoint(pid, NULL);
    } else if (!strcmp(op, "restore")) {
        rc = cuCheckpointProcessRestore(pid, NULL);
    } else if (!strcmp(op, "unlock")) {
        rc = cuCheckpointProcessUnlock(pid, NULL);
    } else if (!strcmp(op, "state")) {
        rc = CUDA_SUCCESS;
    } else if (!strcmp(op, "tid")) {
        rc = cuCheckpointProcessGetRestoreThreadId(pid, &tid);
        printf("tid rc=%d tid=%d ms=%.3f\n", (int)rc, tid, now_ms() - t0);
        fflush(stdout);
        return (int)rc;
    } else {
        return -1;
    }
    double ms = now_ms() - t0;
    CUprocessState st;
    CUresult src = cuCheckpointProcessGetState(pid, &st);
    if (!strcmp(op, "state"))
        rc = src;
    printf("%s rc=%d state=%d ms=%.3f\n", op, (int)rc, src == CUDA_SUCCESS ? (int)st : -1, ms);
    fflush(stdout);
    return (int)rc;
}

int main(int argc, char **argv)
{
    if (argc != 1 && argc != 3 && argc != 4) {
        fprintf(stderr, "usage: cpctl [lock|checkpoint|restore|unlock|state|tid PID [TIMEOUT_MS]]\n");
        return 64;
    }
    CUresult rc = cuInit(0);
    if (rc != CUDA_SUCCESS) {
        fprintf(stderr, "error cuInit %d\n", (int)rc);
        return 2;
    }
    if (argc > 1) {
        int r = call(argv[1], atoi(argv[2]), argc == 4 ? argv[3] : NULL);
        if (r < 0)
            fprintf(stderr, "cpctl: unknown op '%s': lock, checkpoint, restore, unlock, state or tid\n",
                    argv[1]);
        return r < 0 ? 64 : r != 0;
    }
    char line[256];
    while (fgets(line, sizeof line, stdin)) {
        char op[32], timeout[32];
        int pid;
        int n = sscanf(line, "%31s %d %31s", op, &pid, timeout);
        if (n < 2 || call(op, pid, n == 3 ? timeout : NULL) < 0) {
            printf("error usage: OP PID [TIMEOUT_MS]\n");
            fflush(stdout);
        }
    }
    return 0;
}
