/*
 * libcuda_mem.c - test-only stand-in for the CUDA driver, part 2: every API
 * that takes or gives back "device memory".  Linear allocations are
 * PROT_NONE, MAP_NORESERVE mappings, so addresses are real and unique but
 * no page is ever touched (CONVGPU_STANDIN_BACKED=1: readable and writable
 * host memory at the device address, VMM handles memfds mapped there, so
 * that copies and a checkpoint's restore can be checked byte for byte);
 * capacity is enforced by acct_charge() across all processes sharing the
 * segment (see standin_shm.h).
 *
 * Same build rule as libcuda.c: -O0 so each exported function begins with
 * `push %rbp` (checked by `make check-prologue`).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>
#include <time.h>

#include "libcuda_int.h"
#include "standin_shm.h"

/* ------------------------------------------------------ linear allocations */

/* Like the real driver (H100, driver 580: NVML shows 3 MiB as 4 MiB, 123 MiB as 124 MiB),
 * linear allocations above 1 MiB take whole 2 MiB pages; smaller ones are sub-allocated. */
uint64_t footprint(uint64_t bytes)
{
    const uint64_t page = 2u << 20;
    return bytes > (1u << 20) ? (bytes + page - 1) / page * page : bytes;
}

static CUresult do_alloc(CUdeviceptr *dptr, uint64_t bytes, int dev)
{
    if (!dptr || bytes == 0)
        return CUDA_ERROR_INVALID_VALUE;
    bytes = footprint(bytes);
    CUresult rc = acct_charge(dev, bytes); /* first: OOM changes nothing */
    if (rc != CUDA_SUCCESS)
        return rc;
    struct obj *o = calloc(1, sizeof *o);
    int prot = g_backed ? PROT_READ | PROT_WRITE : PROT_NONE;
    void *p = mmap(NULL, bytes, prot, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (!o || p == MAP_FAILED) {
        free(o);
        if (p != MAP_FAILED)
            munmap(p, bytes);
        acct_uncharge(dev, bytes);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    o->key = (uintptr_t)p;
    o->kind = K_MEM;
    o->dev = dev;
    o->size = bytes;
    tab_lock();
    tab_insert(o);
    tab_unlock();
    *dptr = (CUdeviceptr)(uintptr_t)p;
    return CUDA_SUCCESS;
}

static uintptr_t g_handles = 0x4000; /* handle values given out (under tab_lock) */
static uintptr_t g_reused_handle;     /* one released: the next to give out again */

/* CONVGPU_STANDIN_FREE_RETURN_MS: the bytes are back, the call not yet: its address (handle)
 * can be taken again meanwhile */
static void free_returning(void)
{
    if (g_free_return_ms) {
        struct timespec ts = {.tv_sec = g_free_return_ms / 1000, .tv_nsec = (g_free_return_ms % 1000) * 1000000};
        while (nanosleep(&ts, &ts) != 0 && errno == EINTR)
            ;
    }
}

static CUresult do_free(CUdeviceptr dptr)
{
    tab_lock();
    struct obj *o = tab_remove((uintptr_t)dptr, K_MEM);
    tab_unlock();
    if (!o) /* a graph allocation's bytes stay in the graph pool (libcuda_graph.c) */
        return graph_mem_free((uintptr_t)dptr) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
    if (g_free_ms) {    /* a large free on the H100 runs for milliseconds, the memory still counted */
        struct timespec ts = {.tv_sec = g_free_ms / 1000, .tv_nsec = (g_free_ms % 1000) * 1000000};
        while (nanosleep(&ts, &ts) != 0 && errno == EINTR)
            ;
    }
    munmap((void *)o->key, o->size);
    acct_uncharge(o->dev, o->size);
    free(o);
    free_returning();
    return CUDA_SUCCESS;
}

API CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize)
{
    CHECK_INIT();
    int dev;
    CUresult rc = cur_dev(&dev);
    if (g_alloc_ms) {   /* a window inside the call, before it allocates: a signal's handler may call in */
        struct timespec ts = {.tv_sec = g_alloc_ms / 1000, .tv_nsec = (g_alloc_ms % 1000) * 1000000};
        while (nanosleep(&ts, &ts) != 0 && errno == EINTR)
            ;
    }
    return rc ? rc : do_alloc(dptr, bytesize, dev);
}

API CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pPitch, size_t WidthInBytes,
                                size_t Height, unsigned int ElementSizeBytes)
{
    CHECK_INIT();
    int dev;
    CUresult rc = cur_dev(&dev);
    if (rc)
        return rc;
    if (!dptr || !pPitch || WidthInBytes == 0 || Height == 0 ||
        (ElementSizeBytes != 4 && ElementSizeBytes != 8 && ElementSizeBytes != 16))
        return CUDA_ERROR_INVALID_VALUE;
    /* Rows padded to 512 bytes, a typical texture pitch alignment. */
    uint64_t pitch = ((uint64_t)WidthInBytes + 511) & ~(uint64_t)511;
    uint64_t bytes;
    if (pitch < WidthInBytes || __builtin_mul_overflow(pitch, (uint64_t)Height, &bytes))
        return CUDA_ERROR_INVALID_VALUE;
    rc = do_alloc(dptr, bytes, dev);
    if (rc == CUDA_SUCCESS)
        *pPitch = pitch;
    return rc;
}

API CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags)
{
    CHECK_INIT();
    int dev;
    CUresult rc = cur_dev(&dev);
    if (rc)
        return rc;
    if (flags != CU_MEM_ATTACH_GLOBAL && flags != CU_MEM_ATTACH_HOST)
        return CUDA_ERROR_INVALID_VALUE;
    return do_alloc(dptr, bytesize, dev); /* counted on the device, simply */
}

API CUresult cuMemFree_v2(CUdeviceptr dptr)
{
    CHECK_INIT();
    int dev;
    CUresult rc = cur_dev(&dev);
    return rc ? rc : do_free(dptr);
}

/* CUresult cuMemsetD8_v2(CUdeviceptr dstDevice, unsigned char uc, size_t N): the range must
 * lie in one allocation or mapping (or start a live graph allocation); backed mode writes
 * it, else no page is touched. */
API CUresult cuMemsetD8_v2(CUdeviceptr dstDevice, unsigned char uc, size_t N)
{
    CHECK_INIT();
    int dev;
    CUresult rc = cur_dev(&dev);
    if (rc)
        return rc;
    tab_lock();
    struct obj *o = tab_span((uintptr_t)dstDevice, N);
    if (o && g_backed)
        memset((void *)(uintptr_t)dstDevice, uc, N);
    tab_unlock();
    return o || graph_mem_live((uintptr_t)dstDevice, N) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

API CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total)
{
    CHECK_INIT();
    int dev;
    CUresult rc = cur_dev(&dev);
    if (rc)
        return rc;
    if (!free_bytes || !total)
        return CUDA_ERROR_INVALID_VALUE;
    uint64_t used = acct_used(dev);
    *total = g_capacity;
    *free_bytes = used < g_capacity ? g_capacity - used : 0;
    return CUDA_SUCCESS;
}

/* ------------------------------------------- stream-ordered (immediate) */

/* A "pool" is just an address identifying its device. */
static struct pool_st {
    char c;
} g_pools[SI_MAX_DEV];

static int pool_dev(CUmemoryPool p)
{
    struct pool_st *s = (struct pool_st *)p;
    if (s < &g_pools[0] || s >= &g_pools[SI_MAX_DEV])
        return -1;
    int d = (int)(s - g_pools);
    return d < g_ndev ? d : -1;
}

API CUresult cuDeviceGetDefaultMemPool(CUmemoryPool *pool_out, CUdevice dev)
{
    CHECK_INIT();
    if (!pool_out)
        return CUDA_ERROR_INVALID_VALUE;
    if (dev < 0 || dev >= g_ndev)
        return CUDA_ERROR_INVALID_DEVICE;
    *pool_out = (CUmemoryPool)&g_pools[dev];
    return CUDA_SUCCESS;
}

/* On a capturing stream an allocation is an alloc node of the capture's graph (no memory
 * until that graph is launched), a free a free node. */
static CUresult alloc_on(CUdeviceptr *dptr, size_t bytesize, int dev, CUstream hStream)
{
    int captured;
    CUresult rc = capture_alloc(hStream, dptr, bytesize, dev, &captured);
    return captured ? rc : do_alloc(dptr, bytesize, dev);
}

static CUresult alloc_async(CUdeviceptr *dptr, size_t bytesize, CUstream hStream)
{
    int dev;
    CUresult rc = cur_dev(&dev);
    return rc ? rc : alloc_on(dptr, bytesize, dev, hStream);
}

static CUresult alloc_pool(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream hStream)
{
    int dev;
    CUresult rc = cur_dev(&dev);
    if (rc)
        return rc;
    dev = pool_dev(pool); /* memory lands on the pool's device */
    return dev < 0 ? CUDA_ERROR_INVALID_VALUE : alloc_on(dptr, bytesize, dev, hStream);
}

static CUresult free_async(CUdeviceptr dptr, CUstream hStream)
{
    int dev, captured;
    CUresult rc = cur_dev(&dev);
    if (rc)
        return rc;
    rc = capture_free(hStream, dptr, &captured);
    return captured ? rc : do_free(dptr);
}

/* _ptsz twins are separate functions (not aliases) so that each name has
 * its own address, as in the real driver, and a uprobe on one does not
 * fire for the other. */
API CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream hStream)
{
    CHECK_INIT();
    return alloc_async(dptr, bytesize, hStream);
}

API CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUstream hStream)
{
    CHECK_INIT();
    return alloc_async(dptr, bytesize, hStream);
}

API CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
                                     CUstream hStream)
{
    CHECK_INIT();
    return alloc_pool(dptr, bytesize, pool, hStream);
}

API CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
                                          CUstream hStream)
{
    CHECK_INIT();
    return alloc_pool(dptr, bytesize, pool, hStream);
}

API CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream hStream)
{
    CHECK_INIT();
    return free_async(dptr, hStream);
}

API CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream hStream)
{
    CHECK_INIT();
    return free_async(dptr, hStream);
}

API CUresult cuStreamSynchronize(CUstream hStream)
{
    CHECK_INIT();
    (void)hStream;
    int dev;
    return cur_dev(&dev);
}

/* ------------------------------------------- virtual memory management */

static struct obj *g_resv; /* reservations, chained by ->link; tab lock */
#define G VMM_GRANULARITY

static int loc_ok(const CUmemLocation *l)
{
    return l->type == CU_MEM_LOCATION_TYPE_DEVICE && l->id >= 0 && l->id < g_ndev;
}

API CUresult cuMemGetAllocationGranularity(size_t *granularity, const CUmemAllocationProp *prop,
                                           CUmemAllocationGranularity_flags option)
{
    CHECK_INIT();
    if (!granularity || !prop || !loc_ok(&prop->location) ||
        (option != CU_MEM_ALLOC_GRANULARITY_MINIMUM && option != CU_MEM_ALLOC_GRANULARITY_RECOMMENDED))
        return CUDA_ERROR_INVALID_VALUE;
    *granularity = G;
    return CUDA_SUCCESS;
}

API CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size,
                         const CUmemAllocationProp *prop, unsigned long long flags)
{
    CHECK_INIT();
    if (!handle || !prop || size == 0 || size % G || flags ||
        prop->type != CU_MEM_ALLOCATION_TYPE_PINNED || !loc_ok(&prop->location))
        return CUDA_ERROR_INVALID_VALUE;
    int dev = prop->location.id;
    CUresult rc = acct_charge(dev, size); /* physical memory */
    if (rc)
        return rc;
    struct obj *o = calloc(1, sizeof *o);
    int fd = g_backed ? memfd_create("convgpu-standin-vmm", MFD_CLOEXEC) : -1;
    if (!o || (g_backed && (fd < 0 || ftruncate(fd, (off_t)size) != 0))) {
        free(o);
        if (fd >= 0)
            close(fd);
        acct_uncharge(dev, size);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    o->memfd = fd;      /* backed: the physical memory, mapped by cuMemMap */
    o->kind = K_HANDLE;
    o->dev = dev;
    o->size = size;
    tab_lock();
    /* the value of the last handle released is given out again, as a driver may: a release
     * still returning on another thread when its value comes back is a race to settle right */
    o->key = g_reused_handle ? g_reused_handle : ++g_handles;
    g_reused_handle = 0;
    tab_insert(o);
    tab_unlock();
    *handle = (CUmemGenericAllocationHandle)o->key;
    return CUDA_SUCCESS;
}

API CUresult cuMemRelease(CUmemGenericAllocationHandle handle)
{
    CHECK_INIT();
    struct obj *dead = NULL;
    tab_lock();
    struct obj *h = tab_find((uintptr_t)handle, K_HANDLE);
    if (!h || h->released) {
        tab_unlock();
        return CUDA_ERROR_INVALID_VALUE;
    }
    h->released = 1;
    if (h->mapcount == 0) /* else the last cuMemUnmap frees it */
        dead = tab_remove(h->key, K_HANDLE);
    if (dead)
        g_reused_handle = dead->key;
    tab_unlock();
    if (dead) {
        if (g_backed)
            close(dead->memfd);
        acct_uncharge(dead->dev, dead->size);
        free(dead);
        free_returning();   /* the value is free to come back before this call returns */
    }
    return CUDA_SUCCESS;
}

API CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment,
                                 CUdeviceptr addr, unsigned long long flags)
{
    CHECK_INIT();
    (void)addr; /* a hint only */
    (void)flags;
    if (!ptr || size == 0 || size % G || (alignment & (alignment - 1)))
        return CUDA_ERROR_INVALID_VALUE;
    uint64_t align = alignment > G ? alignment : G;
    uint64_t span = size + align;
    char *raw = mmap(NULL, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (raw == MAP_FAILED)
        return CUDA_ERROR_OUT_OF_MEMORY;
    /* Trim to an aligned range: reservations are VA only, no capacity. */
    uintptr_t base = ((uintptr_t)raw + align - 1) & ~(uintptr_t)(align - 1);
    if (base > (uintptr_t)raw)
        munmap(raw, base - (uintptr_t)raw);
    uintptr_t end = (uintptr_t)raw + span;
    if (end > base + size)
        munmap((void *)(base + size), end - (base + size));
    struct obj *o = calloc(1, sizeof *o);
    if (!o) {
        munmap((void *)base, size);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    o->key = base;
    o->kind = K_RESERVE;
    o->size = size;
    tab_lock();
    tab_insert(o);
    o->link = g_resv;
    g_resv = o;
    tab_unlock();
    *ptr = (CUdeviceptr)base;
    return CUDA_SUCCESS;
}

API CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size)
{
    CHECK_INIT();
    tab_lock();
    struct obj *o = tab_find((uintptr_t)ptr, K_RESERVE);
    if (!o || o->size != size) {
        tab_unlock();
        return CUDA_ERROR_INVALID_VALUE;
    }
    for (struct obj **pp = &g_resv; *pp; pp = &(*pp)->link)
        if (*pp == o) {
            *pp = o->link;
            break;
        }
    tab_remove(o->key, K_RESERVE);
    tab_unlock();
    munmap((void *)o->key, o->size);
    free(o);
    return CUDA_SUCCESS;
}

/* Under the tab lock: does [ptr, ptr+size) lie inside one reservation? */
static int reserved(uintptr_t ptr, uint64_t size)
{
    for (struct obj *r = g_resv; r; r = r->link)
        if (ptr >= r->key && ptr + size <= r->key + r->size)
            return 1;
    return 0;
}

/* Under the tab lock: is [ptr, ptr+size) exactly a run of whole mappings? */
static int mapped_run(uintptr_t ptr, uint64_t size)
{
    uintptr_t cur = ptr, end = ptr + size;
    while (cur < end) {
        struct obj *m = tab_find(cur, K_MAP);
        if (!m)
            return 0;
        cur += m->size;
    }
    return cur == end;
}

API CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset,
                      CUmemGenericAllocationHandle handle, unsigned long long flags)
{
    CHECK_INIT();
    if (!ptr || size == 0 || size % G || offset % G || flags)
        return CUDA_ERROR_INVALID_VALUE;
    struct obj *m = calloc(1, sizeof *m);
    if (!m)
        return CUDA_ERROR_OUT_OF_MEMORY;
    tab_lock();
    struct obj *h = tab_find((uintptr_t)handle, K_HANDLE);
    if (!h || h->released || offset + size > h->size || !reserved(ptr, size) ||
        tab_find(ptr, K_MAP) ||
        (g_backed && mmap((void *)ptr, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, h->memfd,
                          (off_t)offset) == MAP_FAILED)) {
        tab_unlock();
        free(m);
        return CUDA_ERROR_INVALID_VALUE;
    }
    m->key = ptr;
    m->kind = K_MAP;
    m->dev = h->dev;
    m->size = size;
    m->link = h;
    h->mapcount++;
    tab_insert(m);
    tab_unlock();
    return CUDA_SUCCESS;
}

API CUresult cuMemUnmap(CUdeviceptr ptr, size_t size)
{
    CHECK_INIT();
    struct obj *dead = NULL; /* handles released earlier, now unmapped */
    tab_lock();
    if (!ptr || size == 0 || !mapped_run(ptr, size)) {
        tab_unlock();
        return CUDA_ERROR_INVALID_VALUE;
    }
    uintptr_t cur = ptr, end = ptr + size;
    if (g_backed)   /* back to reserved address space */
        mmap((void *)ptr, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
    while (cur < end) {
        struct obj *m = tab_remove(cur, K_MAP);
        struct obj *h = m->link;
        cur += m->size;
        free(m);
        if (--h->mapcount == 0 && h->released) {
            tab_remove(h->key, K_HANDLE);
            h->next = dead;
            dead = h;
        }
    }
    tab_unlock();
    while (dead) {
        struct obj *n = dead->next;
        if (g_backed)
            close(dead->memfd);
        acct_uncharge(dead->dev, dead->size);
        free(dead);
        dead = n;
    }
    return CUDA_SUCCESS;
}

API CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count)
{
    CHECK_INIT();
    if (!ptr || size == 0 || !desc || count == 0)
        return CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < count; i++)
        if (!loc_ok(&desc[i].location) ||
            (desc[i].flags != CU_MEM_ACCESS_FLAGS_PROT_NONE &&
             desc[i].flags != CU_MEM_ACCESS_FLAGS_PROT_READ &&
             desc[i].flags != CU_MEM_ACCESS_FLAGS_PROT_READWRITE))
            return CUDA_ERROR_INVALID_VALUE;
    tab_lock();
    int ok = mapped_run(ptr, size);
    tab_unlock();
    return ok ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

/* ---------------------------------------------------------------- arrays */

static uint64_t fmt_bytes(CUarray_format f)
{
    switch (f) {
    case CU_AD_FORMAT_UNSIGNED_INT8:
    case CU_AD_FORMAT_SIGNED_INT8:
        return 1;
    case CU_AD_FORMAT_UNSIGNED_INT16:
    case CU_AD_FORMAT_SIGNED_INT16:
    case CU_AD_FORMAT_HALF:
        return 2;
    case CU_AD_FORMAT_UNSIGNED_INT32:
    case CU_AD_FORMAT_SIGNED_INT32:
    case CU_AD_FORMAT_FLOAT:
        return 4;
    default:
        return 0;
    }
}

/* Width * max(Height,1) * max(Depth,1) * NumChannels * element size;
 * 0 = invalid descriptor. */
static uint64_t array_bytes(uint64_t w, uint64_t h, uint64_t d, CUarray_format f, unsigned ch)
{
    uint64_t es = fmt_bytes(f), n;
    if (!es || w == 0 || (ch != 1 && ch != 2 && ch != 4))
        return 0;
    if (__builtin_mul_overflow(w, h ? h : 1, &n) || __builtin_mul_overflow(n, d ? d : 1, &n) ||
        __builtin_mul_overflow(n, (uint64_t)ch * es, &n))
        return 0;
    return n;
}

/* An object that holds `bytes` of device `dev` until it is released: its own address is its
 * handle (arrays here; modules and libraries in libcuda_module.c). */
CUresult obj_charge(int kind, int dev, uint64_t bytes, uintptr_t *out)
{
    CUresult rc = acct_charge(dev, bytes);
    if (rc != CUDA_SUCCESS)
        return rc;
    struct obj *o = calloc(1, sizeof *o);
    if (!o) {
        acct_uncharge(dev, bytes);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    o->key = (uintptr_t)o;
    o->kind = kind;
    o->dev = dev;
    o->size = bytes;
    tab_lock();
    tab_insert(o);
    tab_unlock();
    *out = o->key;
    return CUDA_SUCCESS;
}

CUresult obj_release(uintptr_t key, int kind)
{
    tab_lock();
    struct obj *o = tab_remove(key, kind);
    tab_unlock();
    if (!o)
        return CUDA_ERROR_INVALID_HANDLE;
    acct_uncharge(o->dev, o->size);
    free(o);
    return CUDA_SUCCESS;
}

static CUresult obj_create(int kind, uint64_t bytes, uintptr_t *out)
{
    int dev;
    CUresult rc = cur_dev(&dev);
    if (rc)
        return rc;
    if (!out || bytes == 0)
        return CUDA_ERROR_INVALID_VALUE;
    return obj_charge(kind, dev, bytes, out);
}

static CUresult obj_destroy(uintptr_t key, int kind)
{
    int dev;
    CUresult rc = cur_dev(&dev);
    return rc ? rc : obj_release(key, kind);
}

API CUresult cuArrayCreate_v2(CUarray *pHandle, const CUDA_ARRAY_DESCRIPTOR *pAllocateArray)
{
    CHECK_INIT();
    if (!pHandle || !pAllocateArray)
        return CUDA_ERROR_INVALID_VALUE;
    const CUDA_ARRAY_DESCRIPTOR *a = pAllocateArray;
    uint64_t bytes = array_bytes(a->Width, a->Height, 1, a->Format, a->NumChannels);
    return obj_create(K_ARRAY, bytes, (uintptr_t *)pHandle);
}

API CUresult cuArray3DCreate_v2(CUarray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *pAllocateArray)
{
    CHECK_INIT();
    if (!pHandle || !pAllocateArray)
        return CUDA_ERROR_INVALID_VALUE;
    const CUDA_ARRAY3D_DESCRIPTOR *a = pAllocateArray;
    uint64_t bytes = array_bytes(a->Width, a->Height, a->Depth, a->Format, a->NumChannels);
    return obj_create(K_ARRAY, bytes, (uintptr_t *)pHandle);
}

API CUresult cuMipmappedArrayCreate(CUmipmappedArray *pHandle,
                                    const CUDA_ARRAY3D_DESCRIPTOR *pMipmappedArrayDesc,
                                    unsigned int numMipmapLevels)
{
    CHECK_INIT();
    if (!pHandle || !pMipmappedArrayDesc || numMipmapLevels == 0)
        return CUDA_ERROR_INVALID_VALUE;
    const CUDA_ARRAY3D_DESCRIPTOR *a = pMipmappedArrayDesc;
    uint64_t w = a->Width, h = a->Height ? a->Height : 1, d = a->Depth ? a->Depth : 1;
    uint64_t total = 0;
    for (unsigned l = 0; l < numMipmapLevels; l++) {
        uint64_t b = array_bytes(w, h, d, a->Format, a->NumChannels);
        if (!b || __builtin_add_overflow(total, b, &total))
            return CUDA_ERROR_INVALID_VALUE;
        w = w > 1 ? w / 2 : 1; /* each level halves every dimension */
        h = h > 1 ? h / 2 : 1;
        d = d > 1 ? d / 2 : 1;
    }
    return obj_create(K_MIPMAP, total, (uintptr_t *)pHandle);
}

API CUresult cuArrayDestroy(CUarray hArray)
{
    CHECK_INIT();
    return obj_destroy((uintptr_t)hArray, K_ARRAY);
}

API CUresult cuMipmappedArrayDestroy(CUmipmappedArray hMipmappedArray)
{
    CHECK_INIT();
    return obj_destroy((uintptr_t)hMipmappedArray, K_MIPMAP);
}
