/*
 * libcuda_cp_api.c - test-only stand-in for the CUDA driver, part 6 (continued): the
 * cuCheckpointProcess* calls, the caller's side. The target's side (its driver thread, the
 * gate, what lock, checkpoint, restore and unlock do) is libcuda_cp.c; the mailbox between
 * them is standin_shm.h's struct si_cp.
 *
 * Same build rule as libcuda.c: -O0 so each exported function begins with `push %rbp`.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <pthread.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "libcuda_int.h"

static pthread_mutex_t g_call_mu = PTHREAD_MUTEX_INITIALIZER;  /* one request of ours at a time */

/* The slot of live process pid (and its start time), or -1. */
static int find(int pid, uint64_t *start)
{
    struct si_handle *h = acct_shm();
    int idx = -1;
    if (pid <= 0 || !h->seg || si_lock(h) != 0)
        return -1;
    si_reap(h, acct_slot());
    for (uint32_t i = 0; i < h->seg->slot_hiwater && i < SI_NSLOTS; i++)
        if (h->seg->slots[i].pid == pid) {
            idx = (int)i;
            *start = h->seg->slots[i].start_time;
            break;
        }
    si_unlock(h);
    return idx;
}

static int same(int idx, int pid, uint64_t start)
{
    uint64_t s = 0;
    return find(pid, &s) == idx && s == start;
}

static int64_t now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

/* Callers of the same target take turns: an OFD lock on byte NSLOTS + slot of the segment's
 * file (dropped by the kernel if the caller dies), inside our own mutex (an OFD lock does not
 * exclude another thread of the same open file). */
static int turn(int fd, int idx, short type)
{
    struct flock fl = {.l_type = type, .l_whence = SEEK_SET, .l_start = SI_NSLOTS + idx, .l_len = 1};
    int rc;
    while ((rc = fcntl(fd, F_OFD_SETLKW, &fl)) != 0 && errno == EINTR)
        ;
    return rc;
}

/* Post op to pid's driver thread and wait for its answer. Not taken within wait_ms: taken
 * back, CUDA_ERROR_NOT_READY (a target that cannot run: SIGSTOP, the freezer). Taken: its
 * answer, however long (a lock bounds its own wait by arg). */
static CUresult request(int pid, uint32_t op, uint32_t arg, uint32_t wait_ms)
{
    uint64_t start = 0;
    int idx = find(pid, &start);
    if (idx < 0)
        return CUDA_ERROR_INVALID_VALUE;
    struct si_handle *h = acct_shm();
    struct si_cp *cp = &h->seg->cp[idx];
    pthread_mutex_lock(&g_call_mu);
    if (turn(h->fd, idx, F_WRLCK) != 0) {
        pthread_mutex_unlock(&g_call_mu);
        return CUDA_ERROR_UNKNOWN;
    }
    CUresult rc = CUDA_ERROR_INVALID_VALUE;
    if (same(idx, pid, start)) {
        uint32_t seq = ((__atomic_load_n(&cp->req, __ATOMIC_ACQUIRE) >> 4) + 1) & 0x0fffffffu;
        seq = seq ? seq : 1;
        uint32_t posted = seq << 4 | op;
        cp->arg = arg;
        __atomic_store_n(&cp->req, posted, __ATOMIC_RELEASE);
        cp_futex(&cp->req, FUTEX_WAKE, 1, NULL);
        int64_t deadline = now_us() + (int64_t)wait_ms * 1000;
        int cancellable = 1;
        for (;;) {
            uint32_t a = __atomic_load_n(&cp->ack, __ATOMIC_ACQUIRE);
            if (a == seq) {
                rc = cp->result;
                break;
            }
            if (!same(idx, pid, start)) {   /* it exited meanwhile */
                rc = CUDA_ERROR_INVALID_VALUE;
                break;
            }
            int64_t left = deadline - now_us();
            if (left <= 0 && cancellable) {
                uint32_t want = posted;
                if (__atomic_compare_exchange_n(&cp->req, &want, seq << 4, 0, __ATOMIC_ACQ_REL,
                                                __ATOMIC_ACQUIRE)) {
                    rc = CUDA_ERROR_NOT_READY;
                    break;
                }
                cancellable = 0;    /* its driver thread has it: the answer comes */
            }
            int64_t nap = left > 0 && left < 50000 ? left : 50000;  /* 50 ms: is it still there? */
            struct timespec rel = {.tv_sec = 0, .tv_nsec = nap * 1000L};
            cp_futex(&cp->ack, FUTEX_WAIT, a, &rel);
        }
    }
    turn(h->fd, idx, F_UNLCK);
    pthread_mutex_unlock(&g_call_mu);
    return rc;
}

/* CONVGPU_STANDIN_CP_WAIT_MS (default 30 s): how long a request waits for a target that does
 * not run, and a lock with timeoutMs 0. The real driver then waits for good (FACTS.md). */
static uint32_t wait_ms(void)
{
    uint64_t v = env_u64("CONVGPU_STANDIN_CP_WAIT_MS", 30000);
    return v > UINT32_MAX ? UINT32_MAX : (uint32_t)v;
}

static int zeroed(const void *p, size_t n)
{
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++)
        if (b[i])
            return 0;
    return 1;
}

/* CUresult cuCheckpointProcessGetState(int pid, CUprocessState *state): the state the target
 * last set, read from its mailbox (a target that cannot run answers too) */
API CUresult cuCheckpointProcessGetState(int pid, CUprocessState *state)
{
    CHECK_INIT_UNGATED();
    uint64_t start;
    int idx = state ? find(pid, &start) : -1;
    if (idx < 0)
        return CUDA_ERROR_INVALID_VALUE;
    *state = (CUprocessState)__atomic_load_n(&acct_shm()->seg->cp[idx].state, __ATOMIC_ACQUIRE);
    return CUDA_SUCCESS;
}

/* CUresult cuCheckpointProcessGetRestoreThreadId(int pid, int *tid): its driver thread */
API CUresult cuCheckpointProcessGetRestoreThreadId(int pid, int *tid)
{
    CHECK_INIT_UNGATED();
    uint64_t start;
    int idx = tid ? find(pid, &start) : -1;
    if (idx < 0)
        return CUDA_ERROR_INVALID_VALUE;
    *tid = __atomic_load_n(&acct_shm()->seg->cp[idx].tid, __ATOMIC_ACQUIRE);
    return *tid ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}

API CUresult cuCheckpointProcessLock(int pid, CUcheckpointLockArgs *args)
{
    CHECK_INIT_UNGATED();
    if (args && (args->reserved0 || !zeroed(args->reserved1, sizeof args->reserved1)))
        return CUDA_ERROR_INVALID_VALUE;
    uint32_t ms = args && args->timeoutMs ? args->timeoutMs : wait_ms();
    return request(pid, SI_CP_LOCK, ms, ms);
}

API CUresult cuCheckpointProcessCheckpoint(int pid, CUcheckpointCheckpointArgs *args)
{
    CHECK_INIT_UNGATED();
    if (args && !zeroed(args, sizeof *args))
        return CUDA_ERROR_INVALID_VALUE;
    return request(pid, SI_CP_CHECKPOINT, 0, wait_ms());
}

/* GPU remapping (gpuPairs) is not played: CUDA_ERROR_NOT_SUPPORTED. */
API CUresult cuCheckpointProcessRestore(int pid, CUcheckpointRestoreArgs *args)
{
    CHECK_INIT_UNGATED();
    if (args && (args->gpuPairs || args->gpuPairsCount))
        return CUDA_ERROR_NOT_SUPPORTED;
    if (args && (!zeroed(args->reserved, sizeof args->reserved) || args->reserved1))
        return CUDA_ERROR_INVALID_VALUE;
    return request(pid, SI_CP_RESTORE, 0, wait_ms());
}

API CUresult cuCheckpointProcessUnlock(int pid, CUcheckpointUnlockArgs *args)
{
    CHECK_INIT_UNGATED();
    if (args && !zeroed(args, sizeof *args))
        return CUDA_ERROR_INVALID_VALUE;
    return request(pid, SI_CP_UNLOCK, 0, wait_ms());
}
