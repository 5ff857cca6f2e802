/* Uprobe programs for the CUDA level: the CUDA runtime's and driver's calls a process makes
 * (launches, copies, sets, allocations, syncs, graphs), each attributed to what its engine
 * had open on the thread (open_spans, kept by the engine's programs).
 *
 * Launches and graph launches are probed at entry only (what they carry is in their
 * arguments; their host time is small). Copies, sets, syncs and allocations are probed at
 * entry and return: the host time a synchronous copy or a sync blocks is the point, and an
 * allocation's pointer exists only at return. Without a timeline (cfg.timeline 0), launches,
 * copies, sets and syncs are counted in `agg`; allocations, frees, graph and registration
 * calls are always sent (they are few, and live memory needs each), and so are copies of
 * kind Default (user space resolves their direction from the allocations it saw).
 * Attach cookies need Linux 5.15.
 */
#define PI_ENGINE_EVENTS "cuda.h"
#include "common.bpf.h"

char LICENSE[] SEC("license") = "GPL";

struct {
    __uint(type, BPF_MAP_TYPE_ARRAY);
    __uint(max_entries, PC_MAX_APIS);
    __type(key, u32);
    __type(value, struct pc_api_spec);
} api_specs SEC(".maps");

/* A call between its entry and its return, per thread. */
struct pending_call {
    struct pc_call call;
    u64 args[9];              /* the integer argument slots at entry */
};

/* LRU: a thread that dies inside a call leaves its entry, the least recently used go first. */
struct {
    __uint(type, BPF_MAP_TYPE_LRU_HASH);
    __uint(max_entries, 16384);
    __type(key, u32);
    __type(value, struct pending_call);
} pending SEC(".maps");

struct {
    __uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
    __uint(max_entries, 1);
    __type(key, u32);
    __type(value, struct pending_call);
} scratch SEC(".maps");

struct {
    __uint(type, BPF_MAP_TYPE_HASH);
    __uint(max_entries, 65536);
    __type(key, struct pc_agg_key);
    __type(value, struct pc_agg_value);
} agg SEC(".maps");

/* Streams being captured into a graph: {tgid, stream} -> 1. */
struct capture_key {
    u32 tgid;
    u32 pad;
    u64 stream;
};

struct {
    __uint(type, BPF_MAP_TYPE_HASH);
    __uint(max_entries, 1024);
    __type(key, struct capture_key);
    __type(value, u32);
} capturing SEC(".maps");

struct {
    __uint(type, BPF_MAP_TYPE_HASH);
    __uint(max_entries, PI_MAX_FOLLOWED);
    __type(key, u32);
    __type(value, struct pc_runtime_ranges);
} runtime_ranges SEC(".maps");

/* Tallies: nested driver calls skipped, aggregation keys refused (map full), calls whose
 * entry was not seen at return (or was overwritten by a probed call inside it), entries
 * the pending map refused. */
#define PC_TALLY_NESTED 0
#define PC_TALLY_AGG_FULL 1
#define PC_TALLY_UNPAIRED 2
#define PC_TALLY_PENDING_FULL 3
struct {
    __uint(type, BPF_MAP_TYPE_ARRAY);
    __uint(max_entries, 4);
    __type(key, u32);
    __type(value, u64);
} tallies SEC(".maps");

static __always_inline void tally(u32 which)
{
    tally_in(&tallies, which);
}

static __always_inline u32 read_u32(u64 addr)
{
    u32 v = 0;
    bpf_probe_read_user(&v, sizeof(v), (void *)addr);
    return v;
}

/* The integer argument slots at entry: six registers, then the stack above the return
 * address; slots[8] is the return address itself. */
static __always_inline void read_slots(struct pt_regs *ctx, u64 *slots)
{
    slots[0] = PT_REGS_PARM1(ctx);
    slots[1] = PT_REGS_PARM2(ctx);
    slots[2] = PT_REGS_PARM3(ctx);
    slots[3] = PT_REGS_PARM4(ctx);
    slots[4] = PT_REGS_PARM5(ctx);
    slots[5] = PT_REGS_PARM6(ctx);
    u64 sp = PT_REGS_SP(ctx);
    u64 stack[3] = {};
    bpf_probe_read_user(stack, sizeof(stack), (void *)sp);
    slots[8] = stack[0];
    slots[6] = stack[1];
    slots[7] = stack[2];
}

static __always_inline u64 slot(const u64 *slots, u8 i)
{
    return i < 8 ? slots[i & 7] : 0;
}

/* The engine's open span on this thread (transport.h), into the call. */
static __always_inline void attribute(struct pc_call *c, u32 tid)
{
    struct pi_open_span *s = bpf_map_lookup_elem(&open_spans, &tid);
    if (!s)
        return;
    c->step = s->step;
    c->engine = s->engine;
    if (s->step_start_ns)
        c->flags |= PC_STEP_OPEN;
    if (s->op_start_ns) {
        c->flags |= PC_OP_OPEN;
        c->op = s->op;
        c->op_start_ns = s->op_start_ns;
    }
}

/* A driver call made from a CUDA runtime's own code (the runtime launching through the
 * driver): counted once, as the runtime call it serves. */
static __always_inline int from_runtime(u32 tgid, u64 caller)
{
    struct pc_runtime_ranges *r = bpf_map_lookup_elem(&runtime_ranges, &tgid);
    if (!r)
        return 0;
#pragma unroll
    for (int i = 0; i < PC_RUNTIME_RANGES; i++)
        if (caller >= r->start[i] && caller < r->end[i])
            return 1;
    return 0;
}

#define PC_MEMCPY_DEFAULT 4   /* cudaMemcpyDefault: the pointers say which way it went */

static __always_inline int sent_always(const struct pc_call *c, u8 cls)
{
    return cls == PC_MALLOC || cls == PC_FREE || cls == PC_GRAPH_INSTANTIATE
        || cls == PC_CAPTURE_BEGIN || cls == PC_CAPTURE_END || cls >= PC_GET_KERNEL
        || ((cls == PC_MEMCPY || cls == PC_MEMCPY_2D) && c->copy_kind == PC_MEMCPY_DEFAULT);
}

/* One more call under `k` in `agg`. */
static __always_inline void count(struct pc_agg_key *k, u64 took, u64 bytes)
{
    struct pc_agg_value *v = bpf_map_lookup_elem(&agg, k);
    if (!v) {
        struct pc_agg_value zero = {};
        if (bpf_map_update_elem(&agg, k, &zero, BPF_NOEXIST) && bpf_map_lookup_elem(&agg, k) == 0) {
            tally(PC_TALLY_AGG_FULL);
            return;
        }
        v = bpf_map_lookup_elem(&agg, k);
        if (!v)
            return;
    }
    __sync_fetch_and_add(&v->calls, 1);
    __sync_fetch_and_add(&v->total_ns, took);
    __sync_fetch_and_add(&v->bytes, bytes);
    if (took > v->max_ns)
        v->max_ns = took;     /* racy between threads: a maximum, not a sum */
}

/* Send the call, or count it in `agg`. */
static __always_inline void finish(void *ctx, struct pc_call *c, u8 cls)
{
    if (cfg.timeline || sent_always(c, cls)) {
        u32 size = cls >= PC_MODULE_FUNCTION ? sizeof(*c) : offsetof(struct pc_call, name);
        if (emit(ctx, c, size))
            count_lost(1);
        return;
    }
    struct pc_agg_key k = {
        .tgid = c->tgid, .api = c->api, .handle = c->handle, .stream = c->stream,
        .grid = {c->grid[0], c->grid[1], c->grid[2]},
        .block = {c->block[0], c->block[1], c->block[2]},
        .shmem = c->shmem, .copy_kind = c->copy_kind, .op = c->op, .engine = c->engine,
        .flags = c->flags & (PC_CAPTURED | PC_OP_OPEN), .ret = c->ret,
    };
    count(&k, c->end_ns ? c->end_ns - c->start_ns : 0, c->bytes);
}

/* The governor took the process's per-call detail away (PC_FOLLOW_COUNTS_ONLY). */
static __always_inline int counts_only(u32 tgid)
{
    if (!cfg.transport.follow)
        return 0;
    u32 *v = bpf_map_lookup_elem(&followed, &tgid);
    return v && (*v & PC_FOLLOW_COUNTS_ONLY);
}

static __always_inline struct pending_call *scratch_call(void)
{
    u32 zero = 0;
    struct pending_call *p = bpf_map_lookup_elem(&scratch, &zero);
    if (p)
        __builtin_memset(&p->call, 0, sizeof(p->call));
    return p;
}

static __always_inline void mark_captured(struct pc_call *c)
{
    struct capture_key k = {.tgid = c->tgid, .stream = c->stream};
    if (bpf_map_lookup_elem(&capturing, &k))
        c->flags |= PC_CAPTURED;
}

/* Entry-only functions: launches, graph launches, registrations. */
SEC("uprobe")
int cuda_enter_only(struct pt_regs *ctx)
{
    if (!in_target())
        return 0;
    u32 api = (u32)bpf_get_attach_cookie(ctx);
    struct pc_api_spec *spec = bpf_map_lookup_elem(&api_specs, &api);
    struct pending_call *p = scratch_call();
    if (!spec || !p)
        return 0;
    struct pc_call *c = &p->call;
    u64 *a = p->args;
    read_slots(ctx, a);
    u64 id = bpf_get_current_pid_tgid();
    c->tgid = id >> 32;
    c->tid = (u32)id;
    if (spec->cls == PC_DRV_LAUNCH || spec->cls == PC_LAUNCH_CONFIG || spec->cls == PC_GRAPH_LAUNCH) {
        if (from_runtime(c->tgid, a[8])) {
            tally(PC_TALLY_NESTED);
            return 0;
        }
    }
    if (spec->cls <= PC_GRAPH_LAUNCH && counts_only(c->tgid)) {
        /* by function alone: no arguments, open op or capture looked up */
        struct pc_agg_key k = {.tgid = c->tgid, .api = api};
        count(&k, 0, 0);
        return 0;
    }
    c->kind = PC_EV_CALL;
    c->api = api;
    c->start_ns = bpf_ktime_get_ns();
    c->caller = a[8];
    switch (spec->cls) {
    case PC_LAUNCH:
        c->handle = a[0];
        c->grid[0] = (u32)a[1];
        c->grid[1] = (u32)(a[1] >> 32);
        c->grid[2] = (u32)a[2];
        c->block[0] = (u32)a[3];
        c->block[1] = (u32)(a[3] >> 32);
        c->block[2] = (u32)a[4];
        c->shmem = (u32)a[6];
        c->stream = a[7];
        break;
    case PC_LAUNCH_CONFIG: {
        u32 dims[7] = {};
        bpf_probe_read_user(dims, sizeof(dims), (void *)a[0]);
        c->grid[0] = dims[0];
        c->grid[1] = dims[1];
        c->grid[2] = dims[2];
        c->block[0] = dims[3];
        c->block[1] = dims[4];
        c->block[2] = dims[5];
        c->shmem = dims[6];
        c->stream = read_u64(a[0] + 32);
        c->handle = a[1];
        break;
    }
    case PC_DRV_LAUNCH:
        c->handle = a[0];
        c->grid[0] = (u32)a[1];
        c->grid[1] = (u32)a[2];
        c->grid[2] = (u32)a[3];
        c->block[0] = (u32)a[4];
        c->block[1] = (u32)a[5];
        c->block[2] = (u32)a[6];
        c->shmem = (u32)a[7];
        c->stream = read_u64(PT_REGS_SP(ctx) + 24);     /* 9th argument */
        break;
    case PC_GRAPH_LAUNCH:
        c->handle = a[0];
        c->stream = a[1];
        break;
    case PC_REGISTER_FUNCTION:
        /* at start-up the name's page may not be in yet (BPF cannot fault it in): its
         * address goes too, for user space to read */
        c->ptr2 = a[1];
        c->ptr = a[3];
        bpf_probe_read_user_str(c->name, sizeof(c->name), (void *)a[3]);
        break;
    default:
        return 0;
    }
    if (spec->cls <= PC_GRAPH_LAUNCH)
        mark_captured(c);
    attribute(c, c->tid);
    finish(ctx, c, spec->cls);
    return 0;
}

/* Entry of a function probed at return too: its arguments, until then. */
SEC("uprobe")
int cuda_enter(struct pt_regs *ctx)
{
    if (!in_target())
        return 0;
    struct pending_call *p = scratch_call();
    if (!p)
        return 0;
    u64 id = bpf_get_current_pid_tgid();
    u32 tid = (u32)id;
    p->call.kind = PC_EV_CALL;
    p->call.api = (u32)bpf_get_attach_cookie(ctx);
    p->call.tgid = id >> 32;
    p->call.tid = tid;
    read_slots(ctx, p->args);
    p->call.caller = p->args[8];
    attribute(&p->call, tid);
    p->call.start_ns = bpf_ktime_get_ns();
    if (bpf_map_update_elem(&pending, &tid, p, BPF_ANY))
        tally(PC_TALLY_PENDING_FULL);
    return 0;
}

SEC("uretprobe")
int cuda_return(struct pt_regs *ctx)
{
    u64 now = bpf_ktime_get_ns();
    u32 tid = current_tid();
    struct pending_call *p = bpf_map_lookup_elem(&pending, &tid);
    if (!p)
        return 0;     /* not a followed process, or its entry came before attach */
    u32 api = (u32)bpf_get_attach_cookie(ctx);
    struct pc_api_spec *spec = bpf_map_lookup_elem(&api_specs, &api);
    if (!spec || p->call.api != api) {
        tally(PC_TALLY_UNPAIRED);
        bpf_map_delete_elem(&pending, &tid);
        return 0;
    }
    struct pc_call *c = &p->call;
    const u64 *a = p->args;
    c->end_ns = now;
    c->ret = (s32)PT_REGS_RC(ctx);
    c->stream = spec->stream_slot == PC_NO_SLOT ? 0 : slot(a, spec->stream_slot);
    switch (spec->cls) {
    case PC_MEMCPY:
        c->ptr = a[0];
        c->ptr2 = a[1];
        c->bytes = a[2];
        c->copy_kind = (u32)a[3];
        mark_captured(c);       /* an async copy on a capturing stream is recorded, not run */
        break;
    case PC_MEMCPY_2D:
        c->ptr = a[0];
        c->ptr2 = a[2];
        c->bytes = a[4] * a[5];
        c->copy_kind = (u32)a[6];
        mark_captured(c);
        break;
    case PC_MEMSET:
        c->ptr = a[0];
        c->bytes = a[2];
        mark_captured(c);
        break;
    case PC_MALLOC:
        c->bytes = a[1];
        c->ptr = read_u64(a[0]);
        c->handle = a[0];
        c->copy_kind = spec->memory;
        break;
    case PC_FREE:
        c->ptr = a[0];
        c->copy_kind = spec->memory;
        break;
    case PC_SYNC:
        c->handle = spec->handle_slot == PC_NO_SLOT ? 0 : slot(a, spec->handle_slot);
        break;
    case PC_STREAM_WAIT:
        c->stream = a[0];
        c->handle = a[1];
        break;
    case PC_CAPTURE_BEGIN: {      /* the stream captures from now on, if the runtime agreed */
        c->stream = a[0];
        struct capture_key k = {.tgid = c->tgid, .stream = c->stream};
        u32 one = 1;
        if (c->ret == 0)
            bpf_map_update_elem(&capturing, &k, &one, BPF_ANY);
        break;
    }
    case PC_CAPTURE_END: {
        c->stream = a[0];
        c->ptr = read_u64(a[1]);
        struct capture_key k = {.tgid = c->tgid, .stream = c->stream};
        bpf_map_delete_elem(&capturing, &k);
        break;
    }
    case PC_GRAPH_INSTANTIATE:
        c->ptr = read_u64(a[0]);
        c->handle = a[1];
        break;
    case PC_GET_KERNEL:
        c->ptr = read_u64(a[0]);
        c->ptr2 = a[1];
        break;
    case PC_MODULE_FUNCTION:
        c->ptr = read_u64(a[0]);
        c->handle = a[1];
        bpf_probe_read_user_str(c->name, sizeof(c->name), (void *)a[2]);
        break;
    default:
        break;
    }
    finish(ctx, c, spec->cls);
    bpf_map_delete_elem(&pending, &tid);
    return 0;
}
