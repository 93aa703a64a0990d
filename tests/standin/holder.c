/*
 * holder.c - a process that holds device memory and works on it, told what to do one line at a
 * time: the target of the checkpoint tests (issue 46). Linked against "libcuda.so.1" by name
 * with no rpath, like cgcaller: LD_LIBRARY_PATH=build/standin picks the stand-in (its bytes
 * kept only with CONVGPU_STANDIN_BACKED=1), and without it the real driver runs it.
 *
 * usage: holder -s SIZE [-n COUNT] [-d DEVICE] [-z]      SIZE takes a K/M/G/T suffix
 *
 * Setup: cuInit, the primary context of DEVICE (default 0) made current, a module with one
 * empty kernel (PTX: the real driver compiles it; the stand-in loads any image), then COUNT
 * (default 1) cuMemAlloc_v2 blocks that total SIZE, filled through cuMemcpyHtoD_v2 with bytes
 * of a generator seeded by the pid, and their CRC-32 kept (-z: not filled, the CRC of as many
 * zeros kept: room taken fast on a large GPU). Then, on stdout (each line flushed):
 *   ready pid=PID bytes=SIZE crc=HEX
 * and one answer per stdin line:
 *   check        cuMemcpyDtoH_v2 of every block, CRC-32 of what came back:
 *                "intact crc=HEX" (the kept one) or "corrupt crc=HEX"; no blocks: "error 1"
 *   alloc SIZE   cuMemAlloc_v2: "allocated SIZE" (held until free) or "error CODE"
 *   launch       cuLaunchKernel of the empty kernel, then cuCtxSynchronize: "launched"
 *   free         every block and every alloc freed: "freed BYTES"
 * A failed call answers "error CODE". EOF: exit 0, nothing freed (the exit frees). Bad usage:
 * status 64; a failed setup call: "error API CODE" on stderr, status 2.
 */
#define _GNU_SOURCE
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cuda_min.h"

#define CHUNK (1u << 20)
#define MAX_BLOCKS 4096
#define MAX_EXTRA 1024

/* An empty kernel, compiled by the real driver's JIT for whatever GPU it runs on. */
static const char PTX[] =
    ".version 7.0\n.target sm_75\n.address_size 64\n"
    ".visible .entry convgpu_noop()\n{\n\tret;\n}\n";

static CUdeviceptr blocks[MAX_BLOCKS];
static size_t sizes[MAX_BLOCKS];
static int nblocks;
static CUdeviceptr extra[MAX_EXTRA];
static size_t extra_size[MAX_EXTRA];
static int nextra;
static uint32_t crc_table[256];

static void crc_init(void)
{
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++)
            c = c & 1 ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        crc_table[i] = c;
    }
}

static uint32_t crc32_of(uint32_t crc, const unsigned char *p, size_t n)
{
    crc = ~crc;
    while (n--)
        crc = crc_table[(crc ^ *p++) & 0xff] ^ (crc >> 8);
    return ~crc;
}

/* xorshift64*: the pattern, a byte stream seeded by the pid */
static uint64_t rng;
static uint64_t word;
static unsigned left;

static uint64_t next(void)
{
    rng ^= rng >> 12, rng ^= rng << 25, rng ^= rng >> 27;
    return rng * 0x2545F4914F6CDD1Dull;
}

static void fill(unsigned char *p, size_t n)
{
    size_t i = 0;
    for (; !left && i + 8 <= n; i += 8) {  /* whole words while none is half used: the same bytes */
        uint64_t w = next();
        memcpy(p + i, &w, 8);
    }
    for (; i < n; i++) {
        if (!left) {
            word = next();
            left = 8;
        }
        p[i] = (unsigned char)word;
        word >>= 8, left--;
    }
}

static uint64_t parse_size(const char *s)
{
    char *end;
    unsigned long long v = strtoull(s, &end, 10);
    if (end == s)
        return 0;
    switch (*end) {
    case 'K': case 'k': v <<= 10; end++; break;
    case 'M': case 'm': v <<= 20; end++; break;
    case 'G': case 'g': v <<= 30; end++; break;
    case 'T': case 't': v <<= 40; end++; break;
    }
    return *end ? 0 : v;
}

static void say(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void say(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vprintf(fmt, ap);
    va_end(ap);
    putchar('\n');
    fflush(stdout);
}

static void must(const char *api, CUresult rc)
{
    if (rc != CUDA_SUCCESS) {
        fprintf(stderr, "error %s %d\n", api, (int)rc);
        exit(2);
    }
}

static unsigned char buf[CHUNK];

static void check(uint32_t want)
{
    if (!nblocks) {
        say("error %d", (int)CUDA_ERROR_INVALID_VALUE);
        return;
    }
    uint32_t crc = 0;
    for (int b = 0; b < nblocks; b++)
        for (size_t off = 0; off < sizes[b]; off += CHUNK) {
            size_t n = sizes[b] - off < CHUNK ? sizes[b] - off : CHUNK;
            memset(buf, 0, n);  /* a copy that brings nothing back reads as zeros */
            CUresult rc = cuMemcpyDtoH_v2(buf, blocks[b] + off, n);
            if (rc != CUDA_SUCCESS) {
                say("error %d", (int)rc);
                return;
            }
            crc = crc32_of(crc, buf, n);
        }
    say("%s crc=%08x", crc == want ? "intact" : "corrupt", crc);
}

int main(int argc, char **argv)
{
    uint64_t size = 0;
    long count = 1;
    int device = 0, opt, zeros = 0;
    while ((opt = getopt(argc, argv, "s:n:d:z")) != -1) {
        if (opt == 's')
            size = parse_size(optarg);
        else if (opt == 'n')
            count = strtol(optarg, NULL, 10);
        else if (opt == 'd')
            device = atoi(optarg);
        else if (opt == 'z')
            zeros = 1;
        else
            size = 0;
    }
    if (!size || count < 1 || count > MAX_BLOCKS || (uint64_t)count > size || optind != argc) {
        fprintf(stderr, "usage: holder -s SIZE [-n COUNT] [-d DEVICE] [-z]  (SIZE >= COUNT, COUNT <= %d)\n",
                MAX_BLOCKS);
        return 64;
    }
    crc_init();
    CUdevice dev;
    CUcontext ctx;
    CUmodule mod;
    CUfunction fn = NULL;
    must("cuInit", cuInit(0));
    must("cuDeviceGet", cuDeviceGet(&dev, device));
    must("cuDevicePrimaryCtxRetain", cuDevicePrimaryCtxRetain(&ctx, dev));
    must("cuCtxSetCurrent", cuCtxSetCurrent(ctx));
    CUresult mod_rc = cuModuleLoadData(&mod, PTX);
    if (mod_rc == CUDA_SUCCESS)
        mod_rc = cuModuleGetFunction(&fn, mod, "convgpu_noop");
    if (mod_rc != CUDA_SUCCESS)
        fprintf(stderr, "info no kernel (%d): launch answers that code\n", (int)mod_rc);

    rng = (uint64_t)getpid() * 0x9E3779B97F4A7C15ull | 1;
    uint32_t want = 0;
    nblocks = (int)count;
    for (int b = 0; b < nblocks; b++) {
        sizes[b] = size / count + ((uint64_t)b < size % count);
        must("cuMemAlloc_v2", cuMemAlloc_v2(&blocks[b], sizes[b]));
        for (size_t off = 0; off < sizes[b]; off += CHUNK) {
            size_t n = sizes[b] - off < CHUNK ? sizes[b] - off : CHUNK;
            if (zeros) {
                memset(buf, 0, n);
                want = crc32_of(want, buf, n);
                continue;
            }
            fill(buf, n);
            want = crc32_of(want, buf, n);
            must("cuMemcpyHtoD_v2", cuMemcpyHtoD_v2(blocks[b] + off, buf, n));
        }
    }
    say("ready pid=%d bytes=%llu crc=%08x", (int)getpid(), (unsigned long long)size, want);

    char line[256];
    while (fgets(line, sizeof line, stdin)) {
        char cmd[32] = "", arg[64] = "";
        if (sscanf(line, "%31s %63s", cmd, arg) < 1)
            continue;
        if (!strcmp(cmd, "check")) {
            check(want);
        } else if (!strcmp(cmd, "alloc")) {
            uint64_t n = parse_size(arg);
            CUresult rc = !n || nextra == MAX_EXTRA ? CUDA_ERROR_INVALID_VALUE
                                                    : cuMemAlloc_v2(&extra[nextra], n);
            if (rc == CUDA_SUCCESS) {
                extra_size[nextra++] = n;
                say("allocated %llu", (unsigned long long)n);
            } else {
                say("error %d", (int)rc);
            }
        } else if (!strcmp(cmd, "launch")) {
            CUresult rc = fn ? cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL) : mod_rc;
            if (rc == CUDA_SUCCESS)
                rc = cuCtxSynchronize();
            if (rc == CUDA_SUCCESS)
                say("launched");
            else
                say("error %d", (int)rc);
        } else if (!strcmp(cmd, "free")) {
            uint64_t freed = 0;
            CUresult rc = CUDA_SUCCESS;
            for (int b = 0; b < nblocks && rc == CUDA_SUCCESS; b++)
                if ((rc = cuMemFree_v2(blocks[b])) == CUDA_SUCCESS)
                    freed += sizes[b];
            for (int e = 0; e < nextra && rc == CUDA_SUCCESS; e++)
                if ((rc = cuMemFree_v2(extra[e])) == CUDA_SUCCESS)
                    freed += extra_size[e];
            nblocks = nextra = 0;
            if (rc == CUDA_SUCCESS)
                say("freed %llu", (unsigned long long)freed);
            else
                say("error %d", (int)rc);
        } else {
            say("error usage: check | alloc SIZE | launch | free");
        }
    }
    return 0;
}
