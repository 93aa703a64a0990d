/* The credit page: what a shim process may allocate without asking the enforcer, one word per
 * device. The enforcer makes one page per process (a sealed memfd, passed with the hello
 * reply); the shim takes from a word with compare-and-swap before each allocation and asks
 * only when the word is short. The enforcer gives to a word, and takes back what is left, with
 * the atomic read-modify-writes of credit.c, so a take-back returns exactly what was not taken.
 * enforcer/credit.py mirrors this layout. */
#include <stdint.h>

#define CREDIT_DEVICES 64

struct credit_page {
    uint64_t id;          /* written last by the enforcer; one per page, named in the hello reply */
    uint64_t dev_page;    /* charged sizes: above `small`, whole device pages (probes/ledger.py footprint) */
    uint64_t small;
    uint64_t credit[CREDIT_DEVICES];
};

static inline uint64_t credit_footprint(const struct credit_page *c, uint64_t size)
{
    return size > c->small ? (size + c->dev_page - 1) & ~(c->dev_page - 1) : size;
}
