/*
 * libcuda_int.h - internals shared by libcuda.c (init, devices, contexts,
 * accounting, object table) and libcuda_mem.c (allocation APIs).
 *
 * The library is built with -fvisibility=hidden; only functions marked API
 * are exported, so the exported set is exactly the driver names we emulate.
 */
#ifndef CONVGPU_LIBCUDA_INT_H
#define CONVGPU_LIBCUDA_INT_H

#include <stddef.h>
#include <stdint.h>

#include "cuda_min.h"
#include "standin_shm.h"

#define API __attribute__((visibility("default")))

/* The real driver's entry points (580.159.04) all begin `push %rbp; mov %rsp,%rbp; push %r12`:
 * the enforcer's recheck probe sits on that push %r12, which the kernel emulates (a probe on
 * the mov is single-stepped, ~10x slower: FACTS.md). A clobber of r12 anywhere in a function
 * makes gcc -O0 save it right after the frame set-up, so the stand-in's prologue is the same
 * (`make check-prologue` verifies). Every exported function uses it (CHECK_INIT does). */
#define SAVES_R12() __asm__ volatile("" ::: "r12")

/* Like the real driver, nothing works before cuInit(0).  This check comes
 * first in every API so a pre-init call has no side effects at all. */
extern int g_inited;
#define CHECK_INIT_UNGATED()                                          \
    do {                                                              \
        SAVES_R12();                                                  \
        if (!__atomic_load_n(&g_inited, __ATOMIC_ACQUIRE))            \
            return CUDA_ERROR_NOT_INITIALIZED;                        \
    } while (0)

/* libcuda_cp.c: the gate of a locked process (cuCheckpointProcessLock). Every exported call
 * but the checkpoint calls, cuGetErrorString and cuDriverGetVersion passes it: it waits there
 * while the process is locked, checkpointed or beyond saving, and counts as in flight from
 * then to its return (the cleanup variable leaves at every return), which a lock waits for.
 * A call made from inside another (a signal handler's) passes straight through. */
int gate_enter(void);
void gate_leave(int *entered);
#define CHECK_INIT()                                                  \
    CHECK_INIT_UNGATED();                                             \
    int cp_gate_ __attribute__((cleanup(gate_leave), unused)) = gate_enter()

extern int g_ndev;          /* GPUs this process sees: CONVGPU_STANDIN_DEVICES, CUDA_VISIBLE_DEVICES */
extern int g_host[];        /* its ordinal -> host GPU */
/* visible.c: CUDA_VISIBLE_DEVICES and CUDA_DEVICE_ORDER as the driver reads them at cuInit */
int standin_visible(int nhost, int *host);
void standin_uuid(int host, unsigned char out[16]);
void standin_open_nodes(const int *host, int n);
extern uint64_t g_capacity; /* CONVGPU_STANDIN_CAPACITY, per device */
extern uint64_t g_alloc_ms; /* CONVGPU_STANDIN_ALLOC_MS: how long cuMemAlloc_v2 runs before it allocates */
extern uint64_t g_free_ms;  /* CONVGPU_STANDIN_FREE_MS: how long cuMemFree_v2 keeps the bytes */
extern uint64_t g_free_return_ms;   /* CONVGPU_STANDIN_FREE_RETURN_MS: how long it runs on after */
extern uint64_t g_resident_threads; /* CONVGPU_STANDIN_RESIDENT_THREADS: what a stack byte is multiplied by */
extern int g_graph_at_instantiate;  /* CONVGPU_STANDIN_GRAPH_AT=instantiate: graph memory taken there */
extern int g_backed;                /* CONVGPU_STANDIN_BACKED=1: device memory is readable host memory */

#define VMM_GRANULARITY (2ull << 20)

/* Capacity accounting in the shared segment (exact across processes). */
CUresult acct_charge(int ordinal, uint64_t bytes); /* OOM if over capacity; counted on its host GPU */
void acct_uncharge(int ordinal, uint64_t bytes);
uint64_t acct_used(int ordinal);
/* The checkpoint (libcuda_cp.c): everything this process's slot holds, per host GPU, taken out
 * of the shared capacity into saved[] / put back if it all fits (else OOM, nothing changed). */
CUresult acct_take_all(uint64_t saved[SI_MAX_DEV]);
CUresult acct_give_back(const uint64_t saved[SI_MAX_DEV]);
/* The shared segment and this process's slot in it (-1: none yet), for libcuda_cp.c. */
struct si_handle *acct_shm(void);
int acct_slot(void);
/* libcuda_cp.c: this process's driver thread, which serves its slot's mailbox, starts once
 * per process, under the segment's lock, when both have come: the slot (cp_slot_taken, at
 * cuInit; a forked child's at its first charge) and, by default, a context (cp_context,
 * with CONVGPU_STANDIN_CP_THREAD=context; =init: at the slot; =off: never). A forked child
 * starts anew (nothing locked, no thread until it has a slot). */
void cp_init(void);
void cp_slot_taken(int slot);
int cp_context(void);  /* 1: this process wants its driver thread now */
void cp_atfork_child(void);
void cp_exiting(void);
/* libcuda.c: the driver thread started if it is due (a context was made) */
void driver_thread_due(void);
/* libcuda_cp.c: futex(2) on a word of the shared segment (not private: the processes share it) */
struct timespec;
long cp_futex(uint32_t *word, int op, uint32_t val, const struct timespec *rel);
/* libcuda.c: a number from the environment (strtoull base 0), else dflt */
uint64_t env_u64(const char *name, uint64_t dflt);

/* Device of the calling thread's current context. */
CUresult cur_dev(int *dev);

/* Bytes a linear allocation of `bytes` takes (whole 2 MiB pages above 1 MiB). */
uint64_t footprint(uint64_t bytes);

/* Host-side table of live objects, keyed by address (device pointer,
 * reservation base, mapping start, or the object's own address for
 * handles/arrays).  All access under tab_lock(). */
enum obj_kind {
    K_MEM = 1, K_RESERVE, K_MAP, K_HANDLE, K_ARRAY, K_MIPMAP, K_CTX,
    K_STREAM, K_GRAPH, K_GEXEC, K_GALLOC, K_MODULE, K_LIBRARY /* libcuda_graph.c, libcuda_module.c */
};

struct obj {
    uintptr_t key;
    int kind;
    int dev;
    uint64_t size;       /* bytes charged (K_RESERVE/K_MAP: range length) */
    struct obj *next;    /* hash chain */
    /* K_HANDLE: */
    long mapcount;
    int released;
    /* K_MAP: the physical handle it maps; K_RESERVE: next reservation. */
    struct obj *link;
    /* K_CTX: cuCtxSetLimit's stack, printf FIFO and heap values, those with bit l of
     * limit_set set (else the default), under ctx_lock() */
    uint64_t limit[3];
    unsigned limit_set;
    /* K_MEM, K_MAP, K_HANDLE: the list of memory objects (tab lock), for copies' bounds and
     * the checkpoint */
    struct obj *mprev, *mnext;
    /* backed mode: K_HANDLE's memfd (-1: none); K_MEM, K_HANDLE: the contents while
     * checkpointed */
    int memfd;
    void *aside;
};

void tab_lock(void);
void tab_unlock(void);
struct obj *tab_find(uintptr_t key, int kind);
void tab_insert(struct obj *o);
struct obj *tab_remove(uintptr_t key, int kind);
/* Under tab_lock(): the memory objects (K_MEM, K_MAP, K_HANDLE), newest first. */
struct obj *tab_mems(void);
/* Under tab_lock(): the K_MEM or K_MAP object that holds all of [addr, addr+n), or NULL. */
struct obj *tab_span(uintptr_t addr, uint64_t n);

/* libcuda_mem.c: an object of its own address that holds `bytes` of device `dev` (an ordinal)
 * until obj_release (arrays, modules, libraries). */
CUresult obj_charge(int kind, int dev, uint64_t bytes, uintptr_t *out);
CUresult obj_release(uintptr_t key, int kind);

/* Contexts (libcuda.c). ctx_lock() guards the primary contexts' retain counts and every
 * context's limits. */
void ctx_lock(void);
void ctx_unlock(void);
/* The calling thread's current context, or NULL and *rc = why (none, destroyed). */
struct obj *cur_ctx(CUresult *rc);
/* libcuda_limits.c: give back what a context's limits took (under ctx_lock: it is being
 * destroyed, or the primary context's last retain was released). */
void limits_release(struct obj *ctx);

/* libcuda_graph.c: stream capture and graph memory, for libcuda_mem.c's calls. */
/* A stream-ordered allocation on a capturing stream becomes an alloc node of the capture's
 * graph (*captured = 1): a fresh address, no memory. */
CUresult capture_alloc(CUstream s, CUdeviceptr *dptr, uint64_t bytes, int dev, int *captured);
CUresult capture_free(CUstream s, CUdeviceptr dptr, int *captured);
/* cuMemFree_v2 / cuMemFreeAsync of a graph allocation: 1 if it was live (now freed: its
 * bytes stay reserved in the graph pool), 0 if addr is none of them. */
int graph_mem_free(uintptr_t addr);
/* Is [addr, addr+n) the start of a live graph allocation? (cuMemsetD8_v2) */
int graph_mem_live(uintptr_t addr, uint64_t n);

#endif
