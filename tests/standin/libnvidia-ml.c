/* Test-only stand-in for libnvidia-ml.so.1: the memory queries the preload shim wraps
 * (nvmlDeviceGetMemoryInfo, _v2) and what a caller needs to reach them (init, count, handle,
 * index), with the NVML ABI (nvml.h: handles are opaque pointers, nvmlReturn_t is an int).
 * Total = $CONVGPU_STANDIN_CAPACITY (default as the stand-in driver), all of it free.
 * Built into build/standin-nvml/, apart from the stand-in driver: the enforcer and the CLI
 * must not find it and take this host for a GPU host.
 *
 * It plays a node of $CONVGPU_STANDIN_GPUS GPUs (else $CONVGPU_STANDIN_DEVICES, as the stand-in
 * driver; default 1) in host order (NVML ignores CUDA_VISIBLE_DEVICES), with the stand-in
 * driver's UUIDs (si_uuid_text: cuDeviceGetUuid gives the same 16 bytes), names, minor numbers
 * ($CONVGPU_STANDIN_MINORS="3,5": GPU 0 is /dev/nvidia3's...; default the index; probes/gpumap.py),
 * no per-process lists (NOT_SUPPORTED; with CONVGPU_STANDIN_NVML_PROCS=1, the stand-in driver's
 * per-process slots in $CONVGPU_STANDIN_SHM, as NVML lists compute processes: a slot whose process
 * started with CONVGPU_STANDIN_GRAPHICS=1 in the graphics list instead; each GPU's used memory
 * then the slots' sum plus $CONVGPU_STANDIN_NVML_RESERVED; CONVGPU_STANDIN_NVML_DEAD=hide lists no
 * slot whose process is gone, so that memory kept alive past its process shows in the total
 * alone, as a driver that names no process for it would), MIG mode off,
 * and for the Kubernetes agent's tests
 * (tests/system/test_kube_health.py) faults read from the file $CONVGPU_STANDIN_NVML_FAULTS, one a line:
 *   lost I     GPU I answers NVML_ERROR_GPU_IS_LOST while the line is there
 *   mig I      GPU I has MIG mode on
 *   xid I C    an XID C event on GPU I, delivered once by nvmlEventSetWait */
#include <errno.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "standin_shm.h"

#define API __attribute__((visibility("default")))
#define NVML_SUCCESS 0
#define NVML_ERROR_INVALID_ARGUMENT 2
#define NVML_ERROR_NOT_FOUND 6
#define NVML_ERROR_INSUFFICIENT_SIZE 7
#define NVML_ERROR_NOT_SUPPORTED 3

typedef struct { unsigned long long total, free, used; } nvmlMemory_t;
typedef struct { unsigned int version; unsigned long long total, reserved, free, used; } nvmlMemory_v2_t;

#define NVML_ERROR_TIMEOUT 10
#define NVML_ERROR_GPU_IS_LOST 15
#define MAX_GPUS 16

static int devices[MAX_GPUS];   /* GPU i's handle is &devices[i] */

static unsigned int ngpus(void)
{
    const char *s = getenv("CONVGPU_STANDIN_GPUS");
    if (!s || !*s)
        s = getenv("CONVGPU_STANDIN_DEVICES");
    unsigned long n = s && *s ? strtoul(s, NULL, 0) : 1;
    return n < 1 ? 1 : n > MAX_GPUS ? MAX_GPUS : (unsigned int)n;
}

static int gpu_of(void *device)
{
    long i = (int *)device - devices;
    return device && i >= 0 && i < (long)ngpus() ? (int)i : -1;
}

/* Is the line "<what> <i>" (or, for xid, "<what> <i> <code>") in the faults file? For xid, the
 * n-th xid line (0-based) with its GPU and code. */
static int fault(const char *what, int gpu, int nth, int *xgpu, unsigned long long *code)
{
    const char *path = getenv("CONVGPU_STANDIN_NVML_FAULTS");
    char line[128], word[16];
    int found = 0, seen = 0;
    FILE *f = path && *path ? fopen(path, "r") : NULL;
    if (!f)
        return 0;
    while (!found && fgets(line, sizeof line, f)) {
        int i;
        unsigned long long c = 0;
        if (sscanf(line, "%15s %d %llu", word, &i, &c) < 2 || strcmp(word, what))
            continue;
        if (nth < 0)
            found = i == gpu;
        else if (seen++ == nth) {
            *xgpu = i;
            *code = c;
            found = 1;
        }
    }
    fclose(f);
    return found;
}

static int check(void *device)
{
    int i = gpu_of(device);
    if (i < 0)
        return NVML_ERROR_INVALID_ARGUMENT;
    return fault("lost", i, -1, NULL, NULL) ? NVML_ERROR_GPU_IS_LOST : NVML_SUCCESS;
}

static int put(char *buf, unsigned int len, const char *s)
{
    if (!buf || strlen(s) + 1 > len)
        return NVML_ERROR_INVALID_ARGUMENT;
    memcpy(buf, s, strlen(s) + 1);
    return NVML_SUCCESS;
}

static unsigned long long capacity(void)
{
    const char *s = getenv("CONVGPU_STANDIN_CAPACITY");
    return s && *s ? strtoull(s, NULL, 0) : SI_DEFAULT_CAPACITY;
}

API int nvmlInit_v2(void) { return NVML_SUCCESS; }
API int nvmlInitWithFlags(unsigned int flags) { (void)flags; return NVML_SUCCESS; }
API int nvmlShutdown(void) { return NVML_SUCCESS; }
API const char *nvmlErrorString(int result) { return result ? "stand-in error" : "Success"; }

API int nvmlDeviceGetCount_v2(unsigned int *count)
{
    if (!count)
        return NVML_ERROR_INVALID_ARGUMENT;
    *count = ngpus();
    return NVML_SUCCESS;
}

API int nvmlDeviceGetHandleByIndex_v2(unsigned int index, void **device)
{
    if (!device)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (index >= ngpus())
        return NVML_ERROR_NOT_FOUND;
    *device = &devices[index];
    return NVML_SUCCESS;
}

API int nvmlDeviceGetIndex(void *device, unsigned int *index)
{
    if (gpu_of(device) < 0 || !index)
        return NVML_ERROR_INVALID_ARGUMENT;
    *index = gpu_of(device);
    return NVML_SUCCESS;
}

static int procs_on(void)
{
    const char *on = getenv("CONVGPU_STANDIN_NVML_PROCS");
    return on && strcmp(on, "1") == 0;
}

static uint64_t used_on(int gpu);

API int nvmlDeviceGetMemoryInfo(void *device, nvmlMemory_t *m)
{
    if (gpu_of(device) < 0 || !m)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (check(device))
        return check(device);
    m->total = capacity();
    m->used = procs_on() ? used_on(gpu_of(device)) : 0;
    m->free = m->total > m->used ? m->total - m->used : 0;
    return NVML_SUCCESS;
}

API int nvmlDeviceGetMemoryInfo_v2(void *device, nvmlMemory_v2_t *m)
{
    if (gpu_of(device) < 0 || !m)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (check(device))
        return check(device);
    m->total = capacity();
    m->reserved = 0;
    m->used = procs_on() ? used_on(gpu_of(device)) : 0;
    m->free = m->total > m->used ? m->total - m->used : 0;
    return NVML_SUCCESS;
}

/* --- a node of several GPUs, its faults and XID events (the Kubernetes agent's tests) --- */
API int nvmlSystemGetDriverVersion(char *buf, unsigned int len) { return put(buf, len, "580.0-standin"); }

API int nvmlDeviceGetUUID(void *device, char *buf, unsigned int len)
{
    char uuid[41];
    if (check(device))
        return check(device);
    si_uuid_text(gpu_of(device), uuid);
    return put(buf, len, uuid);
}

API int nvmlDeviceGetName(void *device, char *buf, unsigned int len)
{
    return check(device) ? check(device) : put(buf, len, "Stand-in GPU");
}

/* nvmlDeviceArchitecture_t: 9 is NVML_DEVICE_ARCH_HOPPER, as on the H100 and H200 */
API int nvmlDeviceGetArchitecture(void *device, unsigned int *arch)
{
    if (check(device) || !arch)
        return check(device) ? check(device) : NVML_ERROR_INVALID_ARGUMENT;
    *arch = 9;
    return NVML_SUCCESS;
}

API int nvmlDeviceGetMinorNumber(void *device, unsigned int *minor)
{
    if (check(device) || !minor)
        return check(device) ? check(device) : NVML_ERROR_INVALID_ARGUMENT;
    const char *s = getenv("CONVGPU_STANDIN_MINORS");
    *minor = gpu_of(device);
    for (int k = 0; s && *s; k++) {     /* the i-th number of "3,5,..." */
        char *end;
        unsigned long v = strtoul(s, &end, 10);
        if (end == s)
            break;
        if (k == gpu_of(device)) {
            *minor = (unsigned)v;
            break;
        }
        s = *end == ',' ? end + 1 : end;
    }
    return NVML_SUCCESS;
}

/* nvml.h's nvmlProcessInfo_t (v2 and v3 alike) */
typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId, computeInstanceId;
} nvmlProcessInfo_t;

static struct si_handle shm = {-1, NULL};

/* The slot's process still runs (the same one: its start time), for CONVGPU_STANDIN_NVML_DEAD=hide. */
static int slot_alive(const struct si_slot *sl)
{
    char path[64], buf[1024];
    if (kill(sl->pid, 0) != 0 && errno == ESRCH)
        return 0;
    snprintf(path, sizeof path, "/proc/%d/stat", (int)sl->pid);
    FILE *f = fopen(path, "r");
    if (!f)
        return 0;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    char *p = strrchr(buf, ')');
    for (int field = 2; p && *p && field < 22; p++)
        if (*p == ' ')
            field++;
    return p && strtoull(p, NULL, 10) == sl->start_time;
}

/* The segment for a read: 1 locked (dead slots reaped first, so a killed process is gone at
 * once), 0 not locked, -1 no segment. A process stopped inside the stand-in driver's critical
 * section (SIGSTOP: an enforcer's or its watchdog's hold of a whole process; a frozen cgroup)
 * keeps the lock for as long as it is stopped. The real NVML asks the kernel and never waits
 * on a tenant: waiting here stalled a restarted enforcer's start for the whole --handover
 * (its watchdog then resumed the held calls unchecked). So past NVML_LOCK_MS the figures are
 * read as they stand: aligned words, never torn; a dead slot is then reaped at a later read. */
#define NVML_LOCK_MS 50
static int seg_for_read(void)
{
    if (!shm.seg && si_open(&shm, 0) != 0)
        return -1;
    if (si_lock_within(&shm, NVML_LOCK_MS) != 0)
        return 0;
    si_reap(&shm, -1);
    return 1;
}

/* Each live slot's bytes on host GPU `gpu` (reaped first, so a killed process is gone at once),
 * of the graphics or compute kind (si_slot.pad: SI_GRAPHICS): slots with none there are not
 * listed. */
static unsigned int slot_processes(int gpu, int graphics, nvmlProcessInfo_t *out, unsigned int cap)
{
    unsigned int n = 0;
    const char *dead = getenv("CONVGPU_STANDIN_NVML_DEAD");
    int hide = dead && strcmp(dead, "hide") == 0;
    int locked = seg_for_read();
    if (locked < 0)
        return 0;   /* no stand-in process yet: none */
    for (uint32_t i = 0; i < shm.seg->slot_hiwater && i < SI_NSLOTS; i++) {
        const struct si_slot *sl = &shm.seg->slots[i];
        if (sl->pid <= 0 || !sl->used[gpu] || !!(sl->pad & SI_GRAPHICS) != graphics || (hide && !slot_alive(sl)))
            continue;
        if (out && n < cap)
            out[n] = (nvmlProcessInfo_t){(unsigned)sl->pid, sl->used[gpu], 0xFFFFFFFF, 0xFFFFFFFF};
        n++;
    }
    if (locked)
        si_unlock(&shm);
    return n;
}

/* What the GPU has in use: every slot's bytes (listed or not) and the driver's own reserve. */
static uint64_t used_on(int gpu)
{
    const char *r = getenv("CONVGPU_STANDIN_NVML_RESERVED");
    uint64_t used = r && *r ? strtoull(r, NULL, 0) : 0;
    int locked = seg_for_read();
    if (locked < 0)
        return used;
    used += __atomic_load_n(&shm.seg->used[gpu], __ATOMIC_RELAXED);
    if (locked)
        si_unlock(&shm);
    return used;
}

static int running_processes(void *device, int graphics, unsigned int *n, void *infos)
{
    if (!procs_on())
        return NVML_ERROR_NOT_SUPPORTED;    /* as where NVML has no per-process figures (vGPU) */
    if (check(device) || !n)
        return check(device) ? check(device) : NVML_ERROR_INVALID_ARGUMENT;
    unsigned int cap = infos ? *n : 0, got = slot_processes(gpu_of(device), graphics, infos, cap);
    *n = got;
    return got > cap ? NVML_ERROR_INSUFFICIENT_SIZE : NVML_SUCCESS;
}

API int nvmlDeviceGetComputeRunningProcesses_v3(void *device, unsigned int *n, void *infos)
{
    return running_processes(device, 0, n, infos);
}

API int nvmlDeviceGetGraphicsRunningProcesses_v3(void *device, unsigned int *n, void *infos)
{
    return running_processes(device, 1, n, infos);
}

API int nvmlDeviceGetMigMode(void *device, unsigned int *current, unsigned int *pending)
{
    if (check(device) || !current || !pending)
        return check(device) ? check(device) : NVML_ERROR_INVALID_ARGUMENT;
    *current = *pending = fault("mig", gpu_of(device), -1, NULL, NULL);
    return NVML_SUCCESS;
}

typedef struct {
    void *device;
    unsigned long long eventType, eventData;
    unsigned int gpuInstanceId, computeInstanceId;
} nvmlEventData_t;

static int event_set;    /* the one event set's handle is &event_set */
static int xids_given;   /* xid lines of the faults file delivered so far */

API int nvmlEventSetCreate(void **set)
{
    if (!set)
        return NVML_ERROR_INVALID_ARGUMENT;
    *set = &event_set;
    return NVML_SUCCESS;
}

API int nvmlEventSetFree(void *set) { (void)set; return NVML_SUCCESS; }

API int nvmlDeviceGetSupportedEventTypes(void *device, unsigned long long *types)
{
    if (check(device) || !types)
        return check(device) ? check(device) : NVML_ERROR_INVALID_ARGUMENT;
    *types = 0x8 | 0x4;   /* XidCriticalError, DoubleBitEccError */
    return NVML_SUCCESS;
}

API int nvmlDeviceRegisterEvents(void *device, unsigned long long types, void *set)
{
    (void)types;
    return set != &event_set ? NVML_ERROR_INVALID_ARGUMENT : check(device);
}

API int nvmlEventSetWait_v2(void *set, nvmlEventData_t *data, unsigned int timeout_ms)
{
    struct timespec tick = {0, 10 * 1000 * 1000};
    if (set != &event_set || !data)
        return NVML_ERROR_INVALID_ARGUMENT;
    for (unsigned int waited = 0;; waited += 10) {
        int gpu;
        unsigned long long code;
        if (fault("xid", 0, xids_given, &gpu, &code) && gpu >= 0 && gpu < (int)ngpus()) {
            xids_given++;
            memset(data, 0, sizeof *data);
            data->device = &devices[gpu];
            data->eventType = 0x8;
            data->eventData = code;
            data->gpuInstanceId = data->computeInstanceId = 0xFFFFFFFF;
            return NVML_SUCCESS;
        }
        if (waited >= timeout_ms)
            return NVML_ERROR_TIMEOUT;
        nanosleep(&tick, NULL);
    }
}

API int nvmlEventSetWait(void *set, nvmlEventData_t *data, unsigned int timeout_ms)
{
    return nvmlEventSetWait_v2(set, data, timeout_ms);
}
