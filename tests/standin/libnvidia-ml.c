/* Test-only stand-in for libnvidia-ml.so.1: the memory queries the preload shim wraps
 * (nvmlDeviceGetMemoryInfo, _v2) and what a caller needs to reach them (init, count, handle,
 * index), plus what convgpu reads of a GPU (driver version, name, UUID, minor number), with
 * the NVML ABI (nvml.h: handles are opaque pointers, nvmlReturn_t is an int).
 * GPUs: $CONVGPU_STANDIN_DEVICES (default 1), in host order (NVML ignores CUDA_VISIBLE_DEVICES),
 * UUIDs as the stand-in driver's; minor numbers $CONVGPU_STANDIN_MINORS ("3,5": GPU 0 is
 * /dev/nvidia3's minor...; default the index). No per-process lists (NOT_SUPPORTED).
 * Total = $CONVGPU_STANDIN_CAPACITY (default as the stand-in driver), all of it free.
 * Built into build/standin-nvml/, apart from the stand-in driver: the enforcer and the CLI
 * must not find it and take this host for a GPU host. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "standin_shm.h"

#define API __attribute__((visibility("default")))
#define NVML_SUCCESS 0
#define NVML_ERROR_INVALID_ARGUMENT 2
#define NVML_ERROR_NOT_SUPPORTED 3
#define NVML_ERROR_INSUFFICIENT_SIZE 7
#define NVML_ERROR_NOT_FOUND 6

typedef struct { unsigned long long total, free, used; } nvmlMemory_t;
typedef struct { unsigned int version; unsigned long long total, reserved, free, used; } nvmlMemory_v2_t;

static int devices[SI_MAX_DEV];   /* GPU i's handle is &devices[i] */

static unsigned count(void)
{
    const char *s = getenv("CONVGPU_STANDIN_DEVICES");
    unsigned long n = s && *s ? strtoul(s, NULL, 0) : 1;
    return n > SI_MAX_DEV ? SI_MAX_DEV : (unsigned)n;
}

static int index_of(void *device)   /* -1: not one of ours */
{
    long i = (int *)device - devices;
    return device && i >= 0 && i < (long)count() ? (int)i : -1;
}

static int copy_text(char *out, unsigned len, const char *text)
{
    if (!out || strlen(text) + 1 > len)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(out, text, strlen(text) + 1);
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

API int nvmlDeviceGetCount_v2(unsigned int *n)
{
    if (!n)
        return NVML_ERROR_INVALID_ARGUMENT;
    *n = count();
    return NVML_SUCCESS;
}

API int nvmlDeviceGetHandleByIndex_v2(unsigned int index, void **device)
{
    if (!device)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (index >= count())
        return NVML_ERROR_NOT_FOUND;
    *device = &devices[index];
    return NVML_SUCCESS;
}

API int nvmlDeviceGetIndex(void *device, unsigned int *index)
{
    if (index_of(device) < 0 || !index)
        return NVML_ERROR_INVALID_ARGUMENT;
    *index = (unsigned)index_of(device);
    return NVML_SUCCESS;
}

API int nvmlDeviceGetMemoryInfo(void *device, nvmlMemory_t *m)
{
    if (index_of(device) < 0 || !m)
        return NVML_ERROR_INVALID_ARGUMENT;
    m->total = m->free = capacity();
    m->used = 0;
    return NVML_SUCCESS;
}

API int nvmlDeviceGetMemoryInfo_v2(void *device, nvmlMemory_v2_t *m)
{
    if (index_of(device) < 0 || !m)
        return NVML_ERROR_INVALID_ARGUMENT;
    m->total = m->free = capacity();
    m->reserved = m->used = 0;
    return NVML_SUCCESS;
}

API int nvmlSystemGetDriverVersion(char *version, unsigned int len)
{
    return copy_text(version, len, "580.0.0-standin");
}

API int nvmlDeviceGetName(void *device, char *name, unsigned int len)
{
    return index_of(device) < 0 ? NVML_ERROR_INVALID_ARGUMENT : copy_text(name, len, "convgpu stand-in GPU");
}

API int nvmlDeviceGetUUID(void *device, char *uuid, unsigned int len)
{
    int i = index_of(device);
    if (i < 0)
        return NVML_ERROR_INVALID_ARGUMENT;
    char t[41];
    si_uuid_text(i, t);
    return copy_text(uuid, len, t);
}

API int nvmlDeviceGetMinorNumber(void *device, unsigned int *minor)
{
    int i = index_of(device);
    if (i < 0 || !minor)
        return NVML_ERROR_INVALID_ARGUMENT;
    const char *s = getenv("CONVGPU_STANDIN_MINORS");
    *minor = (unsigned)i;
    for (int k = 0; s && *s; k++) {     /* the i-th number of "3,5,..." */
        char *end;
        unsigned long v = strtoul(s, &end, 10);
        if (end == s)
            break;
        if (k == i) {
            *minor = (unsigned)v;
            break;
        }
        s = *end == ',' ? end + 1 : end;
    }
    return NVML_SUCCESS;
}

API int nvmlDeviceGetComputeRunningProcesses_v3(void *device, unsigned int *n, void *infos)
{
    (void)device, (void)n, (void)infos;
    return NVML_ERROR_NOT_SUPPORTED;
}
