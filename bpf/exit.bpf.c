// exit.bpf.c (included by convgpu.bpf.c): process exit and exec. The kernel sees every exit:
// per-thread state goes at each thread's, everything a process held at its last thread's.

// Its ordinals go with it (a reused pid is another process, with another environment): the
// enforcer writes the `also` entry for every process it maps, so one lookup tells.
static __always_inline void forget_gpus(u32 tgid)
{
    u64 k = (u64)tgid << 32 | CG_GPUMAP_ALSO;
    if (!gpumap.lookup(&k))
        return;
    gpumap.delete(&k);
    for (u32 o = 0; o < CG_MAX_DEV; o++) {
        k = (u64)tgid << 32 | o;
        gpumap.delete(&k);
    }
}

static __always_inline void process_gone(u32 tgid, u16 api, u8 op)
{
    struct cg_proc *p = procs.lookup(&tgid);
    if (!p) {
        // Placed before its procs entry was made (killed while stopped at its placement: mapped,
        // no call returned): the enforcer still learns it left. Before, it never did, and under
        // --stall freezer its container stayed frozen for good (issue 33, attack 6, on the H100's
        // path: a context that waits).
        // Only at its exit: an exec keeps its placement (a shim's hello before exec, say), as
        // before, and the enforcer drops a pid at an "exec" event.
        if (op == OP_EXIT) {
            if (members.lookup(&tgid)) {
                u64 id = ((u64)tgid << 32) | tgid;
                emit_flags(id, api, op, 0, -1, 0, 0, 0, 0, wake_if_waiting());
            }
            members.delete(&tgid);  // its membership too
        }
        forget_gpus(tgid);
        return;
    }
    q_give(p->quota, Q_PROCS);
    u64 freed = 0, contexts = 0;
    s64 ctx_all = 0;                // signed: a context count may have gone below zero
    u64 *m = members.lookup(&tgid);
    // What cg_charge() put on each GPU leaves it: its own GPU's bytes and contexts there, and
    // on each GPU of its `also` all of them (second loop). Not cg_charge per GPU: 16 x 16
    // inlined bodies made this the program the verifier took longest on.
    u64 ak = (u64)tgid << 32 | CG_GPUMAP_ALSO;
    struct cg_gpumap *gm = m ? gpumap.lookup(&ak) : 0;
    u32 also = gm ? gm->also : 0;
    struct cg_gone g = {};
    for (int d = 0; d < CG_MAX_DEV; d++) {
        struct cg_usage_key k = {.tgid = tgid, .dev = d};
        struct cg_usage *u = usage.lookup(&k);
        if (u) {
            freed += u->live;
            ctx_all += u->contexts;
            if (u->contexts > 0)
                contexts += u->contexts;
            // The driver frees the bytes only when the files close (the H100: ~55 ms after this
            // tracepoint): until the enforcer saw its pidfd fire, the container still holds
            // them, so neither a sibling's call nor a resumed waiter takes their place.
            struct cg_cgstate *s = member_state(m, d, &g.container);
            struct cg_limit_key lk = {.container = g.container, .dev = d};
            struct cg_assign *a = s ? assign.lookup(&lk) : 0;
            if (a) {
                u64 c = u->live + (u->contexts > 0 ? u->contexts * a->ctx_charge : 0);
                g.charge[d] = c;
                __sync_fetch_and_add(&s->tearing, c);
            }
            if (s && !((also >> d) & 1)) {
                __sync_fetch_and_add(&s->used, -(s64)u->live);
                __sync_fetch_and_add(&s->contexts, -u->contexts);
            }
            usage.delete(&k);
        }
    }
    u64 key;
    for (int d = 0; d < CG_MAX_DEV && also; d++) {
        struct cg_cgstate *s = (also >> d) & 1 ? member_state(m, d, &key) : 0;
        if (s) {
            __sync_fetch_and_add(&s->used, -(s64)freed);
            __sync_fetch_and_add(&s->contexts, -ctx_all);
        }
    }
    forget_gpus(tgid);              // after its bytes left every GPU they counted on
    if (m)
        gone.update(&p->gen, &g);
    members.delete(&tgid);
    // Objects of this generation are swept by user space (it iterates the map); the totals
    // above are already exact, and a reused pid gets a new generation. The driver frees the
    // bytes later (when the files close): the enforcer holds them until then.
    u64 id = ((u64)tgid << 32) | tgid;
    emit_flags(id, api, op, 0, -1, p->gen, freed, contexts, 0, wake_if_waiting());
    procs.delete(&tgid);
}

TRACEPOINT_PROBE(sched, sched_process_exit)
{
    u64 id = bpf_get_current_pid_tgid();
    struct cg_thread *t = threads.lookup(&id);
    if (t) {
        release(&t->call);          // killed while stalled: its reservation goes too
        q_give(t->quota, Q_THREADS);
        curctx.delete(&id);         // made only for a thread with an entry (set_thread_ctx)
    }
    threads.delete(&id);
    held.delete(&id);
    shim_calls.delete(&id);
#ifdef HAVE_GROUP_DEAD
    if (args->group_dead)
#else
    if ((u32)id == (id >> 32))      // older kernels: the leader's exit
#endif
    {
        process_gone(id >> 32, API_sched_process_exit, OP_EXIT);
        forget_identity(id >> 32);
    }
    return 0;
}

// exec replaces the image: the driver's file descriptors close and device memory goes.
TRACEPOINT_PROBE(sched, sched_process_exec)
{
    u64 id = bpf_get_current_pid_tgid();
    curctx.delete(&id);             // a new image has no context current
    process_gone(id >> 32, API_sched_process_exec, OP_EXEC);
    forget_identity(id >> 32);
    return 0;
}
