/* libcredit.so: the enforcer's side of the credit page (credit.h). Python has no atomic
 * read-modify-write on shared memory, and the shim takes from the same words at any moment:
 * a plain read-then-write here could hand out bytes the shim had just taken. Loaded with
 * ctypes by enforcer/credit.py. */
#include "credit.h"

#define EXPORT __attribute__((visibility("default")))

EXPORT void convgpu_credit_give(uint64_t *word, uint64_t n)
{
    __atomic_fetch_add(word, n, __ATOMIC_SEQ_CST);
}

EXPORT uint64_t convgpu_credit_take_all(uint64_t *word)
{
    return __atomic_exchange_n(word, 0, __ATOMIC_SEQ_CST);
}
