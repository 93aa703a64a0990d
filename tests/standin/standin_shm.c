/*
 * standin_shm.c - see standin_shm.h for the design (slots + OFD locks).
 * Linked into libcuda.so.1 (hidden visibility) and into standin-usage.
 */
#define _GNU_SOURCE
#include "standin_shm.h"

#include <errno.h>
#include <fcntl.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

/* The layout is an interface (README.md documents it for Python readers). */
_Static_assert(offsetof(struct si_seg, used) == 32, "layout");
_Static_assert(offsetof(struct si_seg, peak) == 160, "layout");
_Static_assert(offsetof(struct si_seg, lock) == 288, "layout");
_Static_assert(offsetof(struct si_seg, slots) == 352, "layout");
_Static_assert(sizeof(struct si_slot) == 144, "layout");
_Static_assert(offsetof(struct si_seg, cp) == 295264, "layout");
_Static_assert(sizeof(struct si_cp) == 160, "layout");

const char *si_name(void)
{
    const char *n = getenv("CONVGPU_STANDIN_SHM");
    return (n && n[0] == '/') ? n : SI_DEFAULT_NAME;
}

static void nap_ms(long ms)
{
    struct timespec ts = {0, ms * 1000000L};
    nanosleep(&ts, NULL);
}

/* Creator: size the file, build the robust mutex, then publish init_done.
 * Everyone else waits for init_done, because a racing opener can map the
 * file between ftruncate and mutex initialisation. */
static int init_segment(struct si_seg *s)
{
    pthread_mutexattr_t a;
    pthread_mutexattr_init(&a);
    pthread_mutexattr_setpshared(&a, PTHREAD_PROCESS_SHARED);
    pthread_mutexattr_setrobust(&a, PTHREAD_MUTEX_ROBUST);
    int rc = pthread_mutex_init(&s->lock.m, &a);
    pthread_mutexattr_destroy(&a);
    if (rc)
        return -1;
    s->magic = SI_MAGIC;
    s->version = SI_VERSION;
    s->max_devices = SI_MAX_DEV;
    s->nslots = SI_NSLOTS;
    __atomic_store_n(&s->init_done, 1u, __ATOMIC_RELEASE);
    return 0;
}

int si_open(struct si_handle *h, int create)
{
    const char *name = si_name();
    size_t sz = sizeof(struct si_seg);
    int created = 0;
    int fd = -1;

    h->fd = -1;
    h->seg = NULL;
    if (create) {
        fd = shm_open(name, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
        if (fd >= 0) {
            created = 1;
            fchmod(fd, 0666); /* umask must not lock other users out */
            if (ftruncate(fd, (off_t)sz) != 0) {
                close(fd);
                shm_unlink(name);
                return -2;
            }
        } else if (errno != EEXIST) {
            return -2;
        }
    }
    if (fd < 0) {
        fd = shm_open(name, O_RDWR | O_CLOEXEC, 0);
        if (fd < 0)
            return errno == ENOENT ? -1 : -2;
        /* The creator may not have sized it yet. */
        struct stat st;
        int tries = 0;
        while (fstat(fd, &st) == 0 && (size_t)st.st_size < sz && tries++ < 2000)
            nap_ms(1);
        if (fstat(fd, &st) != 0 || (size_t)st.st_size < sz) {
            close(fd);
            return -2;
        }
    }
    struct si_seg *s = mmap(NULL, sz, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (s == MAP_FAILED) {
        close(fd);
        return -2;
    }
    if (created) {
        if (init_segment(s) != 0) {
            munmap(s, sz);
            close(fd);
            shm_unlink(name);
            return -2;
        }
    } else {
        int tries = 0;
        while (!__atomic_load_n(&s->init_done, __ATOMIC_ACQUIRE) && tries++ < 2000)
            nap_ms(1);
        if (!__atomic_load_n(&s->init_done, __ATOMIC_ACQUIRE) || s->magic != SI_MAGIC ||
            s->version != SI_VERSION || s->max_devices != SI_MAX_DEV ||
            s->nslots != SI_NSLOTS) {
            munmap(s, sz);
            close(fd);
            return -2;
        }
    }
    h->fd = fd;
    h->seg = s;
    return 0;
}

/* A lock's result: a process that died inside the critical section left it EOWNERDEAD.  Its
 * slot will be reaped, and the counters are recomputed from slots, so the state is usable as
 * is: taken as locked. */
static int locked(struct si_handle *h, int rc)
{
    if (rc == EOWNERDEAD) {
        pthread_mutex_consistent(&h->seg->lock.m);
        rc = 0;
    }
    return rc;
}

int si_lock(struct si_handle *h)
{
    return locked(h, pthread_mutex_lock(&h->seg->lock.m));
}

int si_lock_within(struct si_handle *h, int ms)
{
    struct timespec t;
    clock_gettime(CLOCK_REALTIME, &t);
    t.tv_sec += ms / 1000;
    t.tv_nsec += (long)(ms % 1000) * 1000000L;
    if (t.tv_nsec >= 1000000000L) {
        t.tv_sec++;
        t.tv_nsec -= 1000000000L;
    }
    return locked(h, pthread_mutex_timedlock(&h->seg->lock.m, &t));
}

void si_unlock(struct si_handle *h)
{
    pthread_mutex_unlock(&h->seg->lock.m);
}

/* Is slot idx's OFD lock held by some open file description other than
 * ours?  Errors count as "held" so we never drop a live process's usage. */
static int slot_locked(int fd, int idx)
{
    struct flock fl;
    memset(&fl, 0, sizeof fl);
    fl.l_type = F_WRLCK;
    fl.l_whence = SEEK_SET;
    fl.l_start = idx;
    fl.l_len = 1;
    if (fcntl(fd, F_OFD_GETLK, &fl) != 0)
        return 1;
    return fl.l_type != F_UNLCK;
}

void si_reap(struct si_handle *h, int self)
{
    struct si_seg *s = h->seg;
    uint64_t sum[SI_MAX_DEV] = {0};
    uint32_t hi = s->slot_hiwater;
    if (hi > SI_NSLOTS)
        hi = SI_NSLOTS;
    for (uint32_t i = 0; i < hi; i++) {
        struct si_slot *sl = &s->slots[i];
        if (sl->pid == 0)
            continue;
        if ((int)i != self && !slot_locked(h->fd, (int)i)) {
            memset(sl, 0, sizeof *sl); /* owner is dead */
            memset(&s->cp[i], 0, sizeof s->cp[i]);
            continue;
        }
        for (int d = 0; d < SI_MAX_DEV; d++)
            sum[d] += sl->used[d];
    }
    for (int d = 0; d < SI_MAX_DEV; d++)
        __atomic_store_n(&s->used[d], sum[d], __ATOMIC_RELAXED);
}

static uint64_t my_start_time(void)
{
    /* Field 22 of /proc/self/stat; comm (field 2) may contain spaces, so
     * parse after the last ')'.  Informational only (locks decide life). */
    char buf[1024];
    int fd = open("/proc/self/stat", O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return 0;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0)
        return 0;
    buf[n] = 0;
    char *p = strrchr(buf, ')');
    if (!p)
        return 0;
    int field = 2;
    for (; *p && field < 22; p++)
        if (*p == ' ')
            field++;
    return strtoull(p, NULL, 10);
}

int si_register(struct si_handle *h)
{
    struct si_seg *s = h->seg;
    si_reap(h, -1); /* frees slots of dead processes for reuse */
    for (int i = 0; i < SI_NSLOTS; i++) {
        if (s->slots[i].pid != 0)
            continue;
        struct flock fl;
        memset(&fl, 0, sizeof fl);
        fl.l_type = F_WRLCK;
        fl.l_whence = SEEK_SET;
        fl.l_start = i;
        fl.l_len = 1;
        if (fcntl(h->fd, F_OFD_SETLK, &fl) != 0)
            continue; /* someone still holds it (should not happen) */
        memset(&s->slots[i], 0, sizeof s->slots[i]);
        memset(&s->cp[i], 0, sizeof s->cp[i]);
        s->slots[i].pid = (int32_t)getpid();
        s->slots[i].start_time = my_start_time();
        if ((uint32_t)i + 1 > s->slot_hiwater)
            s->slot_hiwater = (uint32_t)i + 1;
        return i;
    }
    return -1;
}

void si_unregister(struct si_handle *h, int idx)
{
    if (idx < 0 || idx >= SI_NSLOTS)
        return;
    memset(&h->seg->slots[idx], 0, sizeof h->seg->slots[idx]);
    memset(&h->seg->cp[idx], 0, sizeof h->seg->cp[idx]);
    struct flock fl;
    memset(&fl, 0, sizeof fl);
    fl.l_type = F_UNLCK;
    fl.l_whence = SEEK_SET;
    fl.l_start = idx;
    fl.l_len = 1;
    fcntl(h->fd, F_OFD_SETLK, &fl);
    si_reap(h, -1);
}
