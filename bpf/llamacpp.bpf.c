/* Uprobe programs for llama.cpp / ggml: token, graph and op levels.
 *
 * Compiled by BCC at attach time with the target's struct offsets as macros:
 *   T_OFF_TYPE T_OFF_NE T_OFF_OP T_OFF_NAME   ggml_tensor fields (DWARF or a validated table)
 *   CG_OFF_N_NODES                            ggml_cgraph.n_nodes
 *   TOKEN_SP_OFF                              where llama_batch sits relative to sp at the probe
 *   BEXT_OFF_TOKENS BEXT_TOKEN_SIZE           llama_batch_ext.tokens (a std::vector) and its element size
 *   RINGBUF_PAGES RINGBUF_WAKE_BYTES          ring size; fill level that wakes the collector early
 * Per-thread state lives in hash maps keyed by TID, so no two threads ever share a slot
 * (uprobe programs may be preempted, so per-CPU scratch would not be safe).
 */
#include <uapi/linux/ptrace.h>
#include "events.h"

BPF_ARRAY(lost, u64, 1);

BPF_HASH(token_open, u32, struct pi_token_event, 4096);
BPF_HASH(graph_open, u64, struct pi_graph_event, 4096);

struct op_thread {
    struct pi_op_batch batch;   /* finished ops not yet sent */
    struct pi_op_event cur;     /* the node this thread is computing */
    u32 has_cur;
    u32 pad;
};
BPF_HASH(op_threads, u32, struct op_thread, 4096);
/* Zeroed template for a thread's first op: too large for the BPF stack. */
BPF_PERCPU_ARRAY(op_thread_zero, struct op_thread, 1);

static __always_inline void count_lost(u64 n)
{
    int k = 0;
    u64 *v = lost.lookup(&k);
    if (v)
        __sync_fetch_and_add(v, n);
}

#ifdef PI_PERF_BUFFER
/* Kernels before 5.8 have no ring buffer: per-CPU perf buffers, whose wakeups user space
 * batches with wakeup_events. */
BPF_PERF_OUTPUT(events);
#else
BPF_RINGBUF_OUTPUT(events, RINGBUF_PAGES);
#endif

/* Wake the collector only when the ring is filling up: it drains the ring on a timer, and a
 * wakeup per record would preempt an inference thread on a busy machine every time.
 * unread_bytes counts what was submitted since the collector's last drain (it zeroes it). */
BPF_ARRAY(unread_bytes, u64, 1);

static __always_inline u64 wakeup_flag(u64 size)
{
    int k = 0;
    u64 *v = unread_bytes.lookup(&k);
    if (!v)
        return 0;
    u64 before = __sync_fetch_and_add(v, size);
    return before < RINGBUF_WAKE_BYTES && before + size >= RINGBUF_WAKE_BYTES
        ? BPF_RB_FORCE_WAKEUP : BPF_RB_NO_WAKEUP;
}

/* Send one record to user space; 0 on success. */
static __always_inline int emit(struct pt_regs *ctx, void *data, u32 size)
{
#ifdef PI_PERF_BUFFER
    return events.perf_submit(ctx, data, size);
#else
    return events.ringbuf_output(data, size, wakeup_flag(size));
#endif
}

static __always_inline u32 current_tid(void)
{
    return (u32)bpf_get_current_pid_tgid();
}

/* ---- token level: llama_decode(ctx, struct llama_batch batch) ---- */

int token_enter(struct pt_regs *ctx)
{
    u32 tid = current_tid();
    struct pi_token_event ev = {};
    ev.kind = PI_EV_TOKEN;
    ev.tid = tid;
    ev.start_ns = bpf_ktime_get_ns();
    /* The batch struct is passed by value in memory; n_tokens is its first field. */
    bpf_probe_read_user(&ev.n_tokens, sizeof(ev.n_tokens), (void *)(PT_REGS_SP(ctx) + TOKEN_SP_OFF));
    token_open.update(&tid, &ev);
    return 0;
}

/* llama_context::decode(const llama_batch_ext &): n_tokens is tokens.size(). */
int token_enter_ext(struct pt_regs *ctx)
{
    u32 tid = current_tid();
    struct pi_token_event ev = {};
    u64 vec[2] = {};   /* std::vector: begin, end */
    ev.kind = PI_EV_TOKEN;
    ev.tid = tid;
    ev.start_ns = bpf_ktime_get_ns();
    bpf_probe_read_user(vec, sizeof(vec), (void *)(PT_REGS_PARM2(ctx) + BEXT_OFF_TOKENS));
    ev.n_tokens = vec[1] > vec[0] ? (s32)((vec[1] - vec[0]) / BEXT_TOKEN_SIZE) : 0;
    token_open.update(&tid, &ev);
    return 0;
}

int token_return(struct pt_regs *ctx)
{
    u32 tid = current_tid();
    struct pi_token_event *ev = token_open.lookup(&tid);
    if (!ev)
        return 0;
    ev->end_ns = bpf_ktime_get_ns();
    ev->ret = (s32)PT_REGS_RC(ctx);
    if (emit(ctx, ev, sizeof(*ev)))
        count_lost(1);
    token_open.delete(&tid);
    return 0;
}

/* ---- graph level: f(backend_or_sched, struct ggml_cgraph *) ---- */

static __always_inline int graph_enter(struct pt_regs *ctx, u32 probe, int has_backend)
{
    u32 tid = current_tid();
    u64 key = ((u64)tid << 32) | probe;
    struct pi_graph_event ev = {};
    ev.kind = PI_EV_GRAPH;
    ev.tid = tid;
    ev.probe = probe;
    ev.start_ns = bpf_ktime_get_ns();
    ev.graph = PT_REGS_PARM2(ctx);
    bpf_probe_read_user(&ev.n_nodes, sizeof(ev.n_nodes), (void *)(ev.graph + CG_OFF_N_NODES));
    if (has_backend) {
        /* struct ggml_backend { ggml_guid_t guid; struct ggml_backend_i iface; ... }:
         * iface.get_name is the first member of iface. */
        bpf_probe_read_user(&ev.name_fn, sizeof(ev.name_fn), (void *)(PT_REGS_PARM1(ctx) + 8));
    }
    graph_open.update(&key, &ev);
    return 0;
}

static __always_inline int graph_return(struct pt_regs *ctx, u32 probe)
{
    u64 key = ((u64)current_tid() << 32) | probe;
    struct pi_graph_event *ev = graph_open.lookup(&key);
    if (!ev)
        return 0;
    ev->end_ns = bpf_ktime_get_ns();
    if (emit(ctx, ev, sizeof(*ev)))
        count_lost(1);
    graph_open.delete(&key);
    return 0;
}

GRAPH_HANDLERS

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
    struct op_thread *st = op_threads.lookup(&tid);
    if (!st) {
        int z = 0;
        struct op_thread *zero = op_thread_zero.lookup(&z);
        if (!zero)
            return 0;
        op_threads.update(&tid, zero);
        st = op_threads.lookup(&tid);
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
    bpf_probe_read_user(&ev->op, sizeof(ev->op), t + T_OFF_OP);
    bpf_probe_read_user(&ev->type, sizeof(ev->type), t + T_OFF_TYPE);
    bpf_probe_read_user(ev->ne, sizeof(ev->ne), t + T_OFF_NE);
    bpf_probe_read_user(ev->name, sizeof(ev->name), t + T_OFF_NAME);
    ev->fused_op = -1;
    if (fused_with)
        bpf_probe_read_user(&ev->fused_op, sizeof(ev->fused_op), fused_with + T_OFF_OP);
    st->has_cur = 1;
    return 0;
}

int op_start(struct pt_regs *ctx)
{
    return op_begin(ctx, (const void *)PT_REGS_PARM2(ctx), 0);
}

int op_start_fused(struct pt_regs *ctx)
{
    return op_begin(ctx, (const void *)PT_REGS_PARM2(ctx), (const void *)PT_REGS_PARM3(ctx));
}

int op_barrier(struct pt_regs *ctx)
{
    u32 tid = current_tid();
    struct op_thread *st = op_threads.lookup(&tid);
    if (!st || !st->has_cur)
        return 0;
    st->cur.end_ns = bpf_ktime_get_ns();
    st->cur.n_barriers++;
    return 0;
}
