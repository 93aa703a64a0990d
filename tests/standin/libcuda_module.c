/*
 * libcuda_module.c - test-only stand-in for the CUDA driver, part 5: modules and libraries,
 * the device memory of their static data (a `__device__` array is taken when its image is
 * loaded, and given back when it is unloaded).
 *
 * The stand-in's image: bytes that begin "CONVGPU-STANDIN-MODULE <bytes>\n" (decimal) take
 * <bytes> of device memory; any other image (a real cubin, fatbin or PTX too) loads as a
 * module of 0 bytes. An image is the caller's memory of unknown length, so no more of it is
 * read than that line's 44 bytes, and no byte after the first that differs from it.
 *
 * Same build rule as libcuda.c: -O0 so each exported function begins with `push %rbp`.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include "libcuda_int.h"

#define MAGIC "CONVGPU-STANDIN-MODULE "
#define MAX_DIGITS 20   /* 2^64 - 1 */
#define HEADER_MAX (sizeof MAGIC - 1 + MAX_DIGITS + 1)

/* The device bytes an image asks for: its header's number, else 0. `len`: bytes that may be
 * read (a file's), or SIZE_MAX for caller memory (then reading stops at the first mismatch,
 * before any byte the header could not have). */
static uint64_t image_bytes(const unsigned char *img, size_t len)
{
    size_t i = 0;
    for (; i < sizeof MAGIC - 1; i++)
        if (i >= len || img[i] != (unsigned char)MAGIC[i])
            return 0;
    uint64_t v = 0;
    size_t digits = 0;
    for (; i < len && digits < MAX_DIGITS && img[i] >= '0' && img[i] <= '9'; i++, digits++)
        if (__builtin_mul_overflow(v, 10, &v) || __builtin_add_overflow(v, (uint64_t)(img[i] - '0'), &v))
            return 0;
    return digits && i < len && img[i] == '\n' ? v : 0;
}

/* The header of a file (the driver reads the caller's own file: symlinks are followed as the
 * driver would; a FIFO or a device is refused rather than waited on). */
static CUresult file_bytes(const char *path, uint64_t *bytes)
{
    if (!path)
        return CUDA_ERROR_INVALID_VALUE;
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0)
        return errno == ENOENT ? CUDA_ERROR_FILE_NOT_FOUND : CUDA_ERROR_INVALID_VALUE;
    struct stat st;
    unsigned char head[HEADER_MAX];
    ssize_t n = fstat(fd, &st) == 0 && S_ISREG(st.st_mode) ? read(fd, head, sizeof head) : -1;
    close(fd);
    if (n < 0)
        return CUDA_ERROR_INVALID_VALUE;
    *bytes = image_bytes(head, (size_t)n);
    return CUDA_SUCCESS;
}

static CUresult module_from(CUmodule *module, const void *image, const char *path)
{
    int dev;
    CUresult rc = cur_dev(&dev);        /* a module is loaded into the current context */
    if (rc)
        return rc;
    if (!module || (!image && !path))
        return CUDA_ERROR_INVALID_VALUE;
    uint64_t bytes = 0;
    if (path)
        rc = file_bytes(path, &bytes);
    else
        bytes = image_bytes(image, SIZE_MAX);
    return rc ? rc : obj_charge(K_MODULE, dev, bytes, (uintptr_t *)module);
}

API CUresult cuModuleLoad(CUmodule *module, const char *fname)
{
    CHECK_INIT();
    if (!fname)
        return CUDA_ERROR_INVALID_VALUE;
    return module_from(module, NULL, fname);
}

API CUresult cuModuleLoadData(CUmodule *module, const void *image)
{
    CHECK_INIT();
    return module_from(module, image, NULL);
}

API CUresult cuModuleLoadDataEx(CUmodule *module, const void *image, unsigned int numOptions,
                                CUjit_option *options, void **optionValues)
{
    CHECK_INIT();
    if (numOptions && (!options || !optionValues))
        return CUDA_ERROR_INVALID_VALUE;
    return module_from(module, image, NULL);
}

/* CUresult cuModuleGetFunction(CUfunction *hfunc, CUmodule hmod, const char *name): any name
 * is a function of a loaded module here; its handle is the module's (cuLaunchKernel checks
 * that the module is still loaded). */
API CUresult cuModuleGetFunction(CUfunction *hfunc, CUmodule hmod, const char *name)
{
    CHECK_INIT();
    if (!hfunc || !name)
        return CUDA_ERROR_INVALID_VALUE;
    tab_lock();
    int ok = hmod && tab_find((uintptr_t)hmod, K_MODULE);
    tab_unlock();
    if (!ok)
        return CUDA_ERROR_INVALID_HANDLE;
    *hfunc = (CUfunction)hmod;
    return CUDA_SUCCESS;
}

API CUresult cuModuleUnload(CUmodule hmod)
{
    CHECK_INIT();
    return obj_release((uintptr_t)hmod, K_MODULE);
}

/* Libraries are context-independent in the driver: the stand-in charges the current
 * context's device, or device 0 where none is current. */
static CUresult library_from(CUlibrary *library, const void *code, const char *path,
                             unsigned int nJit, CUjit_option *jit, void **jitValues,
                             unsigned int nLib, CUlibraryOption *lib, void **libValues)
{
    if (!library || (!code && !path) || (nJit && (!jit || !jitValues)) || (nLib && (!lib || !libValues)))
        return CUDA_ERROR_INVALID_VALUE;
    int dev = 0;
    CUresult rc = cur_dev(&dev);
    if (rc == CUDA_ERROR_INVALID_CONTEXT)
        dev = 0, rc = CUDA_SUCCESS;
    uint64_t bytes = 0;
    if (rc == CUDA_SUCCESS && path)
        rc = file_bytes(path, &bytes);
    else if (rc == CUDA_SUCCESS)
        bytes = image_bytes(code, SIZE_MAX);
    return rc ? rc : obj_charge(K_LIBRARY, dev, bytes, (uintptr_t *)library);
}

API CUresult cuLibraryLoadData(CUlibrary *library, const void *code, CUjit_option *jitOptions,
                               void **jitOptionsValues, unsigned int numJitOptions,
                               CUlibraryOption *libraryOptions, void **libraryOptionValues,
                               unsigned int numLibraryOptions)
{
    CHECK_INIT();
    if (!code)
        return CUDA_ERROR_INVALID_VALUE;
    return library_from(library, code, NULL, numJitOptions, jitOptions, jitOptionsValues,
                        numLibraryOptions, libraryOptions, libraryOptionValues);
}

API CUresult cuLibraryLoadFromFile(CUlibrary *library, const char *fileName, CUjit_option *jitOptions,
                                   void **jitOptionsValues, unsigned int numJitOptions,
                                   CUlibraryOption *libraryOptions, void **libraryOptionValues,
                                   unsigned int numLibraryOptions)
{
    CHECK_INIT();
    if (!fileName)
        return CUDA_ERROR_INVALID_VALUE;
    return library_from(library, NULL, fileName, numJitOptions, jitOptions, jitOptionsValues,
                        numLibraryOptions, libraryOptions, libraryOptionValues);
}

API CUresult cuLibraryUnload(CUlibrary library)
{
    CHECK_INIT();
    return obj_release((uintptr_t)library, K_LIBRARY);
}
