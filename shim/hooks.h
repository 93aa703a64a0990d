/* The one hook list of libconvgpu.so. X(kind, name, params, args):
 *   ALLOC: takes device memory: ask the enforcer first (size_expr below), report on success;
 *   FREE:  gives memory back: report after success;
 *   INFO:  cuMemGetInfo: report the container's limit instead of the GPU's memory;
 *   CTX:   a context is made: say hello first, so the enforcer knows this process waits in the
 *          shim before its first admitted call (BPF spares only calls made inside these
 *          wrappers, which it marks: enforcer/serving/shimprobes.py);
 *   RT:    runtime calls of the paper's Table II: named (they reach the driver calls above,
 *          directly or through cuGetProcAddress), never asked twice;
 *   NVML:  NVML's memory queries (nvidia-smi, pynvml): the container's limit, as INFO.
 * Every entry is exported (LD_PRELOAD interposes it) and returned by dlsym / cuGetProcAddress. */
#define SHIM_DRIVER_HOOKS(X) \
    X(ALLOC, cuMemAlloc_v2, (CUdeviceptr *p, size_t n), (p, n)) \
    X(ALLOC, cuMemAllocManaged, (CUdeviceptr *p, size_t n, unsigned f), (p, n, f)) \
    X(ALLOC, cuMemAllocPitch_v2, (CUdeviceptr *p, size_t *pitch, size_t w, size_t h, unsigned e), (p, pitch, w, h, e)) \
    X(ALLOC, cuMemAllocAsync, (CUdeviceptr *p, size_t n, void *s), (p, n, s)) \
    X(ALLOC, cuMemAllocAsync_ptsz, (CUdeviceptr *p, size_t n, void *s), (p, n, s)) \
    X(ALLOC, cuMemAllocFromPoolAsync, (CUdeviceptr *p, size_t n, void *pool, void *s), (p, n, pool, s)) \
    X(ALLOC, cuMemAllocFromPoolAsync_ptsz, (CUdeviceptr *p, size_t n, void *pool, void *s), (p, n, pool, s)) \
    X(ALLOC, cuMemCreate, (unsigned long long *h, size_t n, const void *prop, unsigned long long f), (h, n, prop, f)) \
    X(FREE, cuMemFree_v2, (CUdeviceptr p), (p)) \
    X(FREE, cuMemFreeAsync, (CUdeviceptr p, void *s), (p, s)) \
    X(FREE, cuMemFreeAsync_ptsz, (CUdeviceptr p, void *s), (p, s)) \
    X(FREE, cuMemRelease, (unsigned long long h), (h)) \
    X(INFO, cuMemGetInfo_v2, (size_t *free_b, size_t *total_b), (free_b, total_b)) \
    X(CTX, cuDevicePrimaryCtxRetain, (void **ctx, int dev), (ctx, dev)) \
    X(CTX, cuCtxCreate_v2, (void **ctx, unsigned f, int dev), (ctx, f, dev)) \
    X(CTX, cuCtxCreate_v3, (void **ctx, void *params, int n, unsigned f, int dev), (ctx, params, n, f, dev)) \
    X(CTX, cuCtxCreate_v4, (void **ctx, void *params, unsigned f, int dev), (ctx, params, f, dev))

#define SHIM_RUNTIME_HOOKS(X) \
    X(RT, cudaMalloc, (void **p, size_t n), (p, n)) \
    X(RT, cudaMallocManaged, (void **p, size_t n, unsigned f), (p, n, f)) \
    X(RT, cudaMallocPitch, (void **p, size_t *pitch, size_t w, size_t h), (p, pitch, w, h)) \
    X(RT, cudaMalloc3D, (void *pitched, struct shim_extent e), (pitched, e)) \
    X(RT, cudaFree, (void *p), (p)) \
    X(RT, cudaMemGetInfo, (size_t *free_b, size_t *total_b), (free_b, total_b))

#define SHIM_NVML_HOOKS(X) \
    X(NVML, nvmlDeviceGetMemoryInfo, (void *device, struct nvml_memory *m), (device, m)) \
    X(NVML, nvmlDeviceGetMemoryInfo_v2, (void *device, struct nvml_memory_v2 *m), (device, m))
