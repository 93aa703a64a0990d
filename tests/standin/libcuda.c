/*
 * libcuda.c - test-only stand-in for the CUDA driver (libcuda.so.1), part 1:
 * cuInit, devices, contexts, error strings, cuGetProcAddress, plus the
 * cross-process capacity accounting and the object table used by
 * libcuda_mem.c.  No GPU: "device memory" is PROT_NONE address space.
 *
 * Build rule that matters (see Makefile, check-prologue): -O0
 * -fno-omit-frame-pointer -fcf-protection=none, so every exported function
 * starts with `push %rbp` like the real driver.  uprobes on that instruction
 * are emulated in the kernel; on most others they are single-stepped, which
 * would make probe-overhead measurements on the stand-in meaningless.
 *
 * No stdio anywhere on API paths; everything is thread-safe.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include "libcuda_int.h"
#include "standin_shm.h"

int g_inited;
int g_ndev = 1;             /* the GPUs this process sees (visible.c) */
int g_host[SI_MAX_DEV];     /* its ordinal -> host GPU (the shared segment counts by host GPU) */
static struct obj g_primary[SI_MAX_DEV]; /* primary contexts, see below */
uint64_t g_capacity = SI_DEFAULT_CAPACITY;
uint64_t g_alloc_ms;
uint64_t g_free_ms;
uint64_t g_free_return_ms;
/* An H200's 132 SMs x 2,048 resident threads: cuCtxSetLimit(CU_LIMIT_STACK_SIZE, 64 KiB) took
 * exactly 270,336 x (65,536 - 1,024) bytes there (driver 580.159.04, issue 39). */
uint64_t g_resident_threads = 270336;
int g_graph_at_instantiate;
int g_backed;
static uint64_t g_ctx_overhead;
static pthread_mutex_t g_init_mu = PTHREAD_MUTEX_INITIALIZER;

/* ------------------------------------------------------------ accounting */

static struct si_handle g_shm = {-1, NULL};
static int g_slot = -1; /* our slot in the shared table, -1 = none yet */
static uint32_t g_slot_flags; /* SI_GRAPHICS: NVML lists us as a graphics client */

uint64_t env_u64(const char *name, uint64_t dflt)
{
    const char *v = getenv(name);
    if (!v || !*v)
        return dflt;
    char *end;
    errno = 0;
    unsigned long long x = strtoull(v, &end, 0);
    return (errno || *end) ? dflt : (uint64_t)x;
}

/* Forked child: the inherited shm fd shares the parent's open file
 * description, and with it the parent's slot lock, so the child needs its
 * own description and its own slot. */
static void atfork_child(void)
{
    if (g_shm.seg) {
        close(g_shm.fd);
        if (si_open(&g_shm, 1) != 0)
            g_shm.seg = NULL;
    }
    g_slot = -1;
    cp_atfork_child();
}

/* Normal exit: give the slot back now rather than waiting for a reaper. */
static void at_exit(void)
{
    cp_exiting();   /* its driver thread answers no more: the slot may be someone else's next */
    if (g_shm.seg && g_slot >= 0 && si_lock(&g_shm) == 0) {
        si_unregister(&g_shm, g_slot);
        g_slot = -1;
        si_unlock(&g_shm);
    }
}

/* Called with the shm lock held. */
static int ensure_slot(void)
{
    if (g_slot < 0) {
        g_slot = si_register(&g_shm);
        if (g_slot >= 0) {
            g_shm.seg->slots[g_slot].pad = g_slot_flags;
            cp_slot_taken(g_slot);  /* its driver thread: checkpoint requests come to the slot */
        }
    }
    return g_slot;
}

void driver_thread_due(void)
{
    if (cp_context() && g_shm.seg && si_lock(&g_shm) == 0) {
        if (ensure_slot() >= 0)
            cp_slot_taken(g_slot);
        si_unlock(&g_shm);
    }
}

struct si_handle *acct_shm(void) { return &g_shm; }
int acct_slot(void) { return g_slot; }

/* Where a peak rose: who held what (under the segment's lock). */
static void note_peak(int dev, uint64_t used)
{
    struct si_seg *s = g_shm.seg;
    if (used > s->peak[dev]) {
        __atomic_store_n(&s->peak[dev], used, __ATOMIC_RELAXED);
        memcpy(s->at_peak, s->slots, s->slot_hiwater * sizeof s->slots[0]);
    }
}

CUresult acct_take_all(uint64_t saved[SI_MAX_DEV])
{
    if (!g_shm.seg || g_slot < 0 || si_lock(&g_shm) != 0)
        return CUDA_ERROR_UNKNOWN;
    uint64_t *used = g_shm.seg->slots[g_slot].used;
    for (int d = 0; d < SI_MAX_DEV; d++) {
        saved[d] = used[d];
        used[d] = 0;
    }
    si_reap(&g_shm, g_slot);    /* recounts the devices' used[] without them */
    si_unlock(&g_shm);
    return CUDA_SUCCESS;
}

CUresult acct_give_back(const uint64_t saved[SI_MAX_DEV])
{
    if (!g_shm.seg || g_slot < 0 || si_lock(&g_shm) != 0)
        return CUDA_ERROR_UNKNOWN;
    struct si_seg *s = g_shm.seg;
    si_reap(&g_shm, g_slot);
    for (int d = 0; d < SI_MAX_DEV; d++)
        if (saved[d] > g_capacity || s->used[d] > g_capacity - saved[d]) {
            si_unlock(&g_shm);
            return CUDA_ERROR_OUT_OF_MEMORY;    /* on any device: nothing changed */
        }
    for (int d = 0; d < SI_MAX_DEV; d++) {
        if (!saved[d])
            continue;
        s->slots[g_slot].used[d] += saved[d];
        __atomic_store_n(&s->used[d], s->used[d] + saved[d], __ATOMIC_RELAXED);
        note_peak(d, s->used[d]);
    }
    si_unlock(&g_shm);
    return CUDA_SUCCESS;
}

CUresult acct_charge(int ordinal, uint64_t bytes)
{
    if (ordinal < 0 || ordinal >= g_ndev)
        return CUDA_ERROR_INVALID_DEVICE;
    int dev = g_host[ordinal];
    if (bytes == 0)
        return CUDA_SUCCESS;
    if (!g_shm.seg || si_lock(&g_shm) != 0)
        return CUDA_ERROR_UNKNOWN;
    struct si_seg *s = g_shm.seg;
    if (ensure_slot() < 0) {
        si_unlock(&g_shm);
        return CUDA_ERROR_OUT_OF_MEMORY; /* more than 1024 processes */
    }
    si_reap(&g_shm, g_slot); /* exact: drops shares of dead processes */
    uint64_t used = s->used[dev];
    if (bytes > g_capacity || used > g_capacity - bytes) {
        si_unlock(&g_shm);
        return CUDA_ERROR_OUT_OF_MEMORY; /* and nothing changed */
    }
    s->slots[g_slot].used[dev] += bytes;
    used += bytes;
    __atomic_store_n(&s->used[dev], used, __ATOMIC_RELAXED);
    note_peak(dev, used);
    si_unlock(&g_shm);
    return CUDA_SUCCESS;
}

void acct_uncharge(int ordinal, uint64_t bytes)
{
    if (ordinal < 0 || ordinal >= g_ndev || bytes == 0 || !g_shm.seg || si_lock(&g_shm) != 0)
        return;
    int dev = g_host[ordinal];
    if (g_slot >= 0) {
        uint64_t *u = &g_shm.seg->slots[g_slot].used[dev];
        *u = *u > bytes ? *u - bytes : 0;
    }
    si_reap(&g_shm, g_slot);
    si_unlock(&g_shm);
}

uint64_t acct_used(int ordinal)
{
    uint64_t v = 0;
    if (ordinal >= 0 && ordinal < g_ndev && g_shm.seg && si_lock(&g_shm) == 0) {
        si_reap(&g_shm, g_slot);
        v = g_shm.seg->used[g_host[ordinal]];
        si_unlock(&g_shm);
    }
    return v;
}

/* ---------------------------------------------------------- object table */

#define TAB_BITS 16
static struct obj *g_tab[1u << TAB_BITS];
static pthread_mutex_t g_tab_mu = PTHREAD_MUTEX_INITIALIZER;

static size_t tab_hash(uintptr_t k)
{
    return (size_t)(((uint64_t)(k >> 4) * 0x9E3779B97F4A7C15ull) >> (64 - TAB_BITS));
}

void tab_lock(void) { pthread_mutex_lock(&g_tab_mu); }
void tab_unlock(void) { pthread_mutex_unlock(&g_tab_mu); }

struct obj *tab_find(uintptr_t key, int kind)
{
    for (struct obj *o = g_tab[tab_hash(key)]; o; o = o->next)
        if (o->key == key && o->kind == kind)
            return o;
    return NULL;
}

static struct obj *g_mems; /* K_MEM, K_MAP, K_HANDLE, chained by mprev/mnext */

static int is_mem(int kind) { return kind == K_MEM || kind == K_MAP || kind == K_HANDLE; }

void tab_insert(struct obj *o)
{
    size_t h = tab_hash(o->key);
    o->next = g_tab[h];
    g_tab[h] = o;
    if (is_mem(o->kind)) {
        o->mprev = NULL;
        o->mnext = g_mems;
        if (g_mems)
            g_mems->mprev = o;
        g_mems = o;
    }
}

struct obj *tab_mems(void) { return g_mems; }

struct obj *tab_span(uintptr_t addr, uint64_t n)
{
    uint64_t end;
    if (__builtin_add_overflow((uint64_t)addr, n, &end))
        return NULL;
    for (struct obj *o = g_mems; o; o = o->mnext)
        if ((o->kind == K_MEM || o->kind == K_MAP) && addr >= o->key && end <= o->key + o->size)
            return o;
    return NULL;
}

struct obj *tab_remove(uintptr_t key, int kind)
{
    for (struct obj **pp = &g_tab[tab_hash(key)]; *pp; pp = &(*pp)->next) {
        struct obj *o = *pp;
        if (o->key == key && o->kind == kind) {
            *pp = o->next;
            o->next = NULL;
            if (is_mem(kind)) {
                if (o->mprev)
                    o->mprev->mnext = o->mnext;
                else
                    g_mems = o->mnext;
                if (o->mnext)
                    o->mnext->mprev = o->mprev;
                o->mprev = o->mnext = NULL;
            }
            return o;
        }
    }
    return NULL;
}

/* ------------------------------------------------------------------ init */

API CUresult cuInit(unsigned int Flags)
{
    SAVES_R12();                    /* the driver's prologue (no CHECK_INIT here) */
    if (Flags != 0)
        return CUDA_ERROR_INVALID_VALUE;
    if (__atomic_load_n(&g_inited, __ATOMIC_ACQUIRE)) {
        int in = gate_enter();  /* a call like any other: it waits while the process is locked */
        gate_leave(&in);
        return CUDA_SUCCESS;
    }
    CUresult rc = CUDA_SUCCESS;
    pthread_mutex_lock(&g_init_mu);
    if (!g_inited) {
        uint64_t n = env_u64("CONVGPU_STANDIN_DEVICES", 1);
        g_ndev = standin_visible((int)(n > SI_MAX_DEV ? SI_MAX_DEV : n), g_host);
        g_capacity = env_u64("CONVGPU_STANDIN_CAPACITY", SI_DEFAULT_CAPACITY);
        g_ctx_overhead = env_u64("CONVGPU_STANDIN_CTX_OVERHEAD", 0);
        g_slot_flags = env_u64("CONVGPU_STANDIN_GRAPHICS", 0) == 1 ? SI_GRAPHICS : 0;
        g_alloc_ms = env_u64("CONVGPU_STANDIN_ALLOC_MS", 0);
        g_free_ms = env_u64("CONVGPU_STANDIN_FREE_MS", 0);
        g_free_return_ms = env_u64("CONVGPU_STANDIN_FREE_RETURN_MS", 0);
        g_resident_threads = env_u64("CONVGPU_STANDIN_RESIDENT_THREADS", 270336);
        const char *at = getenv("CONVGPU_STANDIN_GRAPH_AT");
        g_graph_at_instantiate = at && strcmp(at, "instantiate") == 0;
        g_backed = env_u64("CONVGPU_STANDIN_BACKED", 0) == 1;
        cp_init();
        /* Teardown: the real driver frees a process's memory when its files close, ~55 ms
         * after the exit tracepoint on the H100 (exit_mm comes in between). Here the slot is
         * freed when the shm file closes; host memory touched now makes exit_mm, and so the
         * gap, as long (a few ms per 100 MiB). */
        uint64_t exit_mb = env_u64("CONVGPU_STANDIN_EXIT_MB", 0);
        if (exit_mb) {
            void *m = mmap(NULL, exit_mb << 20, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
            if (m != MAP_FAILED)
                memset(m, 1, exit_mb << 20);
        }
        if (g_ndev == 0) {
            rc = CUDA_ERROR_NO_DEVICE;
        } else if (si_open(&g_shm, 1) != 0) {
            /* Missing /dev/shm or a segment of another layout version;
             * `standin-usage --unlink` removes a stale one. */
            static const char msg[] = "convgpu stand-in: cannot use shm segment\n";
            ssize_t w = write(2, msg, sizeof msg - 1);
            (void)w;
            rc = CUDA_ERROR_UNKNOWN;
        } else {
            if (si_lock(&g_shm) == 0) {
                g_shm.seg->capacity_hint = g_capacity;
                ensure_slot();
                si_unlock(&g_shm);
            }
            /* Teardown, second part: files opened after the segment are closed after it,
             * but their releases run first (exit_files queues each as task work, run last
             * in, first out), so the segment's lock (this process's "device memory")
             * drops only after them: a gap between the exit tracepoint and the free. */
            uint64_t exit_fds = env_u64("CONVGPU_STANDIN_EXIT_FDS", 0);
            if (exit_fds) {
                struct rlimit rl;
                if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < exit_fds + 64) {
                    rl.rlim_cur = rl.rlim_max < exit_fds + 64 ? rl.rlim_max : exit_fds + 64;
                    setrlimit(RLIMIT_NOFILE, &rl);
                }
                for (uint64_t i = 0; i < exit_fds && eventfd(0, EFD_CLOEXEC) >= 0; i++)
                    ;
            }
            for (int d = 0; d < SI_MAX_DEV; d++) { /* inactive until retained */
                g_primary[d].kind = K_CTX;
                g_primary[d].dev = d;
                g_primary[d].released = 1;
            }
            standin_open_nodes(g_host, g_ndev);
            pthread_atfork(NULL, NULL, atfork_child);
            atexit(at_exit);
            __atomic_store_n(&g_inited, 1, __ATOMIC_RELEASE);
        }
    }
    pthread_mutex_unlock(&g_init_mu);
    return rc;
}

API CUresult cuDriverGetVersion(int *driverVersion)
{
    CHECK_INIT_UNGATED();   /* answers while the process is locked (libcuda_cp.c) */
    if (!driverVersion)
        return CUDA_ERROR_INVALID_VALUE;
    *driverVersion = 13000;
    return CUDA_SUCCESS;
}

/* --------------------------------------------------------------- devices */

static int dev_ok(CUdevice d) { return d >= 0 && d < g_ndev; }

API CUresult cuDeviceGet(CUdevice *device, int ordinal)
{
    CHECK_INIT();
    if (!device)
        return CUDA_ERROR_INVALID_VALUE;
    if (!dev_ok(ordinal))
        return CUDA_ERROR_INVALID_DEVICE;
    *device = ordinal;
    return CUDA_SUCCESS;
}

API CUresult cuDeviceGetCount(int *count)
{
    CHECK_INIT();
    if (!count)
        return CUDA_ERROR_INVALID_VALUE;
    *count = g_ndev;
    return CUDA_SUCCESS;
}

API CUresult cuDeviceGetName(char *name, int len, CUdevice dev)
{
    CHECK_INIT();
    static const char base[] = "convgpu stand-in GPU ";
    if (!name || len <= 0)
        return CUDA_ERROR_INVALID_VALUE;
    if (!dev_ok(dev))
        return CUDA_ERROR_INVALID_DEVICE;
    char buf[sizeof base + 4];
    memcpy(buf, base, sizeof base - 1);
    size_t n = sizeof base - 1;
    dev = g_host[dev];              /* named after the host GPU, as the driver's names are */
    if (dev >= 10)
        buf[n++] = (char)('0' + dev / 10);
    buf[n++] = (char)('0' + dev % 10);
    buf[n] = 0;
    size_t cap = (size_t)len - 1;
    if (n > cap)
        n = cap;
    memcpy(name, buf, n);
    name[n] = 0;
    return CUDA_SUCCESS;
}

/* CUresult cuDeviceGetUuid_v2(CUuuid *uuid, CUdevice dev): the host GPU's UUID (visible.c),
 * the same 16 bytes as NVML's GPU-... text, as with the real driver (FACTS.md). */
static CUresult uuid_of(CUuuid *uuid, CUdevice dev)
{
    if (!uuid)
        return CUDA_ERROR_INVALID_VALUE;
    if (!dev_ok(dev))
        return CUDA_ERROR_INVALID_DEVICE;
    standin_uuid(g_host[dev], (unsigned char *)uuid->bytes);
    return CUDA_SUCCESS;
}

API CUresult cuDeviceGetUuid_v2(CUuuid *uuid, CUdevice dev)
{
    CHECK_INIT();
    return uuid_of(uuid, dev);
}

API CUresult cuDeviceGetUuid(CUuuid *uuid, CUdevice dev)
{
    CHECK_INIT();
    return uuid_of(uuid, dev);
}

/* The two attributes convgpu reads (enforcer/devattrs.py: a stack limit costs per-thread bytes
 * for every resident thread): CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT (16) and
 * MAX_THREADS_PER_MULTIPROCESSOR (39), whose product is CONVGPU_STANDIN_RESIDENT_THREADS
 * (2,048 threads per SM where it divides, else one). Others: CUDA_ERROR_INVALID_VALUE. */
API CUresult cuDeviceGetAttribute(int *pi, int attrib, CUdevice dev)
{
    CHECK_INIT();
    if (!pi)
        return CUDA_ERROR_INVALID_VALUE;
    if (!dev_ok(dev))
        return CUDA_ERROR_INVALID_DEVICE;
    int per_sm = g_resident_threads % 2048 == 0 ? 2048 : 1;
    if (attrib == 16)
        *pi = (int)(g_resident_threads / per_sm);
    else if (attrib == 39)
        *pi = per_sm;
    else
        return CUDA_ERROR_INVALID_VALUE;
    return CUDA_SUCCESS;
}

API CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev)
{
    CHECK_INIT();
    if (!bytes)
        return CUDA_ERROR_INVALID_VALUE;
    if (!dev_ok(dev))
        return CUDA_ERROR_INVALID_DEVICE;
    *bytes = g_capacity;
    return CUDA_SUCCESS;
}

/* -------------------------------------------------------------- contexts */

/* A context is a struct obj of kind K_CTX: dev = its device, released = 1
 * once destroyed (primary: while its refcount is 0).  Destroyed contexts
 * are never freed, so a stale handle on some thread's stack stays readable
 * and yields CUDA_ERROR_CONTEXT_IS_DESTROYED instead of a crash. */
static int g_primary_ref[SI_MAX_DEV];
static pthread_mutex_t g_ctx_mu = PTHREAD_MUTEX_INITIALIZER;

#define CTX_STACK 64
static __thread CUcontext t_stack[CTX_STACK];
static __thread int t_depth;

static int is_primary(CUcontext c)
{
    struct obj *o = (struct obj *)c;
    return o >= &g_primary[0] && o < &g_primary[SI_MAX_DEV];
}

static int ctx_valid(CUcontext c)
{
    if (is_primary(c))
        return (int)((struct obj *)c - g_primary) < g_ndev;
    tab_lock();
    int ok = tab_find((uintptr_t)c, K_CTX) != NULL;
    tab_unlock();
    return ok;
}

void ctx_lock(void) { pthread_mutex_lock(&g_ctx_mu); }
void ctx_unlock(void) { pthread_mutex_unlock(&g_ctx_mu); }

struct obj *cur_ctx(CUresult *rc)
{
    if (t_depth == 0) {
        *rc = CUDA_ERROR_INVALID_CONTEXT;
        return NULL;
    }
    struct obj *o = (struct obj *)t_stack[t_depth - 1];
    if (__atomic_load_n(&o->released, __ATOMIC_ACQUIRE)) {
        *rc = CUDA_ERROR_CONTEXT_IS_DESTROYED;
        return NULL;
    }
    *rc = CUDA_SUCCESS;
    return o;
}

CUresult cur_dev(int *dev)
{
    if (t_depth == 0)
        return CUDA_ERROR_INVALID_CONTEXT;
    struct obj *o = (struct obj *)t_stack[t_depth - 1];
    if (__atomic_load_n(&o->released, __ATOMIC_ACQUIRE))
        return CUDA_ERROR_CONTEXT_IS_DESTROYED;
    *dev = o->dev;
    return CUDA_SUCCESS;
}

API CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev)
{
    CHECK_INIT();
    if (!pctx)
        return CUDA_ERROR_INVALID_VALUE;
    if (!dev_ok(dev))
        return CUDA_ERROR_INVALID_DEVICE;
    driver_thread_due();    /* the real driver's threads come with its contexts */
    CUresult rc = CUDA_SUCCESS;
    pthread_mutex_lock(&g_ctx_mu);
    if (g_primary_ref[dev] == 0) {
        /* Activating the primary context costs its overhead. */
        rc = acct_charge(dev, g_ctx_overhead);
        if (rc == CUDA_SUCCESS) {
            g_primary[dev].kind = K_CTX;
            g_primary[dev].dev = dev;
            g_primary[dev].size = g_ctx_overhead;
            __atomic_store_n(&g_primary[dev].released, 0, __ATOMIC_RELEASE);
        }
    }
    if (rc == CUDA_SUCCESS) {
        g_primary_ref[dev]++;
        *pctx = (CUcontext)&g_primary[dev];
    }
    pthread_mutex_unlock(&g_ctx_mu);
    return rc;
}

API CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev)
{
    CHECK_INIT();
    if (!dev_ok(dev))
        return CUDA_ERROR_INVALID_DEVICE;
    CUresult rc = CUDA_SUCCESS;
    pthread_mutex_lock(&g_ctx_mu);
    if (g_primary_ref[dev] == 0) {
        rc = CUDA_ERROR_INVALID_CONTEXT;
    } else if (--g_primary_ref[dev] == 0) {
        __atomic_store_n(&g_primary[dev].released, 1, __ATOMIC_RELEASE);
        acct_uncharge(dev, g_primary[dev].size);
        limits_release(&g_primary[dev]);    /* a retain after this starts from the defaults */
    }
    pthread_mutex_unlock(&g_ctx_mu);
    return rc;
}

static CUresult ctx_create(CUcontext *pctx, CUdevice dev)
{
    if (!pctx)
        return CUDA_ERROR_INVALID_VALUE;
    if (!dev_ok(dev))
        return CUDA_ERROR_INVALID_DEVICE;
    if (t_depth == CTX_STACK)
        return CUDA_ERROR_INVALID_VALUE;
    driver_thread_due();
    struct obj *o = calloc(1, sizeof *o);
    if (!o)
        return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult rc = acct_charge(dev, g_ctx_overhead);
    if (rc != CUDA_SUCCESS) {
        free(o);
        return rc;
    }
    o->key = (uintptr_t)o;
    o->kind = K_CTX;
    o->dev = dev;
    o->size = g_ctx_overhead;
    tab_lock();
    tab_insert(o);
    tab_unlock();
    t_stack[t_depth++] = (CUcontext)o; /* new context becomes current */
    *pctx = (CUcontext)o;
    return CUDA_SUCCESS;
}

API CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev)
{
    CHECK_INIT();
    (void)flags;
    return ctx_create(pctx, dev);
}

API CUresult cuCtxCreate_v3(CUcontext *pctx, CUexecAffinityParam *paramsArray,
                            int numParams, unsigned int flags, CUdevice dev)
{
    CHECK_INIT();
    (void)paramsArray;
    (void)numParams;
    (void)flags;
    return ctx_create(pctx, dev);
}

API CUresult cuCtxCreate_v4(CUcontext *pctx, CUctxCreateParams *ctxCreateParams,
                            unsigned int flags, CUdevice dev)
{
    CHECK_INIT();
    (void)ctxCreateParams;
    (void)flags;
    return ctx_create(pctx, dev);
}

API CUresult cuCtxDestroy_v2(CUcontext ctx)
{
    CHECK_INIT();
    if (!ctx || is_primary(ctx))
        return CUDA_ERROR_INVALID_CONTEXT;
    tab_lock();
    struct obj *o = tab_remove((uintptr_t)ctx, K_CTX);
    tab_unlock();
    if (!o)
        return CUDA_ERROR_INVALID_CONTEXT;
    __atomic_store_n(&o->released, 1, __ATOMIC_RELEASE);
    acct_uncharge(o->dev, o->size);
    pthread_mutex_lock(&g_ctx_mu);
    limits_release(o);
    pthread_mutex_unlock(&g_ctx_mu);
    /* The driver pops it from the calling thread's stack. */
    int j = 0;
    for (int i = 0; i < t_depth; i++)
        if (t_stack[i] != ctx)
            t_stack[j++] = t_stack[i];
    t_depth = j;
    return CUDA_SUCCESS;
}

API CUresult cuCtxSetCurrent(CUcontext ctx)
{
    CHECK_INIT();
    if (!ctx) { /* documented: NULL pops the top, if any */
        if (t_depth > 0)
            t_depth--;
        return CUDA_SUCCESS;
    }
    if (!ctx_valid(ctx))
        return CUDA_ERROR_INVALID_CONTEXT;
    if (t_depth == 0)
        t_depth = 1;
    t_stack[t_depth - 1] = ctx;
    return CUDA_SUCCESS;
}

API CUresult cuCtxGetCurrent(CUcontext *pctx)
{
    CHECK_INIT();
    if (!pctx)
        return CUDA_ERROR_INVALID_VALUE;
    *pctx = t_depth ? t_stack[t_depth - 1] : NULL;
    return CUDA_SUCCESS;
}

API CUresult cuCtxPushCurrent_v2(CUcontext ctx)
{
    CHECK_INIT();
    if (!ctx || !ctx_valid(ctx))
        return CUDA_ERROR_INVALID_CONTEXT;
    if (t_depth == CTX_STACK)
        return CUDA_ERROR_INVALID_VALUE;
    t_stack[t_depth++] = ctx;
    return CUDA_SUCCESS;
}

API CUresult cuCtxPopCurrent_v2(CUcontext *pctx)
{
    CHECK_INIT();
    if (t_depth == 0)
        return CUDA_ERROR_INVALID_CONTEXT;
    CUcontext c = t_stack[--t_depth];
    if (pctx)
        *pctx = c;
    return CUDA_SUCCESS;
}

API CUresult cuCtxGetDevice(CUdevice *device)
{
    CHECK_INIT();
    if (!device)
        return CUDA_ERROR_INVALID_VALUE;
    int dev;
    CUresult rc = cur_dev(&dev);
    if (rc == CUDA_SUCCESS)
        *device = dev;
    return rc;
}

API CUresult cuCtxSynchronize(void)
{
    CHECK_INIT();
    int dev;
    return cur_dev(&dev); /* nothing is ever in flight */
}

/* ---------------------------------------------------------------- errors */

static const struct {
    CUresult code;
    const char *text;
} g_errs[] = {
    {CUDA_SUCCESS, "no error"},
    {CUDA_ERROR_INVALID_VALUE, "invalid argument"},
    {CUDA_ERROR_OUT_OF_MEMORY, "out of memory"},
    {CUDA_ERROR_NOT_INITIALIZED, "initialization error"},
    {CUDA_ERROR_DEINITIALIZED, "driver shutting down"},
    {CUDA_ERROR_NO_DEVICE, "no CUDA-capable device is detected"},
    {CUDA_ERROR_INVALID_DEVICE, "invalid device ordinal"},
    {CUDA_ERROR_INVALID_CONTEXT, "invalid device context"},
    {CUDA_ERROR_INVALID_HANDLE, "invalid resource handle"},
    {CUDA_ERROR_ILLEGAL_STATE, "the operation cannot be performed in the present state"},
    {CUDA_ERROR_OPERATING_SYSTEM, "OS call failed or operation not supported on this OS"},
    {CUDA_ERROR_NOT_READY, "device not ready"},
    {CUDA_ERROR_NOT_FOUND, "named symbol not found"},
    {CUDA_ERROR_CONTEXT_IS_DESTROYED, "context is destroyed"},
    {CUDA_ERROR_NOT_SUPPORTED, "operation not supported"},
    {CUDA_ERROR_UNKNOWN, "unknown error"},
};

API CUresult cuGetErrorString(CUresult error, const char **pStr)
{
    CHECK_INIT_UNGATED();
    if (!pStr)
        return CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < sizeof g_errs / sizeof g_errs[0]; i++)
        if (g_errs[i].code == error) {
            *pStr = g_errs[i].text;
            return CUDA_SUCCESS;
        }
    *pStr = NULL;
    return CUDA_ERROR_INVALID_VALUE;
}

/* -------------------------------------------------------- cuGetProcAddress */

/* Look symbols up in this very library (it may have been dlopen'ed
 * RTLD_LOCAL, so RTLD_DEFAULT would not see it). */
static void *self_sym(const char *name)
{
    static void *self;
    if (!__atomic_load_n(&self, __ATOMIC_ACQUIRE)) {
        Dl_info info;
        void *h = NULL;
        if (dladdr((void *)cuInit, &info) && info.dli_fname)
            h = dlopen(info.dli_fname, RTLD_LAZY | RTLD_NOLOAD);
        if (!h)
            return NULL;
        __atomic_store_n(&self, h, __ATOMIC_RELEASE);
    }
    return dlsym(self, name);
}

static int build_name(char *out, size_t cap, const char *base, const char *suffix)
{
    size_t a = strlen(base), b = strlen(suffix);
    if (a + b + 1 > cap)
        return 0;
    memcpy(out, base, a);
    memcpy(out + a, suffix, b + 1);
    return 1;
}

API CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion,
                                 cuuint64_t flags, CUdriverProcAddressQueryResult *symbolStatus)
{
    CHECK_INIT();
    if (!symbol || !pfn)
        return CUDA_ERROR_INVALID_VALUE;
    /* Callers pass the base name ("cuMemAlloc"); map it to the ABI version we export. A few
     * names changed their signature between versions (cudaTypedefs.h's PFN_..._vNNNNN): the
     * caller's version picks the one it was built for. */
    static const struct {
        const char *base;
        int since;              /* from this cudaVersion on... */
        const char *suffix;     /* ...this one (the first that matches) */
    } versioned[] = {
        {"cuCtxCreate", 12050, "_v4"}, {"cuCtxCreate", 11040, "_v3"}, {"cuCtxCreate", 0, "_v2"},
        {"cuGraphInstantiate", 12000, "WithFlags"}, {"cuGraphInstantiate", 11000, "_v2"},
        {"cuGraphAddNode", 12030, "_v2"}, {"cuGraphAddNode", 0, ""},
    };
    const char *suffixes[5];
    int n = 0;
    for (size_t i = 0; i < sizeof versioned / sizeof versioned[0] && n == 0; i++)
        if (strcmp(symbol, versioned[i].base) == 0 && cudaVersion >= versioned[i].since)
            suffixes[n++] = versioned[i].suffix;
    if (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) {
        suffixes[n++] = "_v2_ptsz";     /* cuStreamBeginCapture_v2_ptsz */
        suffixes[n++] = "_ptsz";
    }
    suffixes[n++] = "_v2";
    suffixes[n++] = "";
    void *p = NULL;
    char name[128];
    for (int i = 0; i < n && !p; i++)
        if (build_name(name, sizeof name, symbol, suffixes[i]))
            p = self_sym(name);
    *pfn = p;
    if (symbolStatus)
        *symbolStatus = p ? CU_GET_PROC_ADDRESS_SUCCESS : CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    return p ? CUDA_SUCCESS : CUDA_ERROR_NOT_FOUND;
}
