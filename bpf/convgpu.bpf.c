// convgpu.bpf.c: account every device-memory allocation of every process, in maps.
//
// Entry uprobes save the call's arguments per thread; one return program per family settles
// the call once the driver has answered: CUresult != 0 changes nothing. Accounting lives in
// maps (exact, read by user space at any time); the ring buffer only carries events for the
// live view, without wake-ups (FACTS.md: a wake-up per event costs the caller 10-16 us).
//
// One program, in parts by concern, each included once, in this order (a part uses only what
// the parts before it define). The loader pastes each `#include "*.bpf.c"` in before bcc sees
// the source (bpf/__init__.py, source_text): bcc 0.26 rewrites map calls such as
// threads.lookup() and finds programs only in the main source it is given, so a part left to
// the preprocessor would not load. `#line` keeps compiler messages at the part's own lines.
//   maps.bpf.c ........ the call in flight, the shared maps (pinned under enforce), events
//   books.bpf.c ....... map entries and their quotas, what each container is charged
//   holds.bpf.c ....... every stop BPF makes, and the kill of a call that cannot be checked
//   indirect.bpf.c .... what a call takes that is not an allocation: limits, graphs, modules
//   admit.bpf.c ....... entry: admission, the recheck in the prologue, sizes of a call
//   account.bpf.c ..... objects, bytes and contexts in and out; the return programs
//   frees.bpf.c ....... frees and handles, settled at the return (or the entry)
//   indirect_returns.bpf.c  their returns: charged, and given back by the call that ends them
//   discovery.bpf.c ... a process opening a driver file or a GPU node waits until it is probed
//   exit.bpf.c ........ the kernel's exit and exec tracepoints release what a process held
//   swap.bpf.c ........ a swapped process's next driver call, told (attached while one is swapped)
#include <uapi/linux/ptrace.h>
#include "convgpu.h"

#include "maps.bpf.c"
#include "books.bpf.c"
#include "holds.bpf.c"
#include "indirect.bpf.c"
#include "admit.bpf.c"
#include "account.bpf.c"
#include "frees.bpf.c"
#include "indirect_returns.bpf.c"
#include "discovery.bpf.c"
#include "exit.bpf.c"
#include "swap.bpf.c"
