/*
 * libcuda_copy.c - test-only stand-in for the CUDA driver, part 7: copies between host and
 * device, and kernel launches, the "work" of a process that holds memory (tests/standin/
 * holder.c; a checkpointed process's next call of this kind waits at the gate).
 *
 * A device range must lie in one live allocation (cuMemAlloc & co) or one VMM mapping, or
 * start a live graph allocation: else CUDA_ERROR_INVALID_VALUE. With CONVGPU_STANDIN_BACKED=1
 * the bytes are copied (the device address is host memory of this process); without it, and
 * for graph allocations, nothing is (the bounds are still checked).
 *
 * Same build rule as libcuda.c: -O0 so each exported function begins with `push %rbp`.
 */
#define _GNU_SOURCE
#include <string.h>

#include "libcuda_int.h"

static CUresult copy(CUdeviceptr dst, const void *hsrc, CUdeviceptr src, void *hdst, size_t n)
{
    int dev;
    CUresult rc = cur_dev(&dev);
    if (rc)
        return rc;
    if (n == 0)
        return CUDA_SUCCESS;
    tab_lock();
    int to = hdst || tab_span((uintptr_t)dst, n), from = hsrc || tab_span((uintptr_t)src, n);
    if (to && from && g_backed)     /* the device address is this process's memory; DtoD may overlap */
        memmove(hdst ? hdst : (void *)(uintptr_t)dst, hsrc ? hsrc : (const void *)(uintptr_t)src, n);
    tab_unlock();
    /* graph allocations (libcuda_graph.c takes the table's lock itself) hold no bytes */
    to = to || graph_mem_live((uintptr_t)dst, n);
    from = from || graph_mem_live((uintptr_t)src, n);
    return to && from ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

API CUresult cuMemcpyHtoD_v2(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount)
{
    CHECK_INIT();
    if (!srcHost && ByteCount)
        return CUDA_ERROR_INVALID_VALUE;
    return copy(dstDevice, srcHost, 0, NULL, ByteCount);
}

API CUresult cuMemcpyDtoH_v2(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount)
{
    CHECK_INIT();
    if (!dstHost && ByteCount)
        return CUDA_ERROR_INVALID_VALUE;
    return copy(0, NULL, srcDevice, dstHost, ByteCount);
}

API CUresult cuMemcpyDtoD_v2(CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount)
{
    CHECK_INIT();
    return copy(dstDevice, NULL, srcDevice, NULL, ByteCount);
}

/* A kernel does nothing here: the launch needs a current context and a function of a loaded
 * module (cuModuleGetFunction's handle is its module's). */
static CUresult launch(CUfunction f)
{
    int dev;
    CUresult rc = cur_dev(&dev);
    if (rc)
        return rc;
    tab_lock();
    int ok = f && tab_find((uintptr_t)f, K_MODULE);
    tab_unlock();
    return ok ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

API CUresult cuLaunchKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                            unsigned int gridDimZ, unsigned int blockDimX, unsigned int blockDimY,
                            unsigned int blockDimZ, unsigned int sharedMemBytes, CUstream hStream,
                            void **kernelParams, void **extra)
{
    CHECK_INIT();
    (void)gridDimX, (void)gridDimY, (void)gridDimZ, (void)blockDimX, (void)blockDimY;
    (void)blockDimZ, (void)sharedMemBytes, (void)hStream, (void)kernelParams, (void)extra;
    return launch(f);
}

API CUresult cuLaunchKernel_ptsz(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                                 unsigned int gridDimZ, unsigned int blockDimX, unsigned int blockDimY,
                                 unsigned int blockDimZ, unsigned int sharedMemBytes, CUstream hStream,
                                 void **kernelParams, void **extra)
{
    CHECK_INIT();
    (void)gridDimX, (void)gridDimY, (void)gridDimZ, (void)blockDimX, (void)blockDimY;
    (void)blockDimZ, (void)sharedMemBytes, (void)hStream, (void)kernelParams, (void)extra;
    return launch(f);
}
