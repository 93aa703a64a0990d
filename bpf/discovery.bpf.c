// discovery.bpf.c (included by convgpu.bpf.c): nobody calls into a driver file before it is
// probed. The syscall tracepoints that stop a process at its open of a driver file or a GPU
// node (probes/discovery.py, probes/nodes.py resume it).

// ---- discovery: nobody calls into a driver file before it is probed ----
// A process that opens a file named like the driver (libcuda.so, libcuda.so.1, libcuda.so.580...)
// for reading is stopped when the open returns, before it can map the file, let alone call into
// it; the tracer checks the file's inode (/proc/PID/fd/FD), attaches the probes if it is new,
// self-tests them, and resumes it (probes/discovery.py). That is the early catch of a driver
// opened by its usual name; a copy under any other name (a memfd, /proc/self/fd/N) is caught by
// what it is, at its open of a GPU device node (below, "identity"). Stopped threads are listed
// in `held` until resumed: if the tracer dies, its watchdog resumes them all and zeroes `discovery`.

#define O_ACCMODE 3
#define NAME_MAX_BPF 256
// Nobody is stopped at an open while the tracer's loop has not run for this long: a hung loop
// (issue 24 row 3: bcc blocked on a container's FIFO) must not hold every new CUDA process.
// Beaten by every loop pass and between two attaches (probes/discovery.py); a pass of the
// enforcer takes milliseconds, attaching one driver copy well under a second.
#ifndef DISCOVERY_STALE_NS
#define DISCOVERY_STALE_NS 3000000000ULL
#endif

BPF_ARRAY(discovery, struct cg_discovery, 1);
BPF_TABLE("lru_hash", u64, u8, opening, 16384);   // threads inside an openat of a driver-named file (LRU: a thread killed inside the call never fills it)
struct cg_path { char s[NAME_MAX_BPF]; };
BPF_PERCPU_ARRAY(pathbuf, struct cg_path, 1);

static __always_inline struct cg_discovery *discovering(u32 tgid)
{
    u32 k = 0;
    struct cg_discovery *d = discovery.lookup(&k);
    return d && d->on && tgid != d->exempt && tgid != self_tgid() ? d : 0;
}

// The loop beat lately (DISCOVERY_STALE_NS). Asked after the name matched: read before it,
// the time made the verifier keep six times the states through driver_named's loop.
static __always_inline int discovery_fresh(void)
{
    u32 k = 0;
    struct cg_discovery *d = discovery.lookup(&k);
    return d && (s64)(bpf_ktime_get_ns() - d->beat_ns) <= (s64)DISCOVERY_STALE_NS;
}

// The last path component is "libcuda.so" with or without a version (".1", ".580.159.04").
// Matched from the end for each possible version length: a scan for the last '/' makes the
// verifier track its position through the whole loop and gives up (E2BIG).
static __always_inline int driver_named(const char *s, int n)
{
    const char want[] = "libcuda.so";
    int len = n - 1;                // n counts the NUL
    int w = sizeof(want) - 1;
#pragma unroll
    for (int k = 0; k < 16; k++) {  // k: the version's length
        int start = len - k - w;
        if (start < 0)
            return 0;
        if (k > 0 && s[(len - k) & (NAME_MAX_BPF - 1)] != '.')
            continue;
        if (start > 0 && s[(start - 1) & (NAME_MAX_BPF - 1)] != '/')
            continue;
        int same = 1;
#pragma unroll
        for (int j = 0; j < sizeof(want) - 1; j++)
            same &= s[(start + j) & (NAME_MAX_BPF - 1)] == want[j];
        if (same)
            return 1;
    }
    return 0;
}

// Discovery by identity (below): what a process mapped since the tracer last checked it. Its
// entries go with the process (exit.bpf.c) or its image (exec).
BPF_HASH(exec_gen, u32, u64, MAX_THREADS);   // executable mappings counted since its first GPU open
BPF_HASH(checked, u32, u64, MAX_THREADS);    // the tracer's: the exec_gen it had checked
static __always_inline void forget_identity(u32 tgid)
{
    exec_gen.delete(&tgid);
    checked.delete(&tgid);
}

#ifndef NO_OPEN_TRACEPOINTS   // a kernel without syscall tracepoints: the periodic scan only
TRACEPOINT_PROBE(syscalls, sys_enter_openat)
{
    u64 id = bpf_get_current_pid_tgid();
    if (!discovering(id >> 32) || (args->flags & O_ACCMODE) != 0)   // O_RDONLY: a loader's open
        return 0;
    u32 k = 0;
    struct cg_path *p = pathbuf.lookup(&k);
    if (!p)
        return 0;
    char *buf = p->s;
    int n = bpf_probe_read_user_str(buf, NAME_MAX_BPF, args->filename);
    if (n <= 0 || !driver_named(buf, n) || !discovery_fresh())
        return 0;
    u8 one = 1;
    opening.update(&id, &one);
    return 0;
}

// The `held` value of a stop at an open: HELD_OPEN, HELD_NODE for a GPU node, the fd in the low
// 32 bits, and this stop's stamp (the clock's low 30 bits) in the top ones. A resume reads the
// entry back after its SIGCONT and deletes it only if it is still the stop it resumed: without
// the stamp, a thread that closed the file and opened it again at once (the same fd: a reader of
// its symbols, then a dlopen) was stopped again with an equal value, its entry deleted, its
// event then taken for a stale one, and it stayed stopped for good (a pytest worker, a bench).
#define HELD_STAMP_SHIFT 34
static __always_inline void stop_at_open(u64 id, u64 fd, u64 node)
{
    u64 why = HELD_OPEN | node | (u32)fd | ((bpf_ktime_get_ns() & 0x3FFFFFFFULL) << HELD_STAMP_SHIFT);
    held.update(&id, &why);         // listed before it stops: a watchdog always finds it
    bpf_send_signal_thread(SIGSTOP);
    emit_flags(id, API_sys_openat, OP_LIB_OPEN, 0, -1, fd, node >> 33, 0, 0, BPF_RB_FORCE_WAKEUP);
}

// ---- identity: a driver is what it is, not what it is called (probes/nodes.py) ----
// An open of the GPU (a character device of NVIDIA's majors, by the device number the kernel
// has for the opened file: no path a container names decides it) stops the process unless the
// tracer checked it after its last executable mapping; the tracer then probes every file it
// maps that exports a driver entry point (or holds it: --unprobed) and resumes it. A driver
// opens the nodes in cuInit, before any call that allocates. An NVML-only tool (nvidia-smi,
// exporters) maps no driver: checked once, it is stopped again only after it maps new code.
#define HELD_NODE (1ULL << 33)      // a `held` value: stopped at its open of a GPU node
#define PROT_EXEC 4
#define SHM_EXEC 0100000
BPF_ARRAY(nodecfg, struct cg_nodes, 1);
BPF_TABLE("lru_hash", u64, u8, mapping, 16384);   // threads inside an executable mmap/mprotect/shmat

// The major of the file at fd of the current task: task->files->fdt->fd[fd]->f_inode->i_rdev,
// at the running kernel's offsets (its BTF); 0 if anything is unknown or unreadable.
static __always_inline u32 fd_major(struct cg_nodes *c, u64 fd)
{
    u64 task = bpf_get_current_task(), files = 0, fdt = 0, arr = 0, file = 0, inode = 0;
    u32 max = 0, rdev = 0;
    if (bpf_probe_read_kernel(&files, 8, (void *)(task + c->task_files)) || !files ||
        bpf_probe_read_kernel(&fdt, 8, (void *)(files + c->files_fdt)) || !fdt ||
        bpf_probe_read_kernel(&max, 4, (void *)(fdt + c->fdt_max)) || fd >= max ||
        bpf_probe_read_kernel(&arr, 8, (void *)(fdt + c->fdt_fd)) || !arr ||
        bpf_probe_read_kernel(&file, 8, (void *)(arr + fd * 8)) || !file ||
        bpf_probe_read_kernel(&inode, 8, (void *)(file + c->file_inode)) || !inode ||
        bpf_probe_read_kernel(&rdev, 4, (void *)(inode + c->inode_rdev)))
        return 0;
    return rdev >> 20;              // the kernel's dev_t: MINORBITS 20
}

static __always_inline void node_opened(u64 id, u64 fd)
{
    u32 k = 0, tgid = id >> 32;
    struct cg_nodes *c = nodecfg.lookup(&k);
    if (!c || !c->known)
        return;
    u32 major = fd_major(c, fd);
    if (!major || (major != c->major[0] && major != c->major[1]))
        return;
    if (!discovering(tgid) || !discovery_fresh())
        return;
    u64 *g = exec_gen.lookup(&tgid), *ok = checked.lookup(&tgid);
    if (g && ok && *g == *ok)
        return;                     // checked since its last executable mapping
    u64 one = 1;
    exec_gen.insert(&tgid, &one);   // counting starts before the tracer looks (full: never equal)
    stop_at_open(id, fd, HELD_NODE);
}

TRACEPOINT_PROBE(syscalls, sys_exit_openat)
{
    u64 id = bpf_get_current_pid_tgid();
    if (!opening.lookup(&id)) {
        if (args->ret >= 0)
            node_opened(id, args->ret);
        return 0;
    }
    opening.delete(&id);
    u32 tgid = id >> 32;
    if (args->ret < 0 || !discovering(tgid) || !discovery_fresh())
        return 0;
    stop_at_open(id, args->ret, 0);
    return 0;
}

// open(2) and openat2(2) reach a node too (musl's open() is SYS_open): the same check.
TRACEPOINT_PROBE(syscalls, sys_exit_open) { if (args->ret >= 0) node_opened(bpf_get_current_pid_tgid(), args->ret); return 0; }
TRACEPOINT_PROBE(syscalls, sys_exit_openat2) { if (args->ret >= 0) node_opened(bpf_get_current_pid_tgid(), args->ret); return 0; }

// Executable mappings of a process already stopped once at a GPU open, counted when the call
// returns (the mapping then exists: a check that read /proc/PID/maps before it sees a new count).
static __always_inline void mapping_enter(int exec)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32;
    if (exec && exec_gen.lookup(&tgid)) {
        u8 one = 1;
        mapping.update(&id, &one);
    }
}

static __always_inline void mapping_exit(void)
{
    u64 id = bpf_get_current_pid_tgid();
    if (!mapping.lookup(&id))
        return;
    mapping.delete(&id);
    u32 tgid = id >> 32;
    u64 *g = exec_gen.lookup(&tgid);
    if (g)
        __sync_fetch_and_add(g, 1);
}

TRACEPOINT_PROBE(syscalls, sys_enter_mmap) { mapping_enter(args->prot & PROT_EXEC); return 0; }
TRACEPOINT_PROBE(syscalls, sys_exit_mmap) { mapping_exit(); return 0; }
TRACEPOINT_PROBE(syscalls, sys_enter_mprotect) { mapping_enter(args->prot & PROT_EXEC); return 0; }
TRACEPOINT_PROBE(syscalls, sys_exit_mprotect) { mapping_exit(); return 0; }
TRACEPOINT_PROBE(syscalls, sys_enter_pkey_mprotect) { mapping_enter(args->prot & PROT_EXEC); return 0; }
TRACEPOINT_PROBE(syscalls, sys_exit_pkey_mprotect) { mapping_exit(); return 0; }
TRACEPOINT_PROBE(syscalls, sys_enter_shmat) { mapping_enter(args->shmflg & SHM_EXEC); return 0; }
TRACEPOINT_PROBE(syscalls, sys_exit_shmat) { mapping_exit(); return 0; }
#endif
