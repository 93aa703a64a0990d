/*
 * standin_shm.h - cross-process "device memory" accounting for the stand-in
 * CUDA driver (libcuda.c) and the standin-usage reader.
 *
 * Why shared memory: two "containers" (processes) using the stand-in must
 * run out of the same simulated GPU together, as they would on real hardware.
 *
 * Why per-process slots instead of one counter: a SIGKILLed process cannot
 * give its share back (no atexit).  Each process owns a slot that holds its
 * per-device usage, and keeps an OFD write lock (fcntl F_OFD_SETLK) on byte
 * <slot index> of the shm file.  The kernel drops that lock when the process
 * dies (before it becomes a zombie, so waitpid() has returned by then), so a
 * slot whose lock is free belongs to a dead process and is cleared ("reaped").
 * Every charge, uncharge and read reaps first, so `used` is exact even right
 * after a SIGKILL, with no pid-reuse race.
 *
 * Layout (x86_64, little endian; all integers naturally aligned), also
 * documented in README.md for readers that are not C:
 *   off   0 u32 magic (0x49534743 "CGSI")      off   4 u32 version (3)
 *   off   8 u32 max_devices (16)               off  12 u32 nslots (1024)
 *   off  16 u32 init_done (1 when usable)      off  20 u32 slot_hiwater
 *   off  24 u64 capacity_hint (last cuInit's CONVGPU_STANDIN_CAPACITY)
 *   off  32 u64 used[16]  exact sum as of the last charge/uncharge/reap
 *   off 160 u64 peak[16]  highest used[] seen right after a charge
 *   off 288 pthread_mutex_t (robust, process-shared), padded to 64 bytes
 *   off 352 slot[1024], 144 bytes each:
 *           i32 pid (0 = free), u32 flags (SI_GRAPHICS), u64 start_time (clock ticks since
 *           boot, /proc/pid/stat field 22), u64 used[16]
 *   then    at_peak[1024], the same slots as they were when a peak[] last
 *           rose: who held what at the peak (a test that finds the peak too
 *           high can say which processes made it)
 *   off 295264 cp[1024], 160 bytes each: slot i's checkpoint mailbox (libcuda_cp.c), cleared
 *           with its slot:
 *           u32 req (futex: seq << 4 | SI_CP_TAKEN | op, posted by a checkpointing process)
 *           u32 ack (futex: seq of the last request the slot's process answered)
 *           i32 result (its CUresult)   u32 state (CUprocessState, as the process set it)
 *           i32 tid (the process's stand-in driver thread)   u32 arg (a lock's timeout, ms)
 *           u64 pad   u64 saved[16] (bytes it had on each host GPU when checkpointed)
 */
#ifndef CONVGPU_STANDIN_SHM_H
#define CONVGPU_STANDIN_SHM_H

#include <pthread.h>
#include <stdint.h>

#define SI_MAX_DEV 16
#define SI_NSLOTS 1024
#define SI_MAGIC 0x49534743u
#define SI_VERSION 3u
/* Named after SI_VERSION (keep the two in step): a segment an older build left in /dev/shm
 * is then never opened, where it would fail the version check. */
#define SI_DEFAULT_NAME "/convgpu-standin-v3"
#define SI_DEFAULT_CAPACITY 85899345920ull /* 80 GiB */

#define SI_GRAPHICS 1u /* si_slot.pad: a graphics client (CONVGPU_STANDIN_GRAPHICS=1 at cuInit) */

struct si_slot {
    int32_t pid;
    uint32_t pad; /* flags: SI_GRAPHICS */
    uint64_t start_time;
    uint64_t used[SI_MAX_DEV];
};

/* A checkpoint request (libcuda_cp.c): the op in req's low bits. */
enum { SI_CP_NONE = 0, SI_CP_LOCK, SI_CP_CHECKPOINT, SI_CP_RESTORE, SI_CP_UNLOCK };
#define SI_CP_OP 7u
#define SI_CP_TAKEN 8u  /* the target's driver thread has taken it: no longer cancellable */

struct si_cp {
    uint32_t req;
    uint32_t ack;
    int32_t result;
    uint32_t state;
    int32_t tid;
    uint32_t arg;
    uint64_t pad;
    uint64_t saved[SI_MAX_DEV];
};

struct si_seg {
    uint32_t magic;
    uint32_t version;
    uint32_t max_devices;
    uint32_t nslots;
    uint32_t init_done;
    uint32_t slot_hiwater; /* slots >= this index were never used */
    uint64_t capacity_hint;
    uint64_t used[SI_MAX_DEV];
    uint64_t peak[SI_MAX_DEV];
    union {
        pthread_mutex_t m;
        char pad[64];
    } lock;
    struct si_slot slots[SI_NSLOTS];
    struct si_slot at_peak[SI_NSLOTS];
    struct si_cp cp[SI_NSLOTS];
};

struct si_handle {
    int fd;
    struct si_seg *seg;
};

/* Segment name from CONVGPU_STANDIN_SHM, else SI_DEFAULT_NAME. */
const char *si_name(void);
/* Map (creating if `create`) the segment.  0 on success, -1 if absent,
 * -2 on any other failure (incompatible version, mmap...). */
int si_open(struct si_handle *h, int create);
/* Process-shared lock; recovers from a holder that died. 0 = locked. */
int si_lock(struct si_handle *h);
/* si_lock for at most `ms` milliseconds: 0 = locked, ETIMEDOUT = not (a holder is stopped:
 * SIGSTOP, a frozen cgroup, a ptrace stop; it may stay so for as long as it is held). */
int si_lock_within(struct si_handle *h, int ms);
void si_unlock(struct si_handle *h);
/* Under the lock: clear slots of dead processes (skipping `self`, whose
 * lock the caller's own fd cannot see), then refresh seg->used[]. */
void si_reap(struct si_handle *h, int self);
/* Under the lock: take a free slot for this process.  Returns its index or
 * -1 if the table is full. */
int si_register(struct si_handle *h);
/* Under the lock: give slot `idx` back (normal exit). */
void si_unregister(struct si_handle *h, int idx);

/* Host GPU h's UUID, the same 16 bytes in the stand-in driver (cuDeviceGetUuid) and the
 * stand-in NVML (nvmlDeviceGetUUID's text): GPU-5ca1ab1e-0000-4000-8000-0000000000HH. */
static inline void si_uuid(int h, unsigned char out[16])
{
    static const unsigned char base[16] = {0x5c, 0xa1, 0xab, 0x1e, 0, 0, 0x40, 0, 0x80, 0, 0, 0, 0, 0, 0, 0};
    for (int i = 0; i < 16; i++)
        out[i] = base[i];
    out[15] = (unsigned char)h;
}

static inline void si_uuid_text(int h, char out[41])
{
    static const char hex[] = "0123456789abcdef";
    unsigned char u[16];
    si_uuid(h, u);
    int n = 0;
    out[n++] = 'G', out[n++] = 'P', out[n++] = 'U', out[n++] = '-';
    for (int i = 0; i < 16; i++) {
        if (i == 4 || i == 6 || i == 8 || i == 10)
            out[n++] = '-';
        out[n++] = hex[u[i] >> 4];
        out[n++] = hex[u[i] & 15];
    }
    out[n] = 0;
}

#endif
