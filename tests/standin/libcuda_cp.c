/*
 * libcuda_cp.c - test-only stand-in for the CUDA driver, part 6: process checkpoint
 * (cuCheckpointProcess*, drivers from CUDA 12.8 on; issue 46), as FACTS.md saw it on the H100
 * (driver 580.159.04, 2026-12-06).
 *
 * The real driver does the work in the target process, on a thread of its own: a target held
 * whole (SIGSTOP, the freezer) never answers, one held at its calling thread by ptrace does.
 * So here each process runs a "driver thread" from its first context on (the real driver's
 * threads come with its contexts; CONVGPU_STANDIN_CP_THREAD) that serves its slot's mailbox
 * in the shared segment (standin_shm.h, struct si_cp). A checkpointing process (any
 * that called cuInit) posts a request there and waits on a futex for the answer; one the
 * target never took by the deadline is taken back (NOT_READY) and never runs later.
 *
 * In the target:
 *   lock        RUNNING -> LOCKED: the gate closes (libcuda_int.h, CHECK_INIT) and the lock
 *               waits for the calls in flight, up to its timeout (else NOT_READY, RUNNING)
 *   checkpoint  LOCKED -> CHECKPOINTED: the slot's bytes on every device leave the shared
 *               capacity (remembered for the restore); their copy is host memory of this
 *               process (backed allocations' contents, the rest touched bytes)
 *   restore     CHECKPOINTED -> LOCKED, if every device has the room; else OOM, and the
 *               process is beyond saving (FACTS.md): the next restore is 304, unlock 401,
 *               the state still CHECKPOINTED (driver 580 on the H100: docs/gpu-runs/2026-12-06b)
 *   unlock      LOCKED -> RUNNING: the gate opens
 *
 * The caller's side, and the exported calls: libcuda_cp_api.c.
 *
 * Same build rule as libcuda.c: -O0 so each exported function begins with `push %rbp`.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <semaphore.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "libcuda_int.h"

/* ------------------------------------------------------------------ the gate */

static int g_locked;        /* calls wait at the gate */
static long g_inflight;     /* calls past the gate that have not returned */
static __thread int t_in;   /* calls of this thread past the gate (nested: a signal handler's) */
static pthread_mutex_t g_gate_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_open_cv = PTHREAD_COND_INITIALIZER;    /* the gate opened */
static pthread_cond_t g_idle_cv;                                /* in flight fell to 0 (monotonic) */

static void gate_init(void)
{
    pthread_condattr_t a;
    pthread_condattr_init(&a);
    pthread_condattr_setclock(&a, CLOCK_MONOTONIC);
    pthread_cond_init(&g_idle_cv, &a);
    pthread_condattr_destroy(&a);
}

static void out_of_flight(void)
{
    /* seq_cst against the lock's store of g_locked then load of g_inflight: either the lock
     * sees this call in flight, or the call sees the gate closed */
    if (__atomic_sub_fetch(&g_inflight, 1, __ATOMIC_SEQ_CST) == 0 &&
        __atomic_load_n(&g_locked, __ATOMIC_SEQ_CST)) {
        pthread_mutex_lock(&g_gate_mu);
        pthread_cond_broadcast(&g_idle_cv);
        pthread_mutex_unlock(&g_gate_mu);
    }
}

int gate_enter(void)
{
    if (t_in) {
        t_in++;
        return 1;
    }
    for (;;) {
        __atomic_add_fetch(&g_inflight, 1, __ATOMIC_SEQ_CST);
        if (!__atomic_load_n(&g_locked, __ATOMIC_SEQ_CST))
            break;
        out_of_flight();
        pthread_mutex_lock(&g_gate_mu);
        while (__atomic_load_n(&g_locked, __ATOMIC_SEQ_CST))
            pthread_cond_wait(&g_open_cv, &g_gate_mu);
        pthread_mutex_unlock(&g_gate_mu);
    }
    t_in = 1;
    return 1;
}

void gate_leave(int *entered)
{
    (void)entered;
    if (--t_in == 0)
        out_of_flight();
}

/* ----------------------------------------------------- the target's side */

static uint32_t g_state;            /* CUprocessState */
static int g_doomed;                /* a restore failed for want of room: beyond saving */
static uint64_t g_saved[SI_MAX_DEV];/* what the slot held on each host GPU at the checkpoint */
static void *g_copy;                /* the host copy of what no backed allocation holds */
static size_t g_copy_len;
static uint64_t g_cp_ms;            /* CONVGPU_STANDIN_CP_MS: how long a checkpoint or restore takes */
static uint64_t g_host_max;         /* CONVGPU_STANDIN_CP_HOST_MAX: most host bytes touched */
static pid_t g_serving;             /* the process whose driver thread runs (0: none yet) */
static enum { AT_CONTEXT, AT_INIT, NEVER } g_start_at;  /* CONVGPU_STANDIN_CP_THREAD */
static int g_had_context;           /* a context was made (a forked child inherits it) */
static int g_quit;                  /* exiting: the slot is given back, answer no more */

static void nap_ms(uint64_t ms)
{
    struct timespec ts = {.tv_sec = ms / 1000, .tv_nsec = (ms % 1000) * 1000000};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR)
        ;
}

static CUresult t_lock(uint32_t ms)
{
    if (g_state != CU_PROCESS_STATE_RUNNING)
        return CUDA_ERROR_ILLEGAL_STATE;
    struct timespec dl;
    clock_gettime(CLOCK_MONOTONIC, &dl);
    dl.tv_sec += ms / 1000;
    dl.tv_nsec += (long)(ms % 1000) * 1000000L;
    if (dl.tv_nsec >= 1000000000L)
        dl.tv_sec++, dl.tv_nsec -= 1000000000L;
    pthread_mutex_lock(&g_gate_mu);
    __atomic_store_n(&g_locked, 1, __ATOMIC_SEQ_CST);
    int rc = 0;
    while (__atomic_load_n(&g_inflight, __ATOMIC_SEQ_CST) > 0 && rc != ETIMEDOUT)
        rc = pthread_cond_timedwait(&g_idle_cv, &g_gate_mu, &dl);
    if (__atomic_load_n(&g_inflight, __ATOMIC_SEQ_CST) > 0) {  /* a call still runs: as it was */
        __atomic_store_n(&g_locked, 0, __ATOMIC_SEQ_CST);
        pthread_cond_broadcast(&g_open_cv);
        pthread_mutex_unlock(&g_gate_mu);
        return CUDA_ERROR_NOT_READY;
    }
    pthread_mutex_unlock(&g_gate_mu);
    g_state = CU_PROCESS_STATE_LOCKED;
    return CUDA_SUCCESS;
}

static CUresult t_unlock(void)
{
    if (g_state != CU_PROCESS_STATE_LOCKED)
        return CUDA_ERROR_ILLEGAL_STATE;
    pthread_mutex_lock(&g_gate_mu);
    __atomic_store_n(&g_locked, 0, __ATOMIC_SEQ_CST);
    pthread_cond_broadcast(&g_open_cv);
    pthread_mutex_unlock(&g_gate_mu);
    g_state = CU_PROCESS_STATE_RUNNING;
    return CUDA_SUCCESS;
}

/* Backed mode: a memory object's contents (K_MEM: its pages; K_HANDLE: its memfd). */
static int backed(const struct obj *o)
{
    return g_backed && (o->kind == K_MEM || o->kind == K_HANDLE);
}

#define MOVE_CHUNK (64ull << 20)

/* One backed object's contents moved a chunk at a time, so that the host holds little more
 * than one copy meanwhile: out to o->aside, the device's pages dropped as they are copied (a
 * restore that did not copy back would read zeros), or back, the aside freed as it empties.
 * -1: a memfd's read or write failed (the contents are lost). */
static int move(struct obj *o, int out)
{
    for (uint64_t off = 0; off < o->size; off += MOVE_CHUNK) {
        size_t n = o->size - off < MOVE_CHUNK ? o->size - off : MOVE_CHUNK;
        char *dev = (char *)o->key + off, *side = (char *)o->aside + off;
        if (o->kind == K_MEM && out) {
            memcpy(side, dev, n);
            madvise(dev, n, MADV_DONTNEED);
        } else if (o->kind == K_MEM) {
            memcpy(dev, side, n);
        } else if (out) {
            if (pread(o->memfd, side, n, (off_t)off) != (ssize_t)n)
                return -1;
            fallocate(o->memfd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, (off_t)off, (off_t)n);
        } else if (pwrite(o->memfd, side, n, (off_t)off) != (ssize_t)n) {
            return -1;
        }
        if (!out)
            munmap(side, n);
    }
    if (!out)
        o->aside = NULL;
    return 0;
}

/* Under tab_lock(): every object moved out brought back (a checkpoint that cannot finish). */
static int move_all_back(void)
{
    int rc = 0;
    for (struct obj *o = tab_mems(); o; o = o->mnext)
        if (o->aside && move(o, 0) != 0)
            rc = -1;
    return rc;
}

static CUresult t_checkpoint(void)
{
    if (g_state != CU_PROCESS_STATE_LOCKED)
        return CUDA_ERROR_ILLEGAL_STATE;
    /* nothing of ours is in flight (locked): the slot holds still */
    const uint64_t *used = acct_shm()->seg->slots[acct_slot()].used;
    uint64_t total = 0, copied = 0;
    for (int d = 0; d < SI_MAX_DEV; d++)
        total += used[d];
    int oom = 0, lost = 0;
    tab_lock();
    for (struct obj *o = tab_mems(); o && !oom && !lost; o = o->mnext) {
        if (!backed(o))
            continue;
        void *a = mmap(NULL, o->size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        oom = a == MAP_FAILED;
        o->aside = oom ? NULL : a;
        lost = !oom && move(o, 1) != 0;
        copied += o->size;
    }
    /* The host copy lives in this process (its RSS and memory cgroup grow by it, FACTS.md):
     * what no backed allocation holds is touched here. */
    uint64_t rest = total > copied ? total - copied : 0;
    if (rest > g_host_max)
        rest = g_host_max;
    void *h = rest && !oom && !lost ? mmap(NULL, rest, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)
                                    : NULL;
    oom = oom || h == MAP_FAILED;
    if (oom && move_all_back() == 0) {  /* out of host memory: as it was */
        tab_unlock();
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    tab_unlock();
    if (oom || lost) {  /* contents lost: the driver's "uncorrectable error" */
        g_state = CU_PROCESS_STATE_FAILED;
        return CUDA_ERROR_OPERATING_SYSTEM;
    }
    if (h) {
        memset(h, 0xc9, rest);
        g_copy = h, g_copy_len = rest;
    }
    acct_take_all(g_saved);
    nap_ms(g_cp_ms);
    g_state = CU_PROCESS_STATE_CHECKPOINTED;
    return CUDA_SUCCESS;
}

static CUresult t_restore(void)
{
    if (g_state == CU_PROCESS_STATE_FAILED)
        return CUDA_ERROR_OPERATING_SYSTEM;
    if (g_state != CU_PROCESS_STATE_CHECKPOINTED)
        return CUDA_ERROR_ILLEGAL_STATE;
    if (g_doomed)       /* the real driver: 304 after a restore that lacked the room, still CHECKPOINTED */
        return CUDA_ERROR_OPERATING_SYSTEM;
    CUresult rc = acct_give_back(g_saved);
    if (rc == CUDA_ERROR_OUT_OF_MEMORY)
        g_doomed = 1;   /* still CHECKPOINTED as the driver says, but never to run again */
    if (rc)
        return rc;
    nap_ms(g_cp_ms);
    tab_lock();
    int lost = move_all_back();
    tab_unlock();
    if (g_copy)
        munmap(g_copy, g_copy_len);
    g_copy = NULL, g_copy_len = 0;
    memset(g_saved, 0, sizeof g_saved);
    g_state = lost ? CU_PROCESS_STATE_FAILED : CU_PROCESS_STATE_LOCKED;
    return lost ? CUDA_ERROR_OPERATING_SYSTEM : CUDA_SUCCESS;
}

static CUresult t_do(uint32_t op, uint32_t arg)
{
    switch (op) {
    case SI_CP_LOCK:
        return t_lock(arg);
    case SI_CP_CHECKPOINT:
        return t_checkpoint();
    case SI_CP_RESTORE:
        return t_restore();
    case SI_CP_UNLOCK:
        return t_unlock();
    }
    return CUDA_ERROR_INVALID_VALUE;
}

long cp_futex(uint32_t *word, int op, uint32_t val, const struct timespec *rel)
{
    return syscall(SYS_futex, word, op, val, rel, NULL, 0);    /* shared: the segment is */
}

struct start {
    int slot;
    sem_t up;
};

/* The driver thread: takes each request posted to the slot's mailbox, does it, answers. */
static void *serve(void *arg)
{
    struct start *st = arg;
    struct si_cp *cp = &acct_shm()->seg->cp[st->slot];
    __atomic_store_n(&cp->tid, (int32_t)syscall(SYS_gettid), __ATOMIC_RELEASE);
    sem_post(&st->up);  /* st is gone after this */
    uint32_t seen = 0;  /* the mailbox was cleared with the slot: a request may wait already */
    for (;;) {
        uint32_t r = __atomic_load_n(&cp->req, __ATOMIC_ACQUIRE);
        if (r >> 4 == seen) {
            cp_futex(&cp->req, FUTEX_WAIT, r, NULL);
            continue;
        }
        if ((r & SI_CP_OP) == SI_CP_NONE) {     /* taken back by its caller */
            seen = r >> 4;
            continue;
        }
        if (!__atomic_compare_exchange_n(&cp->req, &r, r | SI_CP_TAKEN, 0, __ATOMIC_ACQ_REL,
                                         __ATOMIC_ACQUIRE))
            continue;
        seen = r >> 4;
        CUresult rc = t_do(r & SI_CP_OP, cp->arg);
        if (__atomic_load_n(&g_quit, __ATOMIC_ACQUIRE))
            return NULL;
        memcpy(cp->saved, g_saved, sizeof g_saved);
        cp->result = rc;
        __atomic_store_n(&cp->state, g_state, __ATOMIC_RELEASE);
        __atomic_store_n(&cp->ack, seen, __ATOMIC_RELEASE);
        cp_futex(&cp->ack, FUTEX_WAKE, INT_MAX, NULL);
    }
}

/* At cuInit: the knobs. */
void cp_init(void)
{
    const char *at = getenv("CONVGPU_STANDIN_CP_THREAD");
    g_start_at = !at || !*at || !strcmp(at, "context") ? AT_CONTEXT : !strcmp(at, "init") ? AT_INIT : NEVER;
    g_cp_ms = env_u64("CONVGPU_STANDIN_CP_MS", 0);
    g_host_max = env_u64("CONVGPU_STANDIN_CP_HOST_MAX", UINT64_MAX);
    gate_init();
}

int cp_context(void)
{
    g_had_context = 1;
    return g_start_at == AT_CONTEXT && g_serving != getpid();
}

static void serve_slot(int slot);

void cp_slot_taken(int slot)
{
    if (g_serving != getpid() && (g_start_at == AT_INIT || (g_start_at == AT_CONTEXT && g_had_context)))
        serve_slot(slot);
}

/* Under the segment's lock: the driver thread, started with every signal blocked (process
 * signals go to the application's threads, as before), its tid published before this returns
 * (GetRestoreThreadId). No thread (out of threads): the process never answers. */
static void serve_slot(int slot)
{
    struct start st = {.slot = slot};
    sem_init(&st.up, 0, 0);
    pthread_attr_t a;
    pthread_attr_init(&a);
    pthread_attr_setdetachstate(&a, PTHREAD_CREATE_DETACHED);
    pthread_attr_setstacksize(&a, 256 << 10);
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    pthread_t t;
    int ok = pthread_create(&t, &a, serve, &st) == 0;
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    pthread_attr_destroy(&a);
    if (ok) {
        while (sem_wait(&st.up) != 0 && errno == EINTR)
            ;
        g_serving = getpid();
    }
    sem_destroy(&st.up);
}

void cp_atfork_child(void)
{
    /* one thread left, none in a call; the parent's lock is not the child's */
    pthread_mutex_init(&g_gate_mu, NULL);
    pthread_cond_init(&g_open_cv, NULL);
    gate_init();
    g_locked = 0, g_inflight = 0, t_in = 0;
    g_state = CU_PROCESS_STATE_RUNNING, g_doomed = 0, g_serving = 0;
}

void cp_exiting(void)
{
    __atomic_store_n(&g_quit, 1, __ATOMIC_RELEASE);
}
