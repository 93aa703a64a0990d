/* convgpu.h: everything that crosses the kernel boundary. One definition, used by
 * convgpu.bpf.c, by probes/events.py (ctypes mirror, checked against the loaded program by
 * tests/system/test_layout.py) and by the preload shim. Fixed-width fields, explicit padding. */
#ifndef CONVGPU_H
#define CONVGPU_H

#define CONVGPU_SCHEMA 1
#define CG_MAX_DEV 16          /* GPUs per host the per-device maps cover */
#define CG_COMM_LEN 16

/* Every probed entry point, with a stable id (events carry it). Python reads this list with
 * a regex (probes/table.py), so keep one X(...) per line. */
#define CG_APIS(X)                      \
    X(cuMemAlloc_v2, 1)                 \
    X(cuMemAllocPitch_v2, 2)            \
    X(cuMemAllocManaged, 3)             \
    X(cuMemFree_v2, 4)                  \
    X(cuMemCreate, 5)                   \
    X(cuMemRelease, 6)                  \
    X(cuMemMap, 7)                      \
    X(cuMemUnmap, 8)                    \
    X(cuMemAddressReserve, 9)           \
    X(cuMemAddressFree, 10)             \
    X(cuMemAllocAsync, 11)              \
    X(cuMemAllocAsync_ptsz, 12)         \
    X(cuMemAllocFromPoolAsync, 13)      \
    X(cuMemAllocFromPoolAsync_ptsz, 14) \
    X(cuMemFreeAsync, 15)               \
    X(cuMemFreeAsync_ptsz, 16)          \
    X(cuArrayCreate_v2, 17)             \
    X(cuArray3DCreate_v2, 18)           \
    X(cuMipmappedArrayCreate, 19)       \
    X(cuArrayDestroy, 20)               \
    X(cuMipmappedArrayDestroy, 21)      \
    X(cuDevicePrimaryCtxRetain, 22)     \
    X(cuDevicePrimaryCtxRelease_v2, 23) \
    X(cuCtxCreate_v2, 24)               \
    X(cuCtxCreate_v3, 25)               \
    X(cuCtxCreate_v4, 26)               \
    X(cuCtxDestroy_v2, 27)              \
    X(cuCtxSetCurrent, 28)              \
    X(cuCtxPushCurrent_v2, 29)          \
    X(cuCtxPopCurrent_v2, 30)           \
    X(cuMemGetInfo_v2, 31)              \
    X(cuCtxSetLimit, 32)                \
    X(cuGraphAddMemAllocNode, 33)       \
    X(cuGraphAddNode, 34)               \
    X(cuGraphAddNode_v2, 35)            \
    X(cuGraphInstantiateWithFlags, 36)  \
    X(cuGraphInstantiateWithParams, 37) \
    X(cuGraphInstantiateWithParams_ptsz, 38) \
    X(cuGraphInstantiate_v2, 39)        \
    X(cudaMalloc, 40)                   \
    X(cudaMallocManaged, 41)            \
    X(cudaMallocPitch, 42)              \
    X(cudaMalloc3D, 43)                 \
    X(cudaFree, 44)                     \
    X(cudaMemGetInfo, 45)               \
    X(cuGraphExecDestroy, 46)           \
    X(cuGraphDestroy, 47)               \
    X(cuModuleLoadData, 49)             \
    X(cuModuleLoadDataEx, 50)           \
    X(cuLibraryLoadData, 52)            \
    X(cuModuleUnload, 53)               \
    X(cuLibraryUnload, 54)              \
    X(cuModuleLoad, 55)                 \
    X(cuLibraryLoadFromFile, 56)        \
    X(sched_process_exit, 60)           \
    X(sched_process_exec, 61)           \
    X(sys_openat, 62)

#define CG_API_ENUM(name, id) API_##name = id,
enum cg_api { CG_APIS(CG_API_ENUM) CG_API_MAX = 64 };

/* What an event did to the accounting. */
enum cg_op {
    OP_ALLOC = 1,       /* device bytes obtained (alloc, VMM create, array) */
    OP_FREE = 2,        /* device bytes returned */
    OP_CTX_CREATE = 3,  /* a context (primary retain or create) on a device */
    OP_CTX_DESTROY = 4,
    OP_MAP = 5,         /* VMM map/unmap, VA reserve/free: no physical bytes change */
    OP_UNMAP = 6,
    OP_RESERVE = 7,
    OP_UNRESERVE = 8,
    OP_SET_DEVICE = 9,  /* a thread's current context changed */
    OP_MEMINFO = 10,    /* cuMemGetInfo / cudaMemGetInfo */
    OP_EXIT = 11,       /* the whole process exited: all it held is gone */
    OP_EXEC = 12,       /* exec replaced the image: same as exit for the GPU */
    OP_FAILED = 13,     /* the call returned CUresult != 0: nothing accounted */
    OP_STALL = 14,      /* enforce: over its assignment, stopped before the call ran */
    OP_OVER_LIMIT = 15, /* enforce: over its limit: stopped (or killed) before the call ran */
    OP_UNKNOWN = 16,    /* enforce: a process (or device) the enforcer has not placed yet */
    OP_LIB_OPEN = 17,   /* a process opened a file named like the driver: stopped until it is probed */
    OP_QUOTA = 18,      /* enforce: its container is at a map quota (cg_quota): stopped or killed */
    OP_FULL = 19,       /* enforce: the threads map is full: the call cannot be tracked, killed */
    OP_GRAPH = 20,      /* a graph's memory nodes grew (size: its bytes now; nothing taken yet) */
    OP_UNSIZED = 21,    /* a call that may take memory no entry can size (a module from a file):
                         * the backstop (NVML) is its check */
    OP_TOUCH = 22,      /* a swapped process made a driver call: it waits to be restored (swap.bpf.c) */
};

/* Event flags. */
#define EF_ESTIMATE 0x1   /* size computed from a descriptor (arrays): the driver pads */
#define EF_UNKNOWN 0x2    /* free of an address convgpu never saw allocated */
#define EF_DEFERRED 0x4   /* VMM release of a still-mapped handle: bytes go at last unmap */
#define EF_RESTALL 0x8    /* enforce: resumed without a grant (e.g. a sibling's SIGCONT): stopped again */
#define EF_UNRECORDED 0x10 /* the object found no room in the map: see obj_add() */
#define EF_ORDINAL 0x20   /* enforce: dev is the process's CUDA ordinal, not yet mapped to a host GPU */
#define EF_RESERVED 0x40  /* enforce: a restalled call that keeps its reservation (recheck()) */
#define EF_TRACED 0x80    /* enforce: traced by another process, which can swallow a stop: killed
                           * instead (result: the tracer's pid) */

/* Ring-buffer record, 80 bytes. */
struct cg_event {
    __u64 ts_ns;      /* bpf_ktime_get_ns (CLOCK_MONOTONIC) */
    __u64 cgroup_id;  /* cgroup v2 id of the calling task */
    __u64 addr;       /* device pointer, VMM handle, array handle or context */
    __u64 size;       /* bytes allocated or freed (0 when none) */
    __u64 live;       /* the process's live bytes on this device after the event (exit, exec: its contexts) */
    __u32 tgid;
    __u32 tid;
    __s32 dev;        /* device ordinal, -1 unknown */
    __u32 result;     /* CUresult / cudaError_t */
    __u16 api;        /* enum cg_api of the driver call */
    __u16 rt_api;     /* runtime call (cudaMalloc...) in progress on this thread, or 0 */
    __u8 op;          /* enum cg_op */
    __u8 flags;       /* EF_* */
    __u8 pad[2];
    char comm[CG_COMM_LEN];
};

/* Per (process, device) accounting, exact (kept in the map, not derived from events). */
struct cg_usage_key {
    __u32 tgid;
    __s32 dev;
};
struct cg_usage {
    __u64 live;        /* bytes held now */
    __u64 peak;
    __u64 n_alloc;
    __u64 n_free;
    __u64 bytes_alloc; /* cumulative */
    __u64 bytes_free;
    __u64 n_failed;    /* calls that returned an error */
    __s64 contexts;    /* contexts held on this device */
    __u64 last_ns;     /* last event */
    __u64 gen;         /* the process generation this entry belongs to */
};

/* Per process. gen tells a reused pid from the process that held it before. */
struct cg_proc {
    __u64 gen;         /* bpf_ktime_get_ns at first sight: unique per process lifetime */
    __u64 cgroup_id;   /* cgroup at first sight: accounting stays with it */
    __s32 last_dev;    /* device of the last context made: default for threads with none */
    __u32 pad;
    char comm[CG_COMM_LEN];
    __u64 quota;       /* the cg_quota bucket its entry counts in (0: none) */
};

/* Live objects, keyed by process and namespace so handles never collide with pointers. */
/* NS_CTX: context -> device; NS_PRIMARY: device -> retained primary context (refcount in maps). */
/* Memory a call takes that is not an allocation (bpf/indirect.bpf.c): NS_LIMIT: (device << 8 |
 * CUlimit) -> what that limit takes; NS_GRAPH: graph -> the bytes of its memory nodes (not
 * charged: taken when it is instantiated); NS_GEXEC: executable graph -> its charge; NS_MODULE:
 * module or library -> its static data. */
enum cg_ns { NS_PTR = 1, NS_VMM = 2, NS_ARRAY = 3, NS_MAPPING = 4, NS_CTX = 5, NS_PRIMARY = 6,
             NS_LIMIT = 7, NS_GRAPH = 8, NS_GEXEC = 9, NS_MODULE = 10 };
struct cg_obj_key {
    __u32 tgid;
    __u32 ns;
    __u64 addr;
};
struct cg_obj {
    __u64 size;
    __u64 gen;
    __u64 ref;         /* NS_MAPPING: the VMM handle mapped there */
    __s32 dev;
    __u16 api;
    __u8 released;     /* NS_VMM: cuMemRelease seen while still mapped; NS_CTX: primary */
    __u8 pad;
    __u32 tid;         /* the thread that obtained it (enforce: what a thread holds itself) */
    __u64 maps;        /* NS_VMM: live mappings of the handle; NS_PRIMARY: retain count
                        * (64-bit: LLVM 14 has no 32-bit atomic fetch-sub for BPF) */
    __u64 quota;       /* the cg_quota bucket it counts in (0: none) */
};

/* Per-container quotas on the shared maps (issue 24 row 4: one container filled `objs` with
 * 1-byte allocations, and every other process's objects went unrecorded). While an enforcer
 * runs, each entry of objs, threads and procs counts in one bucket: its container's key once
 * the process is placed (members), else QUOTA_CGROUP | the task's cgroup id. BPF alone writes
 * cg_quota (atomics); the tracer's sweep deletes the objects of exited processes and counts
 * them in `swept` (user space alone writes it), so objs - swept is what the bucket holds. */
#define QUOTA_CGROUP (1ULL << 62)
struct cg_quota {
    __u64 objs;        /* objects put in objs (less those BPF deleted) */
    __u64 threads;
    __u64 procs;
    __u64 denied;      /* entries refused at the quota */
};

/* Enforcement. The enforcer places each process in a container (members: tgid -> key) and
 * writes cg_assign; BPF alone writes cg_cgstate (atomics), so neither side overwrites the
 * other's counters. Admission: used + contexts * ctx_charge + extra_overhead + reserved must
 * stay <= assigned, checked at the entry of every call that takes device memory. */
#define SHIM_MEMBER (1ULL << 63)   /* members value bit: managed by the preload shim */
/* gpumap: (tgid << 32 | CUDA ordinal) -> the host GPU (NVML index) that ordinal is in that
 * process; the ordinal is process-local (CUDA_VISIBLE_DEVICES, a container given one GPU).
 * Key (tgid << 32 | CG_GPUMAP_ALSO): `also`, the other host GPUs a process whose mapping the
 * kernel's evidence did not fix may be using: its bytes count there as well (probes/gpumap.py). */
#define CG_GPUMAP_ALSO 0xffffffffu
struct cg_gpumap {
    __s32 host;
    __u32 also;        /* bit d: host GPU d */
};

struct cg_limit_key {
    __u64 container;   /* the enforcer's key for the container */
    __s32 dev;
    __u32 pad;
};
struct cg_assign {     /* written by the enforcer */
    __u64 limit;       /* L_c */
    __u64 assigned;    /* A_c */
    __s64 extra_overhead;  /* NVML-measured context overhead less ctx_charge for each context
                            * it measured (negative where the estimate was high) */
    __u64 adopted;     /* live bytes its processes had when placed (BPF charged them nowhere) */
    __s64 adopted_contexts;
    __u64 ctx_charge;  /* per context on this device until NVML measures it: the device's
                        * estimate (enforcer/ctxest.py) */
    __u64 torn;        /* of cg_cgstate.tearing, what the driver has freed since (the exited
                        * processes' pidfds fired): cumulative, like tearing */
};
struct cg_cgstate {    /* written by BPF */
    __u64 used;        /* live bytes of the container's processes */
    __u64 reserved;    /* admitted or stalled calls not yet returned */
    __s64 contexts;
    __u64 stalls;
    __u64 tearing;     /* cumulative charge of the container's exited processes: the driver frees
                        * it only later (tearing - cg_assign.torn is still held) */
};
/* An exited member's charge per device, for the enforcer to give back once its pidfd fires
 * (keyed by the process's generation: a reused pid never mixes two). */
struct cg_gone {
    __u64 container;
    __u64 charge[CG_MAX_DEV];
};
struct cg_control {
    __u64 heartbeat_ns;    /* the enforcer's last sign of life (bpf_ktime_get_ns clock) */
    __u64 ctx_overhead;    /* reserved for a context call of a process not placed yet: the
                            * largest per-device estimate (placed: cg_assign.ctx_charge) */
    __u32 enforcing;
    __u32 over_limit_kill; /* 1: SIGKILL a request above the limit instead of stopping it */
    __u32 waiters;         /* containers waiting for memory: frees and exits wake the enforcer */
    __u32 owner;           /* the enforcer whose programs admit: during a take-over the old
                            * instance's programs, still attached, only account */
    __u32 quiet;           /* no view attached to the enforcer: no alloc/free events, except
                            * frees while someone waits (its numbers are in maps) */
    __u32 exempt;          /* a process admission skips: the self-test child that calls every
                            * symbol of a newly attached library (everyone else stays checked) */
    __u32 max_objs;        /* per container (cg_quota); 0: no quota */
    __u32 max_threads;
    __u32 max_procs;
    __u32 measuring;       /* the enforcer's context-measurement child (enforcer/ctxmeasure.py):
                            * admission skips it too, while a self-test child has `exempt` */
};

/* Per start, one per loaded program (never pinned): written by the tracer before any probe is
 * attached (probes/loader.py configure()). Not -D defines, so one compiled program serves
 * every start and can be cached (probes/bpfcache.py). */
struct cg_config {
    __u32 self_tgid;       /* convgpu itself: never accounted, never stopped at an open */
    __u32 owner;           /* the enforcer instance whose program this is: it admits while
                            * control.owner names it, and steps aside once another does */
    /* offsets in the running kernel's task_struct, from its BTF (probes/btf.py); 0: unknown,
     * and then BPF sees no tracer (foreign_tracer) */
    __u32 task_ptrace;
    __u32 task_parent;
    __u32 task_tgid;
    __u32 pad;
};

/* Discovery (bpf/discovery.bpf.c): written by the tracer; zeroed by the watchdog
 * when the tracer or enforcer dies, so nothing is stopped at open with nobody to resume it. */
struct cg_discovery {
    __u32 on;              /* stop a process that opens a driver-named file until it is probed */
    __u32 exempt;          /* the self-test child, which opens a library being attached */
    __u64 beat_ns;         /* the tracer's loop last ran (bpf_ktime_get_ns clock): stale, no stops */
};

/* Driver identity (bpf/discovery.bpf.c; probes/nodes.py): per start, from the running
 * kernel. An open of a character device of these majors is an open of the GPU, whatever its path. */
struct cg_nodes {
    __u32 major[2];        /* nvidia (/dev/nvidiactl, /dev/nvidiaN), nvidia-uvm; 0: none */
    __u32 known;           /* the offsets below are the running kernel's (its BTF); 0: no match */
    __u32 task_files;      /* task_struct.files */
    __u32 files_fdt;       /* files_struct.fdt */
    __u32 fdt_max;         /* fdtable.max_fds */
    __u32 fdt_fd;          /* fdtable.fd */
    __u32 file_inode;      /* file.f_inode */
    __u32 inode_rdev;      /* inode.i_rdev */
    __u32 pad;
};

/* Global counters (per-CPU array slots). */
enum cg_stat { ST_DROPS = 0, ST_UNKNOWN_FREE = 1, ST_UNCHECKED = 2, ST_UNRECORDED = 3,
               ST_OVER_QUOTA = 4, ST_MAX = 5 };

#endif
