/* Test-only stand-in for libnvidia-ml.so.1: the memory queries the preload shim wraps
 * (nvmlDeviceGetMemoryInfo, _v2) and what a caller needs to reach them (init, count, handle,
 * index), with the NVML ABI (nvml.h: handles are opaque pointers, nvmlReturn_t is an int).
 * Total = $CONVGPU_STANDIN_CAPACITY (default as the stand-in driver), all of it free.
 * Built into build/standin-nvml/, apart from the stand-in driver: the enforcer and the CLI
 * must not find it and take this host for a GPU host. */
#include <stdint.h>
#include <stdlib.h>

#include "standin_shm.h"

#define API __attribute__((visibility("default")))
#define NVML_SUCCESS 0
#define NVML_ERROR_INVALID_ARGUMENT 2
#define NVML_ERROR_NOT_FOUND 6

typedef struct { unsigned long long total, free, used; } nvmlMemory_t;
typedef struct { unsigned int version; unsigned long long total, reserved, free, used; } nvmlMemory_v2_t;

static int devices[1];   /* one GPU: its handle is &devices[0] */

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
    *count = 1;
    return NVML_SUCCESS;
}

API int nvmlDeviceGetHandleByIndex_v2(unsigned int index, void **device)
{
    if (!device)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (index != 0)
        return NVML_ERROR_NOT_FOUND;
    *device = &devices[0];
    return NVML_SUCCESS;
}

API int nvmlDeviceGetIndex(void *device, unsigned int *index)
{
    if (device != &devices[0] || !index)
        return NVML_ERROR_INVALID_ARGUMENT;
    *index = 0;
    return NVML_SUCCESS;
}

API int nvmlDeviceGetMemoryInfo(void *device, nvmlMemory_t *m)
{
    if (device != &devices[0] || !m)
        return NVML_ERROR_INVALID_ARGUMENT;
    m->total = m->free = capacity();
    m->used = 0;
    return NVML_SUCCESS;
}

API int nvmlDeviceGetMemoryInfo_v2(void *device, nvmlMemory_v2_t *m)
{
    if (device != &devices[0] || !m)
        return NVML_ERROR_INVALID_ARGUMENT;
    m->total = m->free = capacity();
    m->reserved = m->used = 0;
    return NVML_SUCCESS;
}
