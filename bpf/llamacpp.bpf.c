/* Uprobe programs for llama.cpp / ggml: token, graph and op levels.
 *
 * Compiled once, ahead of time (profinfer/bpfobj.py), into a BPF object that libbpf loads in
 * milliseconds; what differs between targets (struct offsets, ring size) is in `cfg`, written
 * into the object's .rodata before it loads, so the verifier sees constants.
 * Build with -DPI_PERF_BUFFER for kernels without the BPF ring buffer (before 5.8).
 *
 * Per-thread state lives in hash maps keyed by TID, so no two threads ever share a slot
 * (uprobe programs may be preempted, so per-CPU scratch would not be safe).
 */
#include <linux/types.h>
#include <linux/bpf.h>
#include <linux/ptrace.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_tracing.h>

typedef __u16 u16;
typedef __u32 u32;
typedef __s32 s32;
typedef __u64 u64;
typedef __s64 s64;

#include "events.h"

char LICENSE[] SEC("license") = "GPL";

const volatile struct pi_config cfg = {};

struct {
    __uint(type, BPF_MAP_TYPE_ARRAY);
    __uint(max_entries, 1);
    __type(key, u32);
    __type(value, u64);
} lost SEC(".maps");

struct {
    __uint(type, BPF_MAP_TYPE_HASH);
    __uint(max_entries, 4096);
    __type(key, u32);
    __type(value, struct pi_token_event);
} token_open SEC(".maps");

struct {
    __uint(type, BPF_MAP_TYPE_HASH);
    __uint(max_entries, 4096);
    __type(key, u64);
    __type(value, struct pi_graph_event);
} graph_open SEC(".maps");

struct op_thread {
    struct pi_op_batch batch;   /* finished ops not yet sent */
    struct pi_op_event cur;     /* the node this thread is computing */
    u32 has_cur;
    u32 pad;
};

struct {
    __uint(type, BPF_MAP_TYPE_HASH);
    __uint(max_entries, 4096);
    __type(key, u32);
    __type(value, struct op_thread);
} op_threads SEC(".maps");

/* Zeroed template for a thread's first op: too large for the BPF stack. */
struct {
    __uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
    __uint(max_entries, 1);
    __type(key, u32);
    __type(value, struct op_thread);
} op_thread_zero SEC(".maps");

static __always_inline void count_lost(u64 n)
{
    u32 k = 0;
    u64 *v = bpf_map_lookup_elem(&lost, &k);
    if (v)
        __sync_fetch_and_add(v, n);
}

#ifdef PI_PERF_BUFFER
/* Kernels before 5.8 have no ring buffer: per-CPU perf buffers, whose wakeups user space
 * batches with wakeup_events. */
struct {
    __uint(type, BPF_MAP_TYPE_PERF_EVENT_ARRAY);
    __uint(key_size, sizeof(u32));
    __uint(value_size, sizeof(u32));
} events SEC(".maps");

static __always_inline int emit(struct pt_regs *ctx, void *data, u32 size)
{
    return bpf_perf_event_output(ctx, &events, BPF_F_CURRENT_CPU, data, size);
}
#else
/* max_entries (the ring's size) is set by the collector before loading. */
struct {
    __uint(type, BPF_MAP_TYPE_RINGBUF);
    __uint(max_entries, 4096);
} events SEC(".maps");

/* Wake the collector only when the ring is filling up: it drains the ring on a timer, and a
 * wakeup per record would preempt an inference thread on a busy machine every time.
 * unread_bytes counts what was submitted since the collector's last drain (it zeroes it). */
struct {
    __uint(type, BPF_MAP_TYPE_ARRAY);
    __uint(max_entries, 1);
    __type(key, u32);
    __type(value, u64);
} unread_bytes SEC(".maps");

static __always_inline u64 wakeup_flag(u64 size)
{
    u32 k = 0;
    u64 *v = bpf_map_lookup_elem(&unread_bytes, &k);
    if (!v)
        return 0;
    u64 before = __sync_fetch_and_add(v, size);
    return before < cfg.ring_wake_bytes && before + size >= cfg.ring_wake_bytes
        ? BPF_RB_FORCE_WAKEUP : BPF_RB_NO_WAKEUP;
}

/* Send one record to user space; 0 on success. */
static __always_inline int emit(struct pt_regs *ctx, void *data, u32 size)
{
    return bpf_ringbuf_output(&events, data, size, wakeup_flag(size));
}
#endif

static __always_inline u32 current_tid(void)
{
    return (u32)bpf_get_current_pid_tgid();
}

/* ---- token level ---- */

/* llama_decode(ctx, struct llama_batch batch): the batch is passed by value in memory, and
 * n_tokens is its first field. */
SEC("uprobe")
int token_enter(struct pt_regs *ctx)
{
    u32 tid = current_tid();
    struct pi_token_event ev = {};
    ev.kind = PI_EV_TOKEN;
    ev.tid = tid;
    ev.start_ns = bpf_ktime_get_ns();
    bpf_probe_read_user(&ev.n_tokens, sizeof(ev.n_tokens),
                        (void *)(PT_REGS_SP(ctx) + cfg.token_sp_off));
    bpf_map_update_elem(&token_open, &tid, &ev, BPF_ANY);
    return 0;
}

/* llama_context::decode(const llama_batch_ext &): n_tokens is tokens.size(). */
SEC("uprobe")
int token_enter_ext(struct pt_regs *ctx)
{
    u32 tid = current_tid();
    struct pi_token_event ev = {};
    u64 vec[2] = {};   /* std::vector: begin, end */
    ev.kind = PI_EV_TOKEN;
    ev.tid = tid;
    ev.start_ns = bpf_ktime_get_ns();
    bpf_probe_read_user(vec, sizeof(vec), (void *)(PT_REGS_PARM2(ctx) + cfg.bext_off_tokens));
    u64 size = cfg.bext_token_size ? cfg.bext_token_size : 1;
    ev.n_tokens = vec[1] > vec[0] ? (s32)((vec[1] - vec[0]) / size) : 0;
    bpf_map_update_elem(&token_open, &tid, &ev, BPF_ANY);
    return 0;
}

SEC("uretprobe")
int token_return(struct pt_regs *ctx)
{
    u32 tid = current_tid();
    struct pi_token_event *ev = bpf_map_lookup_elem(&token_open, &tid);
    if (!ev)
        return 0;
    ev->end_ns = bpf_ktime_get_ns();
    ev->ret = (s32)PT_REGS_RC(ctx);
    if (emit(ctx, ev, sizeof(*ev)))
        count_lost(1);
    bpf_map_delete_elem(&token_open, &tid);
    return 0;
}

/* ---- graph level: f(backend_or_sched, struct ggml_cgraph *) ----
 * Each graph probe has its own pair of programs, so an event says which function it came
 * from (entry points take no arguments, and attach cookies need 5.15). */

static __always_inline int graph_enter(struct pt_regs *ctx, u32 probe)
{
    u32 tid = current_tid();
    u64 key = ((u64)tid << 32) | probe;
    struct pi_graph_event ev = {};
    ev.kind = PI_EV_GRAPH;
    ev.tid = tid;
    ev.probe = probe;
    ev.start_ns = bpf_ktime_get_ns();
    ev.graph = PT_REGS_PARM2(ctx);
    bpf_probe_read_user(&ev.n_nodes, sizeof(ev.n_nodes), (void *)(ev.graph + cfg.cg_off_n_nodes));
    if (cfg.graph_has_backend & (1u << probe)) {
        /* struct ggml_backend { ggml_guid_t guid; struct ggml_backend_i iface; ... }:
         * iface.get_name is the first member of iface. */
        bpf_probe_read_user(&ev.name_fn, sizeof(ev.name_fn), (void *)(PT_REGS_PARM1(ctx) + 8));
    }
    bpf_map_update_elem(&graph_open, &key, &ev, BPF_ANY);
    return 0;
}

static __always_inline int graph_return(struct pt_regs *ctx, u32 probe)
{
    u64 key = ((u64)current_tid() << 32) | probe;
    struct pi_graph_event *ev = bpf_map_lookup_elem(&graph_open, &key);
    if (!ev)
        return 0;
    ev->end_ns = bpf_ktime_get_ns();
    if (emit(ctx, ev, sizeof(*ev)))
        count_lost(1);
    bpf_map_delete_elem(&graph_open, &key);
    return 0;
}

#define GRAPH_PROBE(i) \
    SEC("uprobe") int graph_enter_##i(struct pt_regs *ctx) { return graph_enter(ctx, i); } \
    SEC("uretprobe") int graph_return_##i(struct pt_regs *ctx) { return graph_return(ctx, i); }

/* PI_MAX_GRAPH_PROBES of them */
GRAPH_PROBE(0) GRAPH_PROBE(1) GRAPH_PROBE(2) GRAPH_PROBE(3)
GRAPH_PROBE(4) GRAPH_PROBE(5) GRAPH_PROBE(6) GRAPH_PROBE(7)

/* ---- op level ----
 * A node starts when its thread enters ggml_cpu_extra_compute_forward (every unfused node
 * passes through it, including AMX/repacked matmuls) or a fused-op function. It ends at the
 * last ggml_barrier entered before the next node starts: ops such as MUL_MAT also wait at
 * barriers inside themselves, and that waiting belongs to the op. So a node is completed
 * only when the thread's next node starts (or user space drains the map at the end).
 */

static __always_inline void op_finish(struct pt_regs *ctx, struct op_thread *st, u64 now)
{
    if (!st->has_cur)
        return;
    st->has_cur = 0;
    st->cur.barrier_end_ns = now;
    if (st->cur.n_barriers == 0)          /* no barrier seen: the node ran to here */
        st->cur.end_ns = now;
    u32 i = st->batch.count;
    if (i >= PI_OP_BATCH)                 /* cannot happen; keeps the verifier's bounds */
        return;
    __builtin_memcpy(&st->batch.ev[i], &st->cur, sizeof(st->cur));
    st->batch.count = i + 1;
    if (i + 1 == PI_OP_BATCH) {
        st->batch.kind = PI_EV_OPS;
        if (emit(ctx, &st->batch, sizeof(st->batch)))
            count_lost(PI_OP_BATCH);
        st->batch.count = 0;
    }
}

static __always_inline int op_begin(struct pt_regs *ctx, const void *t, const void *fused_with)
{
    u64 now = bpf_ktime_get_ns();
    u32 tid = current_tid();
    struct op_thread *st = bpf_map_lookup_elem(&op_threads, &tid);
    if (!st) {
        u32 z = 0;
        struct op_thread *zero = bpf_map_lookup_elem(&op_thread_zero, &z);
        if (!zero)
            return 0;
        bpf_map_update_elem(&op_threads, &tid, zero, BPF_NOEXIST);
        st = bpf_map_lookup_elem(&op_threads, &tid);
        if (!st)
            return 0;
    }
    op_finish(ctx, st, now);

    struct pi_op_event *ev = &st->cur;
    ev->start_ns = now;
    ev->end_ns = 0;
    ev->barrier_end_ns = 0;
    ev->tensor = (u64)t;
    ev->tid = tid;
    ev->cpu = bpf_get_smp_processor_id();
    ev->n_barriers = 0;
    bpf_probe_read_user(&ev->op, sizeof(ev->op), t + cfg.t_off_op);
    bpf_probe_read_user(&ev->type, sizeof(ev->type), t + cfg.t_off_type);
    bpf_probe_read_user(ev->ne, sizeof(ev->ne), t + cfg.t_off_ne);
    bpf_probe_read_user(ev->name, sizeof(ev->name), t + cfg.t_off_name);
    ev->fused_op = -1;
    if (fused_with)
        bpf_probe_read_user(&ev->fused_op, sizeof(ev->fused_op), fused_with + cfg.t_off_op);
    st->has_cur = 1;
    return 0;
}

SEC("uprobe")
int op_start(struct pt_regs *ctx)
{
    return op_begin(ctx, (const void *)PT_REGS_PARM2(ctx), 0);
}

SEC("uprobe")
int op_start_fused(struct pt_regs *ctx)
{
    return op_begin(ctx, (const void *)PT_REGS_PARM2(ctx), (const void *)PT_REGS_PARM3(ctx));
}

SEC("uprobe")
int op_barrier(struct pt_regs *ctx)
{
    u32 tid = current_tid();
    struct op_thread *st = bpf_map_lookup_elem(&op_threads, &tid);
    if (!st || !st->has_cur)
        return 0;
    st->cur.end_ns = bpf_ktime_get_ns();
    st->cur.n_barriers++;
    return 0;
}
