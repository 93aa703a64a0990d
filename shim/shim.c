/* libconvgpu.so: the preload shim. LD_PRELOAD it (see `convgpu shim --print-env`) and every
 * allocating CUDA driver call asks the enforcer first, over its shim socket, in JSON lines:
 *   {"op":"hello"}                         -> {"ok":true,"limit":L,"credit":ID} once per connection,
 *                                             with the process's credit page (an fd, SCM_RIGHTS)
 *   {"op":"ask","dev":D,"size":N}          -> {"ok":true,"grant":true} | {"ok":true,"deny":"why"}
 *   {"op":"alloc","dev":D,"addr":A,"size":N}  after success (no reply)
 *   {"op":"free","addr":A}                 after success (no reply)
 *   {"op":"ctx","dev":D,"primary":0|1}     after a context is made (no reply)
 *   {"op":"meminfo","dev":D}               -> {"ok":true,"total":T,"used":U}
 *   {"op":"meminfo","minor":M}             -> the same, the GPU by its NVML minor number
 * A grant may take a while (the container waits for memory): one connection per thread, so only
 * the calling thread waits. A deny becomes CUDA_ERROR_OUT_OF_MEMORY (the runtime turns it into
 * cudaErrorMemoryAllocation; PyTorch frees its cache and retries, then raises OutOfMemoryError).
 * An allocation that its process's credit covers (credit.h) does not ask: it takes the bytes
 * with one compare-and-swap and only reports, so most calls never wait for the enforcer.
 * Who asks is what the kernel says (SO_PEERCRED), never what a message claims.
 * Without a reachable enforcer calls pass through with one warning (fail-open), or fail with
 * out-of-memory when CONVGPU_SHIM_FAIL_CLOSED=1. Hooks: hooks.h (one X-macro list). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <unistd.h>

typedef int CUresult;
typedef int cudaError_t;
typedef unsigned long long CUdeviceptr;
struct shim_extent { size_t width, height, depth; };
struct nvml_memory { unsigned long long total, free, used; };                      /* nvml.h */
struct nvml_memory_v2 { unsigned int version; unsigned long long total, reserved, free, used; };
#define CUDA_SUCCESS 0
#define CUDA_ERROR_OUT_OF_MEMORY 2
#define EXPORT __attribute__((visibility("default")))

#include "credit.h"
#include "hooks.h"

/* ---- configuration: read once, at load ---- */
static struct {
    char socket[sizeof(((struct sockaddr_un *)0)->sun_path)];
    int fail_closed;
    int level;          /* 0 quiet, 1 warnings (default), 2 decisions, 3 every call */
} cfg = {"/run/convgpu/shim/shim.sock", 0, 1};

static void forget_parent(void);

__attribute__((constructor)) static void shim_config(void)
{
    const char *s = getenv("CONVGPU_SHIM_SOCKET");
    if (s && *s)
        snprintf(cfg.socket, sizeof(cfg.socket), "%s", s);
    s = getenv("CONVGPU_SHIM_FAIL_CLOSED");
    cfg.fail_closed = s && *s == '1';
    s = getenv("CONVGPU_SHIM_LOG");
    if (s && *s >= '0' && *s <= '3')
        cfg.level = *s - '0';
    pthread_atfork(NULL, NULL, forget_parent);
}

#define LOG(lvl, ...) do { if (cfg.level >= (lvl)) shim_log(__FILE__, __LINE__, __VA_ARGS__); } while (0)

static void shim_log(const char *file, int line, const char *fmt, ...)
{
    char buf[512];
    int n = snprintf(buf, sizeof(buf), "[convgpu %d:%ld %s:%d] ", getpid(), (long)syscall(SYS_gettid),
                     file, line);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf + n, sizeof(buf) - n - 1, fmt, ap);
    va_end(ap);
    size_t len = strlen(buf);
    buf[len++] = '\n';
    if (write(2, buf, len) < 0) { /* nothing to do */ }
}

/* ---- the real functions ---- */
static void *(*real_dlsym)(void *, const char *);

static void find_dlsym(void)
{
    if (!real_dlsym)
        real_dlsym = (void *(*)(void *, const char *))dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.34");
    if (!real_dlsym)
        real_dlsym = (void *(*)(void *, const char *))dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.2.5");
}

/* The driver (and NVML) may be loaded RTLD_LOCAL (static cudart dlopens it; pynvml too): ask
 * the library by handle. */
static void *lib_sym(const char *lib, const char *name)
{
    find_dlsym();
    void *h = dlopen(lib, RTLD_NOW | RTLD_NOLOAD);
    if (!h)
        h = dlopen(lib, RTLD_NOW);
    return h ? real_dlsym(h, name) : NULL;
}

static void *driver_sym(const char *name) { return lib_sym("libcuda.so.1", name); }
static void *nvml_sym(const char *name) { return lib_sym("libnvidia-ml.so.1", name); }

static void *runtime_sym(const char *name)
{
    find_dlsym();
    return real_dlsym(RTLD_NEXT, name);
}

/* ---- the enforcer connection: one per thread ---- */
static __thread int conn_fd = -1;
static __thread const char *rt_name;   /* the runtime call in progress, for the logs */
static int warned;

static int send_all(int fd, const char *s, size_t n)
{
    while (n) {
        ssize_t w = send(fd, s, n, MSG_NOSIGNAL);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            return -1;
        s += w;
        n -= (size_t)w;
    }
    return 0;
}

/* Peek, then take exactly up to the newline: never read past our reply, in two calls instead
 * of one per byte (the reply is one short line, so this is the whole cost of reading it). */
static int recv_line(int fd, char *buf, size_t size)
{
    size_t n = 0;
    while (n + 1 < size) {
        ssize_t r = recv(fd, buf + n, size - 1 - n, MSG_PEEK);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            return -1;
        char *nl = memchr(buf + n, '\n', (size_t)r);
        size_t take = nl ? (size_t)(nl - (buf + n)) + 1 : (size_t)r;
        ssize_t got;
        do
            got = recv(fd, buf + n, take, 0);
        while (got < 0 && errno == EINTR);
        if (got != (ssize_t)take)
            return -1;
        n += take;
        if (nl) {
            buf[n - 1] = 0;
            return 0;
        }
    }
    return -1;
}

/* ---- credit: bytes this process may allocate without asking ---- */
static struct credit_page *credit;   /* NULL until a hello brought one */

/* The page of the enforcer that answered the hello. Another thread may still be reading the
 * page of an enforcer that has since restarted: the old one stays mapped (one page). */
static void take_page(int fd, uint64_t id)
{
    struct credit_page *c = __atomic_load_n(&credit, __ATOMIC_ACQUIRE);
    if (fd < 0 || (c && c->id == id)) {
        if (fd >= 0)
            close(fd);
        return;
    }
    void *p = mmap(NULL, sizeof(struct credit_page), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (p != MAP_FAILED && ((struct credit_page *)p)->id == id)
        __atomic_store_n(&credit, (struct credit_page *)p, __ATOMIC_RELEASE);
    else if (p != MAP_FAILED)
        munmap(p, sizeof(struct credit_page));
}

/* 1: the bytes this allocation will be charged were taken from credit (it need not ask). */
static int take_credit(int dev, size_t size)
{
    struct credit_page *c = __atomic_load_n(&credit, __ATOMIC_ACQUIRE);
    if (!c || dev < 0 || dev >= CREDIT_DEVICES)
        return 0;
    uint64_t want = credit_footprint(c, size), have = __atomic_load_n(&c->credit[dev], __ATOMIC_RELAXED);
    do
        if (have < want)
            return 0;
    while (!__atomic_compare_exchange_n(&c->credit[dev], &have, have - want, 1, __ATOMIC_ACQ_REL,
                                        __ATOMIC_RELAXED));
    return 1;
}

/* The hello reply carries the credit page: it is the only reply on a new connection, so
 * reading all that came is safe here (recv_line below never reads past its line). */
static int recv_hello(int fd, char *buf, size_t size)
{
    size_t n = 0;
    int page = -1;
    while (n + 1 < size && !memchr(buf, '\n', n)) {
        union { char b[CMSG_SPACE(sizeof(int))]; struct cmsghdr align; } ctl;
        struct iovec iov = {buf + n, size - 1 - n};
        struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl.b, .msg_controllen = sizeof(ctl.b)};
        ssize_t r = recvmsg(fd, &m, MSG_CMSG_CLOEXEC);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            break;
        struct cmsghdr *cm = CMSG_FIRSTHDR(&m);
        if (cm && cm->cmsg_level == SOL_SOCKET && cm->cmsg_type == SCM_RIGHTS && page < 0)
            memcpy(&page, CMSG_DATA(cm), sizeof(int));
        n += (size_t)r;
    }
    buf[n] = 0;
    if (!memchr(buf, '\n', n)) {
        if (page >= 0)
            close(page);
        return -1;
    }
    const char *p = strstr(buf, "\"credit\":");
    take_page(page, p ? strtoull(p + 9, NULL, 10) : 0);
    return 0;
}

/* A forked child is another process: its own connection, its own page (at its first call). */
static void forget_parent(void)
{
    if (conn_fd >= 0)
        close(conn_fd);
    conn_fd = -1;
    struct credit_page *c = credit;
    credit = NULL;
    if (c)
        munmap(c, sizeof(*c));
}

static void disconnect(void)
{
    if (conn_fd >= 0)
        close(conn_fd);
    conn_fd = -1;
}

static int connect_enforcer(void)
{
    if (conn_fd >= 0)
        return conn_fd;
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    memcpy(a.sun_path, cfg.socket, sizeof(a.sun_path));
    char reply[256];
    if (fd < 0 || connect(fd, (struct sockaddr *)&a, sizeof(a)) < 0 ||
        send_all(fd, "{\"op\":\"hello\"}\n", 15) < 0 || recv_hello(fd, reply, sizeof(reply)) < 0 ||
        !strstr(reply, "\"ok\":true")) {
        if (fd >= 0)
            close(fd);
        if (!__atomic_exchange_n(&warned, 1, __ATOMIC_RELAXED))
            LOG(1, "no enforcer on %s (%s): %s", cfg.socket, strerror(errno),
                cfg.fail_closed ? "allocations fail (CONVGPU_SHIM_FAIL_CLOSED=1)" : "calls pass through");
        return -1;
    }
    __atomic_store_n(&warned, 0, __ATOMIC_RELAXED);   /* warn again if it goes away */
    conn_fd = fd;
    return fd;
}

/* One request; reply into buf (when want_reply). A broken connection is retried once: the
 * enforcer may have restarted. */
static int request(const char *msg, char *buf, size_t size, int want_reply)
{
    for (int attempt = 0; attempt < 2; attempt++) {
        int fd = connect_enforcer();
        if (fd < 0)
            return -1;
        if (send_all(fd, msg, strlen(msg)) == 0 && (!want_reply || recv_line(fd, buf, size) == 0))
            return 0;
        disconnect();
    }
    return -1;
}

static long long json_num(const char *s, const char *key)
{
    const char *p = strstr(s, key);
    return p ? strtoll(p + strlen(key), NULL, 10) : -1;
}

static int current_device(void)
{
    static CUresult (*get)(int *);
    if (!get)
        get = (CUresult (*)(int *))driver_sym("cuCtxGetDevice");
    int dev = 0;
    if (!get || get(&dev) != CUDA_SUCCESS)
        dev = 0;
    return dev;
}

/* 0: go ahead; CUDA_ERROR_OUT_OF_MEMORY: denied (or no enforcer and fail-closed). */
static CUresult ask(const char *api, int dev, size_t size)
{
    char msg[160], reply[512];
    snprintf(msg, sizeof(msg), "{\"op\":\"ask\",\"dev\":%d,\"size\":%zu}\n", dev, size);
    if (request(msg, reply, sizeof(reply), 1) < 0)
        return cfg.fail_closed ? CUDA_ERROR_OUT_OF_MEMORY : CUDA_SUCCESS;
    if (strstr(reply, "\"grant\":true")) {
        LOG(3, "%s%s%s %zu bytes on GPU%d: granted", rt_name ? rt_name : "", rt_name ? " -> " : "", api, size, dev);
        return CUDA_SUCCESS;
    }
    LOG(2, "%s %zu bytes on GPU%d denied: %s", api, size, dev, reply);
    return CUDA_ERROR_OUT_OF_MEMORY;
}

static void report_alloc(int dev, unsigned long long addr, size_t size)
{
    char msg[160];
    snprintf(msg, sizeof(msg), "{\"op\":\"alloc\",\"dev\":%d,\"addr\":%llu,\"size\":%zu}\n", dev, addr, size);
    request(msg, NULL, 0, 0);
}

static void report_free(unsigned long long addr)
{
    char msg[96];
    snprintf(msg, sizeof(msg), "{\"op\":\"free\",\"addr\":%llu}\n", addr);
    request(msg, NULL, 0, 0);
}

static void report_context(int dev, int primary)
{
    char msg[96];
    snprintf(msg, sizeof(msg), "{\"op\":\"ctx\",\"dev\":%d,\"primary\":%d}\n", dev, primary);
    request(msg, NULL, 0, 0);
}

/* ---- the wrappers ---- */
#define REAL(kind, name, params, args) static CUresult (*real_##name) params;
SHIM_DRIVER_HOOKS(REAL)
#undef REAL
#define RESOLVE(name) (real_##name ? real_##name : (real_##name = (__typeof__(real_##name))driver_sym(#name)))

static CUresult missing(const char *name)
{
    LOG(1, "%s: not in this libcuda.so.1", name);
    return 500;   /* CUDA_ERROR_NOT_FOUND */
}

#define ALLOC_WRAPPER(name, params, args, size_expr, addr_expr)                  \
    EXPORT CUresult name params                                                  \
    {                                                                             \
        if (!RESOLVE(name))                                                       \
            return missing(#name);                                                \
        int dev = current_device();                                               \
        size_t size = (size_expr);                                                \
        if (!take_credit(dev, size)) {                                            \
            CUresult rc = ask(#name, dev, size);                                  \
            if (rc != CUDA_SUCCESS)                                               \
                return rc;                                                        \
        }                                                                         \
        CUresult rc = real_##name args;                                           \
        if (rc == CUDA_SUCCESS)                                                   \
            report_alloc(dev, (addr_expr), size);                                 \
        else   /* address 0: nothing was taken, the grant (or credit) is released */ \
            report_alloc(dev, 0, size);                                           \
        return rc;                                                                \
    }

ALLOC_WRAPPER(cuMemAlloc_v2, (CUdeviceptr *p, size_t n), (p, n), n, *p)
ALLOC_WRAPPER(cuMemAllocManaged, (CUdeviceptr *p, size_t n, unsigned f), (p, n, f), n, *p)
ALLOC_WRAPPER(cuMemAllocPitch_v2, (CUdeviceptr *p, size_t *pitch, size_t w, size_t h, unsigned e),
              (p, pitch, w, h, e), w * h, *p)
ALLOC_WRAPPER(cuMemAllocAsync, (CUdeviceptr *p, size_t n, void *s), (p, n, s), n, *p)
ALLOC_WRAPPER(cuMemAllocAsync_ptsz, (CUdeviceptr *p, size_t n, void *s), (p, n, s), n, *p)
ALLOC_WRAPPER(cuMemAllocFromPoolAsync, (CUdeviceptr *p, size_t n, void *pool, void *s), (p, n, pool, s), n, *p)
ALLOC_WRAPPER(cuMemAllocFromPoolAsync_ptsz, (CUdeviceptr *p, size_t n, void *pool, void *s), (p, n, pool, s), n, *p)
ALLOC_WRAPPER(cuMemCreate, (unsigned long long *h, size_t n, const void *prop, unsigned long long f),
              (h, n, prop, f), n, *h)

#define FREE_WRAPPER(name, params, args, addr)                                    \
    EXPORT CUresult name params                                                  \
    {                                                                             \
        if (!RESOLVE(name))                                                       \
            return missing(#name);                                                \
        CUresult rc = real_##name args;                                           \
        if (rc == CUDA_SUCCESS && (addr))                                         \
            report_free(addr);                                                    \
        return rc;                                                                \
    }

FREE_WRAPPER(cuMemFree_v2, (CUdeviceptr p), (p), p)
FREE_WRAPPER(cuMemFreeAsync, (CUdeviceptr p, void *s), (p, s), p)
FREE_WRAPPER(cuMemFreeAsync_ptsz, (CUdeviceptr p, void *s), (p, s), p)
FREE_WRAPPER(cuMemRelease, (unsigned long long h), (h), h)

/* Hello before the call (BPF must know us before our first admitted call); after a context
 * is made, say so: without probes the enforcer counts contexts from these reports. */
#define CTX_WRAPPER(name, params, args, dev, primary)                             \
    EXPORT CUresult name params                                                  \
    {                                                                             \
        if (!RESOLVE(name))                                                       \
            return missing(#name);                                                \
        connect_enforcer();                                                       \
        CUresult rc = real_##name args;                                           \
        if (rc == CUDA_SUCCESS)                                                   \
            report_context((dev), (primary));                                     \
        return rc;                                                                \
    }

CTX_WRAPPER(cuDevicePrimaryCtxRetain, (void **ctx, int dev), (ctx, dev), dev, 1)
CTX_WRAPPER(cuCtxCreate_v2, (void **ctx, unsigned f, int dev), (ctx, f, dev), dev, 0)
CTX_WRAPPER(cuCtxCreate_v3, (void **ctx, void *params, int n, unsigned f, int dev), (ctx, params, n, f, dev), dev, 0)
CTX_WRAPPER(cuCtxCreate_v4, (void **ctx, void *params, unsigned f, int dev), (ctx, params, f, dev), dev, 0)

/* What this process may see of a GPU, by the enforcer's rule (enforcer/memview.py): total =
 * the limit less this process's context, used = what its container holds besides that context,
 * free = what is left of the total (never more than the GPU has free). The same for CUDA and
 * NVML. Never an error: without an answer from the enforcer the driver's numbers stay. used
 * may be NULL (CUDA has none). The GPU is named by `key`: "dev", this process's CUDA ordinal
 * (the enforcer maps it to the host GPU, issue 25), or "minor", NVML's minor number (the
 * /dev/nvidiaN of the host, whatever NVML's index is inside a container). */
static void container_view(const char *key, int dev, unsigned long long *total, unsigned long long *free_b,
                           unsigned long long *used)
{
    char msg[64], reply[256];
    snprintf(msg, sizeof(msg), "{\"op\":\"meminfo\",\"%s\":%d}\n", key, dev);
    if (dev < 0 || request(msg, reply, sizeof(reply), 1) < 0)
        return;
    long long limit = json_num(reply, "\"total\":"), mine = json_num(reply, "\"used\":");
    if (limit < 0 || mine < 0)
        return;
    if ((unsigned long long)limit < *total)
        *total = (unsigned long long)limit;
    unsigned long long u = (unsigned long long)mine < *total ? (unsigned long long)mine : *total;
    if (*total - u < *free_b)
        *free_b = *total - u;
    if (used)
        *used = u;
}

EXPORT CUresult cuMemGetInfo_v2(size_t *free_b, size_t *total_b)
{
    if (!RESOLVE(cuMemGetInfo_v2))
        return missing("cuMemGetInfo_v2");
    CUresult rc = real_cuMemGetInfo_v2(free_b, total_b);
    if (rc != CUDA_SUCCESS || !free_b || !total_b)
        return rc;
    unsigned long long total = *total_b, free_left = *free_b;
    container_view("dev", current_device(), &total, &free_left, NULL);
    *total_b = (size_t)total;
    *free_b = (size_t)free_left;
    return rc;
}

/* ---- NVML's memory queries: nvidia-smi in the container shows the limit too. The GPU goes by
 * its minor number: NVML's index inside a container counts only the GPUs it was given, and is
 * not the CUDA ordinal either where CUDA_VISIBLE_DEVICES reorders them. ---- */
static int nvml_minor(void *device)
{
    static int (*get)(void *, unsigned *);
    if (!get)
        get = (int (*)(void *, unsigned *))nvml_sym("nvmlDeviceGetMinorNumber");
    unsigned i = 0;
    return get && get(device, &i) == 0 ? (int)i : -1;
}

#define NVML_WRAPPER(name, type, reserved)                                        \
    EXPORT int name(void *device, type *m)                                      \
    {                                                                             \
        static int (*real)(void *, type *);                                       \
        if (!real)                                                                \
            real = (int (*)(void *, type *))nvml_sym(#name);                      \
        if (!real)                                                                \
            return 13;   /* NVML_ERROR_FUNCTION_NOT_FOUND */                      \
        int rc = real(device, m);                                                 \
        if (rc == 0 && m) {                                                       \
            container_view("minor", nvml_minor(device), &m->total, &m->free, &m->used); \
            reserved;                                                             \
        }                                                                         \
        return rc;                                                                \
    }

NVML_WRAPPER(nvmlDeviceGetMemoryInfo, struct nvml_memory, (void)0)
/* v2 splits the driver's reservation out of used: the container's view has none */
NVML_WRAPPER(nvmlDeviceGetMemoryInfo_v2, struct nvml_memory_v2, m->reserved = 0)

/* ---- runtime calls: named, then the driver wrappers above do the asking ---- */
#define RT_WRAPPER(kind, name, params, args)                                      \
    EXPORT cudaError_t name params                                               \
    {                                                                             \
        static cudaError_t (*real) params;                                        \
        if (!real)                                                                \
            real = (cudaError_t (*) params)runtime_sym(#name);                    \
        if (!real)                                                                \
            return 999;   /* cudaErrorUnknown: no libcudart after us */           \
        const char *outer = rt_name;                                              \
        rt_name = #name;                                                          \
        cudaError_t rc = real args;                                               \
        rt_name = outer;                                                          \
        return rc;                                                                \
    }
SHIM_RUNTIME_HOOKS(RT_WRAPPER)

/* ---- lookups return the wrappers ---- */
struct hook { const char *name; void *wrapper; };
#define ENTRY(kind, name, params, args) {#name, (void *)name},
static const struct hook hooks[] = { SHIM_DRIVER_HOOKS(ENTRY) SHIM_RUNTIME_HOOKS(ENTRY) SHIM_NVML_HOOKS(ENTRY) };
#undef ENTRY

static void *wrapper_of(const char *name)
{
    for (size_t i = 0; name && i < sizeof(hooks) / sizeof(hooks[0]); i++)
        if (!strcmp(hooks[i].name, name))
            return hooks[i].wrapper;
    return NULL;
}

EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version, unsigned long long flags,
                                    int *status);
EXPORT CUresult cuGetProcAddress(const char *symbol, void **pfn, int version, unsigned long long flags);

/* cuGetProcAddress takes base names ("cuMemAlloc") and picks a version: compare the pointer it
 * returns with the real functions we wrap, whatever the name. */
static void swap_pointer(void **pfn)
{
    if (!pfn || !*pfn)
        return;
#define SWAP(kind, name, params, args) if (RESOLVE(name) == (void *)*pfn) { *pfn = (void *)name; return; }
    SHIM_DRIVER_HOOKS(SWAP)
#undef SWAP
    static void *get_v2, *get_v1;
    if (!get_v2)
        get_v2 = driver_sym("cuGetProcAddress_v2");
    if (!get_v1)
        get_v1 = driver_sym("cuGetProcAddress");
    if (*pfn == get_v2)
        *pfn = (void *)cuGetProcAddress_v2;
    else if (*pfn == get_v1)
        *pfn = (void *)cuGetProcAddress;
}

EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version, unsigned long long flags,
                                    int *status)
{
    static CUresult (*real)(const char *, void **, int, unsigned long long, int *);
    if (!real)
        real = (CUresult (*)(const char *, void **, int, unsigned long long, int *))driver_sym("cuGetProcAddress_v2");
    if (!real)
        return missing("cuGetProcAddress_v2");
    CUresult rc = real(symbol, pfn, version, flags, status);
    if (rc == CUDA_SUCCESS)
        swap_pointer(pfn);
    return rc;
}

EXPORT CUresult cuGetProcAddress(const char *symbol, void **pfn, int version, unsigned long long flags)
{
    static CUresult (*real)(const char *, void **, int, unsigned long long);
    if (!real)
        real = (CUresult (*)(const char *, void **, int, unsigned long long))driver_sym("cuGetProcAddress");
    if (!real)
        return missing("cuGetProcAddress");
    CUresult rc = real(symbol, pfn, version, flags);
    if (rc == CUDA_SUCCESS)
        swap_pointer(pfn);
    return rc;
}

/* Libraries that find the driver with dlsym get the wrappers too. */
EXPORT void *dlsym(void *handle, const char *name)
{
    find_dlsym();
    void *w = wrapper_of(name);
    if (w && strncmp(name, "cuda", 4) != 0)
        return w;
    if (name && !strcmp(name, "cuGetProcAddress_v2"))
        return (void *)cuGetProcAddress_v2;
    if (name && !strcmp(name, "cuGetProcAddress"))
        return (void *)cuGetProcAddress;
    return real_dlsym(handle, name);
}
