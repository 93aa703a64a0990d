/*
 * visible.c - which host GPUs a stand-in process sees, in its own ordinal order, as the real
 * driver decides it once at cuInit (FACTS.md, 2026-11-25: an ordinal is process-local).
 *
 * Host GPUs are 0..CONVGPU_STANDIN_DEVICES-1 (their NVML index: PCI bus order). The driver
 * enumerates them fastest first unless CUDA_DEVICE_ORDER=PCI_BUS_ID; the stand-in's GPUs are
 * alike, except CONVGPU_STANDIN_FAST=H, which makes host GPU H the fastest (first) one, as on
 * a host with two kinds of card. CUDA_VISIBLE_DEVICES then picks from that enumeration: a
 * comma-separated list of indexes into it, or GPU-<uuid> (a prefix that names one GPU is
 * enough); the first entry that names no device (a bad index, an unknown or ambiguous UUID, a
 * MIG-<uuid>: the stand-in has no MIG instances, a repeat) ends the list. Set but empty: no
 * device (cuInit says CUDA_ERROR_NO_DEVICE). UUIDs: GPU-5ca1ab1e-0000-4000-8000-0000000000HH.
 *
 * Kernel evidence, as the real driver leaves it: with CONVGPU_STANDIN_DEVNODES=DIR, cuInit
 * opens DIR/nvidiaH (read-only) for every host GPU H it sees and keeps it open, as the driver
 * keeps /dev/nvidiaN open (a test makes DIR's nodes with mknod; probes/gpumap.py reads them
 * back from /proc/PID/fd).
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "libcuda_int.h"
#include "standin_shm.h"

void standin_uuid(int host, unsigned char out[16])
{
    si_uuid(host, out);
}

/* One entry of CUDA_VISIBLE_DEVICES -> a host GPU, or -1 (the list ends there). */
static int entry_host(const char *e, size_t n, const int *order, int nhost)
{
    if (n == 0)
        return -1;
    if (n > 4 && strncmp(e, "GPU-", 4) == 0) {
        int found = -1;
        for (int h = 0; h < nhost; h++) {
            char t[41];
            si_uuid_text(h, t);
            if (n <= 40 && strncmp(t, e, n) == 0) {
                if (found >= 0)
                    return -1;      /* a prefix of two UUIDs names neither */
                found = h;
            }
        }
        return found;
    }
    long v = 0;
    for (size_t i = 0; i < n; i++) {
        if (e[i] < '0' || e[i] > '9' || v > SI_MAX_DEV)
            return -1;
        v = v * 10 + (e[i] - '0');
    }
    return v < nhost ? order[v] : -1;
}

int standin_visible(int nhost, int *host)
{
    int order[SI_MAX_DEV];
    const char *o = getenv("CUDA_DEVICE_ORDER");
    const char *f = getenv("CONVGPU_STANDIN_FAST");
    int fast = (f && *f && !(o && strcmp(o, "PCI_BUS_ID") == 0)) ? atoi(f) : -1;
    int n = 0;
    if (fast >= 0 && fast < nhost)
        order[n++] = fast;
    for (int h = 0; h < nhost; h++)
        if (h != order[0] || n == 0)
            order[n++] = h;
    const char *cvd = getenv("CUDA_VISIBLE_DEVICES");
    if (!cvd) {
        memcpy(host, order, sizeof(int) * nhost);
        return nhost;
    }
    int count = 0;
    for (const char *e = cvd; count < nhost;) {
        size_t len = strcspn(e, ",");
        int h = entry_host(e, len, order, nhost);
        for (int i = 0; i < count && h >= 0; i++)
            if (host[i] == h)
                h = -1;             /* a GPU listed twice ends the list */
        if (h < 0)
            break;
        host[count++] = h;
        if (!e[len])
            break;
        e += len + 1;
    }
    return count;
}

void standin_open_nodes(const int *host, int n)
{
    const char *dir = getenv("CONVGPU_STANDIN_DEVNODES");
    if (!dir || !*dir)
        return;
    /* the driver's order: the control node, UVM (CUDA's, not NVML's), then each GPU; absent
     * ones are skipped (tests/security/test_row33_1_driver_by_another_name.py makes them) */
    const char *common[] = {"nvidiactl", "nvidia-uvm"};
    for (int i = 0; i < 2; i++) {
        char path[512];
        if (snprintf(path, sizeof path, "%s/%s", dir, common[i]) < (int)sizeof path)
            (void)open(path, O_RDONLY | O_CLOEXEC);   /* kept open for the process's life */
    }
    for (int i = 0; i < n; i++) {
        char path[512];
        if (snprintf(path, sizeof path, "%s/nvidia%d", dir, host[i]) < (int)sizeof path)
            (void)open(path, O_RDONLY | O_CLOEXEC);   /* kept open for the process's life */
    }
}
