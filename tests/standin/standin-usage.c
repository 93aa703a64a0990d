/*
 * standin-usage.c - print the stand-in driver's shared "device memory"
 * accounting, exact even right after a holder was SIGKILLed (it reaps dead
 * processes' slots first; see standin_shm.h).
 *
 * usage: standin-usage [--json] [--reset-peak] [--unlink] [--devices N]
 *   segment: $CONVGPU_STANDIN_SHM (default /convgpu-standin-v3)
 *   devices: --devices, else $CONVGPU_STANDIN_DEVICES (default 1)
 *   capacity shown: $CONVGPU_STANDIN_CAPACITY (default 80 GiB)
 *
 * Text output, one line per device then one per live process:
 *   dev=0 used=BYTES peak=BYTES capacity=BYTES
 *   proc pid=PID used=BYTES_DEV0,BYTES_DEV1,... [cp_state=1]   (1: locked by a checkpointer)
 *   checkpointed pid=PID state=S saved=BYTES_DEV0,...   (S 2 checkpointed, 3 failed: nothing
 *                                on a device, the bytes a restore needs)
 *   at_peak pid=PID used=...    (who held what when a peak last rose)
 * --json: {"shm":..., "exists":true, "capacity":C,
 *          "devices":[{"dev":0,"used":U,"peak":P}],
 *          "procs":[{"pid":PID,"start_time":T,"used":[...],"cp_state":S,"saved":[...]}],
 *          "at_peak":[{"pid":PID,"start_time":T,"used":[...]}]}
 * --reset-peak: after reaping, peak := used on every device.
 * --unlink: remove the segment (the next cuInit creates a fresh one).
 * A missing segment reads as all zeros ("exists":false).  Exit 0, or 1 if
 * the segment exists but cannot be used.
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "standin_shm.h"

static uint64_t env_u64(const char *name, uint64_t dflt)
{
    const char *v = getenv(name);
    char *end;
    if (!v || !*v)
        return dflt;
    unsigned long long x = strtoull(v, &end, 0);
    return *end ? dflt : (uint64_t)x;
}

/* The non-empty slots of `slots`, as the JSON member `key` or text lines `word pid=...`; with
 * their checkpoint mailboxes `cp` (procs only): state and bytes saved. */
static void print_slots(const struct si_slot *slots, const struct si_cp *cp, const char *key,
                        const char *word, int json, int ndev)
{
    if (json)
        printf(",\"%s\":[", key);
    int first = 1;
    for (int i = 0; i < SI_NSLOTS; i++) {
        const struct si_slot *s = &slots[i];
        if (s->pid == 0)
            continue;
        /* text: a process checkpointed (or failed there) holds nothing on a device, and NVML lists
         * it no more: a line of its own, not a proc line */
        int out = cp && cp[i].state >= 2;
        if (json)
            printf("%s{\"pid\":%d,\"start_time\":%llu,\"used\":[", first ? "" : ",", s->pid,
                   (unsigned long long)s->start_time);
        else if (out)
            printf("checkpointed pid=%d state=%u saved=", s->pid, cp[i].state);
        else
            printf("%s pid=%d used=", word, s->pid);
        for (int d = 0; d < ndev; d++)
            printf("%s%llu", d ? "," : "", (unsigned long long)(out && !json ? cp[i].saved[d] : s->used[d]));
        if (cp && json) {
            printf("],\"cp_state\":%u,\"saved\":[", cp[i].state);
            for (int d = 0; d < ndev; d++)
                printf("%s%llu", d ? "," : "", (unsigned long long)cp[i].saved[d]);
        } else if (cp && cp[i].state == 1) {   /* locked: still on the device */
            printf(" cp_state=1");
        }
        printf(json ? "]}" : "\n");
        first = 0;
    }
    if (json)
        printf("]");
}

int main(int argc, char **argv)
{
    int json = 0, reset = 0, unlink_it = 0;
    int ndev = (int)env_u64("CONVGPU_STANDIN_DEVICES", 1);
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--json"))
            json = 1;
        else if (!strcmp(argv[i], "--reset-peak"))
            reset = 1;
        else if (!strcmp(argv[i], "--unlink"))
            unlink_it = 1;
        else if (!strcmp(argv[i], "--devices") && i + 1 < argc)
            ndev = atoi(argv[++i]);
        else {
            fprintf(stderr, "usage: standin-usage [--json] [--reset-peak] [--unlink]"
                            " [--devices N]\n");
            return 64;
        }
    }
    if (ndev < 1)
        ndev = 1;
    if (ndev > SI_MAX_DEV)
        ndev = SI_MAX_DEV;
    uint64_t cap = env_u64("CONVGPU_STANDIN_CAPACITY", SI_DEFAULT_CAPACITY);
    if (unlink_it) {
        shm_unlink(si_name());
        return 0;
    }

    struct si_handle h;
    static struct si_seg snap; /* copy taken under the lock */
    int rc = si_open(&h, 0);
    if (rc == -2) {
        fprintf(stderr, "standin-usage: cannot use segment %s\n", si_name());
        return 1;
    }
    int exists = rc == 0;
    if (exists) {
        if (si_lock(&h) != 0) {
            fprintf(stderr, "standin-usage: cannot lock %s\n", si_name());
            return 1;
        }
        si_reap(&h, -1);
        if (reset) {
            for (int d = 0; d < SI_MAX_DEV; d++)
                h.seg->peak[d] = h.seg->used[d];
            memcpy(h.seg->at_peak, h.seg->slots, sizeof h.seg->slots);
        }
        memcpy(&snap, h.seg, sizeof snap);
        si_unlock(&h);
    }

    if (json)
        printf("{\"shm\":\"%s\",\"exists\":%s,\"capacity\":%llu,\"devices\":[", si_name(),
               exists ? "true" : "false", (unsigned long long)cap);
    for (int d = 0; d < ndev; d++) {
        if (json)
            printf("%s{\"dev\":%d,\"used\":%llu,\"peak\":%llu}", d ? "," : "", d,
                   (unsigned long long)snap.used[d], (unsigned long long)snap.peak[d]);
        else
            printf("dev=%d used=%llu peak=%llu capacity=%llu\n", d,
                   (unsigned long long)snap.used[d], (unsigned long long)snap.peak[d],
                   (unsigned long long)cap);
    }
    if (json)
        printf("]");
    print_slots(snap.slots, snap.cp, "procs", "proc", json, ndev);
    print_slots(snap.at_peak, NULL, "at_peak", "at_peak", json, ndev);
    if (json)
        printf("}\n");
    return 0;
}
