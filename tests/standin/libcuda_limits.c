/*
 * libcuda_limits.c - test-only stand-in for the CUDA driver, part 3: cuCtxSetLimit and
 * cuCtxGetLimit, the device memory a context's limits take.
 *
 * What the real driver does (H200, driver 580.159.04, issue 39): a 64 KiB stack limit made
 * the process 16,632 MiB larger at the call, exactly 270,336 resident threads (132 SMs x
 * 2,048) x (65,536 - 1,024 default) bytes; a 4 GiB malloc heap took nothing at the call (the
 * heap is taken at the first launch that uses it). The stand-in has no launches, so the heap
 * and the printf FIFO are taken at the call instead (README.md says so).
 *
 * Same build rule as libcuda.c: -O0 so each exported function begins with `push %rbp`.
 */
#include "libcuda_int.h"

#define N_LIMITS 3  /* stack, printf FIFO, malloc heap: the ones that take memory */
static const uint64_t g_default[N_LIMITS] = {
    1024,       /* CU_LIMIT_STACK_SIZE: bytes per thread */
    1u << 20,   /* CU_LIMIT_PRINTF_FIFO_SIZE */
    8u << 20,   /* CU_LIMIT_MALLOC_HEAP_SIZE */
};

static uint64_t value_of(const struct obj *ctx, int limit)
{
    return ctx->limit_set & (1u << limit) ? ctx->limit[limit] : g_default[limit];
}

/* Device bytes a limit's value takes beyond the context's own; UINT64_MAX when it overflows
 * (no device has that much: the call fails with out of memory). */
static uint64_t cost(int limit, uint64_t value)
{
    uint64_t above = value > g_default[limit] ? value - g_default[limit] : 0, bytes;
    if (limit != CU_LIMIT_STACK_SIZE)
        return above;
    return __builtin_mul_overflow(above, g_resident_threads, &bytes) ? UINT64_MAX : bytes;
}

void limits_release(struct obj *ctx)
{
    for (int l = 0; l < N_LIMITS; l++)
        acct_uncharge(ctx->dev, cost(l, value_of(ctx, l)));
    ctx->limit_set = 0;
}

/* CUresult cuCtxSetLimit(CUlimit limit, size_t value): the current context's; the difference
 * in what the value takes is charged (or given back) at once. Over capacity: out of memory,
 * and the old value stays. */
API CUresult cuCtxSetLimit(CUlimit limit, size_t value)
{
    CHECK_INIT();
    if ((unsigned)limit >= N_LIMITS)
        return CUDA_ERROR_UNSUPPORTED_LIMIT;    /* none of the others take memory */
    CUresult rc;
    ctx_lock();
    struct obj *ctx = cur_ctx(&rc);         /* under the lock: not destroyed meanwhile */
    if (ctx) {
        uint64_t was = cost(limit, value_of(ctx, limit)), now = cost(limit, value);
        if (now == UINT64_MAX)
            rc = CUDA_ERROR_OUT_OF_MEMORY;
        else if (now > was)
            rc = acct_charge(ctx->dev, now - was);
        else
            acct_uncharge(ctx->dev, was - now);
        if (rc == CUDA_SUCCESS) {
            ctx->limit[limit] = value;
            ctx->limit_set |= 1u << limit;
        }
    }
    ctx_unlock();
    return rc;
}

API CUresult cuCtxGetLimit(size_t *pvalue, CUlimit limit)
{
    CHECK_INIT();
    if (!pvalue)
        return CUDA_ERROR_INVALID_VALUE;
    if ((unsigned)limit >= N_LIMITS)
        return CUDA_ERROR_UNSUPPORTED_LIMIT;
    CUresult rc;
    ctx_lock();
    struct obj *ctx = cur_ctx(&rc);
    if (ctx)
        *pvalue = value_of(ctx, limit);
    ctx_unlock();
    return rc;
}
