/*
 * libcudart.c - test-only stand-in for a sliver of the CUDA runtime
 * (libcudart.so.13).  Like the real cudart it reaches the driver through
 * dlopen("libcuda.so.1") + dlsym, so uprobes on the driver's exported
 * functions fire inside runtime calls, whichever libcuda.so.1 the dynamic
 * loader picks (the stand-in, or the real driver on a GPU machine).
 *
 * First use on a thread: cuInit(0) once per process, primary context of the
 * thread's device retained once per process and made current, as cudart does.
 *
 * Built -O0 -fno-omit-frame-pointer -fcf-protection=none like the driver
 * stand-in, so exported functions begin with `push %rbp` as well.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include "cuda_min.h"

#define API __attribute__((visibility("default")))
#define cudaErrorInsufficientDriver 35

static struct {
    CUresult (*Init)(unsigned int);
    CUresult (*DeviceGetCount)(int *);
    CUresult (*PrimaryCtxRetain)(CUcontext *, CUdevice);
    CUresult (*CtxSetCurrent)(CUcontext);
    CUresult (*CtxSynchronize)(void);
    CUresult (*MemAlloc)(CUdeviceptr *, size_t);
    CUresult (*MemAllocManaged)(CUdeviceptr *, size_t, unsigned int);
    CUresult (*MemAllocPitch)(CUdeviceptr *, size_t *, size_t, size_t, unsigned int);
    CUresult (*MemFree)(CUdeviceptr);
    CUresult (*MemGetInfo)(size_t *, size_t *);
} D;

static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static cudaError_t g_init_err;
static int g_ndev;
static CUcontext g_prim[64];
static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static __thread int t_dev;          /* cudaSetDevice */
static __thread int t_ready = -1;   /* device whose primary ctx is current */

static cudaError_t map_err(CUresult r)
{
    switch (r) {
    case CUDA_SUCCESS:
        return cudaSuccess;
    case CUDA_ERROR_INVALID_VALUE:
        return cudaErrorInvalidValue;
    case CUDA_ERROR_OUT_OF_MEMORY:
        return cudaErrorMemoryAllocation;
    case CUDA_ERROR_NOT_INITIALIZED:
        return cudaErrorInitializationError;
    case CUDA_ERROR_NO_DEVICE:
        return cudaErrorNoDevice;
    case CUDA_ERROR_INVALID_DEVICE:
        return cudaErrorInvalidDevice;
    case CUDA_ERROR_INVALID_CONTEXT:
        return cudaErrorDeviceUninitialized;
    default:
        return cudaErrorUnknown;
    }
}

static void load_driver(void)
{
    void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        g_init_err = cudaErrorInsufficientDriver;
        return;
    }
#define SYM(field, name)                                   \
    if (!(*(void **)&D.field = dlsym(h, name))) {          \
        g_init_err = cudaErrorInsufficientDriver;          \
        return;                                            \
    }
    SYM(Init, "cuInit");
    SYM(DeviceGetCount, "cuDeviceGetCount");
    SYM(PrimaryCtxRetain, "cuDevicePrimaryCtxRetain");
    SYM(CtxSetCurrent, "cuCtxSetCurrent");
    SYM(CtxSynchronize, "cuCtxSynchronize");
    SYM(MemAlloc, "cuMemAlloc_v2");
    SYM(MemAllocManaged, "cuMemAllocManaged");
    SYM(MemAllocPitch, "cuMemAllocPitch_v2");
    SYM(MemFree, "cuMemFree_v2");
    SYM(MemGetInfo, "cuMemGetInfo_v2");
#undef SYM
    CUresult r = D.Init(0);
    if (r == CUDA_SUCCESS)
        r = D.DeviceGetCount(&g_ndev);
    g_init_err = map_err(r);
}

/* Make sure the driver is loaded and the calling thread has the primary
 * context of its device current. */
static cudaError_t ensure_ctx(void)
{
    pthread_once(&g_once, load_driver);
    if (g_init_err)
        return g_init_err;
    if (t_ready == t_dev)
        return cudaSuccess;
    if (t_dev < 0 || t_dev >= g_ndev || t_dev >= 64)
        return cudaErrorInvalidDevice;
    CUresult r = CUDA_SUCCESS;
    pthread_mutex_lock(&g_mu);
    if (!g_prim[t_dev])
        r = D.PrimaryCtxRetain(&g_prim[t_dev], t_dev); /* kept until exit */
    CUcontext c = g_prim[t_dev];
    pthread_mutex_unlock(&g_mu);
    if (r == CUDA_SUCCESS)
        r = D.CtxSetCurrent(c);
    if (r == CUDA_SUCCESS)
        t_ready = t_dev;
    return map_err(r);
}

API cudaError_t cudaSetDevice(int device)
{
    pthread_once(&g_once, load_driver);
    if (g_init_err)
        return g_init_err;
    if (device < 0 || device >= g_ndev)
        return cudaErrorInvalidDevice;
    t_dev = device;
    return ensure_ctx(); /* CUDA 12+: cudaSetDevice initialises the ctx */
}

API cudaError_t cudaGetDevice(int *device)
{
    if (!device)
        return cudaErrorInvalidValue;
    *device = t_dev;
    return cudaSuccess;
}

API cudaError_t cudaGetDeviceCount(int *count)
{
    pthread_once(&g_once, load_driver);
    if (g_init_err)
        return g_init_err;
    if (!count)
        return cudaErrorInvalidValue;
    *count = g_ndev;
    return cudaSuccess;
}

API cudaError_t cudaDeviceSynchronize(void)
{
    cudaError_t e = ensure_ctx();
    return e ? e : map_err(D.CtxSynchronize());
}

API cudaError_t cudaMalloc(void **devPtr, size_t size)
{
    cudaError_t e = ensure_ctx();
    if (e)
        return e;
    if (!devPtr)
        return cudaErrorInvalidValue;
    if (size == 0) { /* documented: succeeds with a NULL pointer */
        *devPtr = NULL;
        return cudaSuccess;
    }
    CUdeviceptr p = 0;
    e = map_err(D.MemAlloc(&p, size));
    if (!e)
        *devPtr = (void *)(uintptr_t)p;
    return e;
}

API cudaError_t cudaMallocManaged(void **devPtr, size_t size, unsigned int flags)
{
    cudaError_t e = ensure_ctx();
    if (e)
        return e;
    if (!devPtr)
        return cudaErrorInvalidValue;
    CUdeviceptr p = 0;
    e = map_err(D.MemAllocManaged(&p, size, flags));
    if (!e)
        *devPtr = (void *)(uintptr_t)p;
    return e;
}

API cudaError_t cudaMallocPitch(void **devPtr, size_t *pitch, size_t width, size_t height)
{
    cudaError_t e = ensure_ctx();
    if (e)
        return e;
    if (!devPtr || !pitch)
        return cudaErrorInvalidValue;
    CUdeviceptr p = 0;
    e = map_err(D.MemAllocPitch(&p, pitch, width, height, 4));
    if (!e)
        *devPtr = (void *)(uintptr_t)p;
    return e;
}

/* Linear 3D memory = a pitched 2D allocation of height*depth rows. */
API cudaError_t cudaMalloc3D(struct cudaPitchedPtr *pitchedDevPtr, struct cudaExtent extent)
{
    cudaError_t e = ensure_ctx();
    if (e)
        return e;
    if (!pitchedDevPtr || extent.height == 0 || extent.depth == 0)
        return cudaErrorInvalidValue;
    CUdeviceptr p = 0;
    size_t pitch = 0;
    e = map_err(D.MemAllocPitch(&p, &pitch, extent.width, extent.height * extent.depth, 4));
    if (!e) {
        pitchedDevPtr->ptr = (void *)(uintptr_t)p;
        pitchedDevPtr->pitch = pitch;
        pitchedDevPtr->xsize = extent.width;
        pitchedDevPtr->ysize = extent.height;
    }
    return e;
}

API cudaError_t cudaFree(void *devPtr)
{
    cudaError_t e = ensure_ctx(); /* cudaFree(0) is the classic "init" call */
    if (e || !devPtr)
        return e;
    return map_err(D.MemFree((CUdeviceptr)(uintptr_t)devPtr));
}

API cudaError_t cudaMemGetInfo(size_t *free_bytes, size_t *total)
{
    cudaError_t e = ensure_ctx();
    return e ? e : map_err(D.MemGetInfo(free_bytes, total));
}

API const char *cudaGetErrorString(cudaError_t error)
{
    switch (error) {
    case cudaSuccess:
        return "no error";
    case cudaErrorInvalidValue:
        return "invalid argument";
    case cudaErrorMemoryAllocation:
        return "out of memory";
    case cudaErrorInitializationError:
        return "initialization error";
    case cudaErrorInsufficientDriver:
        return "CUDA driver version is insufficient for CUDA runtime version";
    case cudaErrorNoDevice:
        return "no CUDA-capable device is detected";
    case cudaErrorInvalidDevice:
        return "invalid device ordinal";
    default:
        return "unknown error";
    }
}
