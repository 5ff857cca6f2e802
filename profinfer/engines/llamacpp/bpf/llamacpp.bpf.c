/* Uprobe programs for llama.cpp / ggml: token, graph and op levels.
 *
 * Compiled once, ahead of time (profinfer/core/ebpf/bpfobj.py), into a BPF object that libbpf loads in
 * milliseconds; what differs between targets (struct offsets, ring size) is in `cfg`, written
 * into the object's .rodata before it loads, so the verifier sees constants.
 * Build with -DPI_PERF_BUFFER for kernels before 5.12 (the ring buffer arrived in 5.8, the
 * atomics this build uses in 5.12).
 * No CO-RE here: this object loads on kernels without BTF.
 *
 * Per-thread state is keyed by TID (a direct slot claimed by one thread, or a hash map entry),
 * so no two threads ever share it (uprobe programs may be preempted, so per-CPU scratch would
 * not be safe).
 */
#define PI_ENGINE_EVENTS "llamacpp.h"
#include "common.bpf.h"

char LICENSE[] SEC("license") = "GPL";

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

/* Per-thread op state: struct pi_op_thread in llamacpp.h (user space drains it at the end).
 * A thread's state is the slot of op_threads_direct at its TID modulo the array's size,
 * when it could claim it (a thread's TIDs are mostly consecutive, so they rarely share one),
 * else an entry of op_threads. An array slot is found without hashing, and the handlers run
 * twice per node and thread, after the engine's data has evicted ours: the hash map's
 * bucket and element header were two cache misses a run (~0.3 µs a node here). Claiming a
 * slot takes a compare-and-swap (Linux 5.12, the ring-buffer build's minimum: the perf-buffer
 * build, for older kernels, leaves the array out). */
struct {
    __uint(type, BPF_MAP_TYPE_HASH);
    __uint(max_entries, 4096);
    __type(key, u32);
    __type(value, struct pi_op_thread);
} op_threads SEC(".maps");

struct {
    __uint(type, BPF_MAP_TYPE_ARRAY);
    __uint(max_entries, 1);            /* set by user space */
    __type(key, u32);
    __type(value, struct pi_op_thread);
} op_threads_direct SEC(".maps");

#include "counters.bpf.h"

/* PI_TALLY_* counts, per CPU: user space reports the sums (how often the generation let a run
 * skip reading a description; where thread states went). */
struct {
    __uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
    __uint(max_entries, PI_TALLIES);
    __type(key, u32);
    __type(value, u64);
} op_tallies SEC(".maps");

static __always_inline void tally(u32 which)
{
    u64 *n = bpf_map_lookup_elem(&op_tallies, &which);
    if (n)
        __sync_fetch_and_add(n, 1);   /* atomic: a preempted run may share the CPU */
}

/* A probe on a library file (record) hit in a process that is not followed: counted, so
 * that the target is not charged for it. */
static __always_inline int other_process(void)
{
    tally(PI_TALLY_OTHER_ENTRIES);
    return 0;
}

static __always_inline int other_return(void)
{
    tally(PI_TALLY_OTHER_RETURNS);
    return 0;
}

/* The floor of what a probe costs: a hit that only counts itself. The benchmark attaches it
 * at the op level's probe points instead of the op programs (PROFINFER_OP_PROBES=bare), to
 * tell the traps' cost from what the handlers, the ring and the collector add. */
SEC("uprobe")
int bare_hit(struct pt_regs *ctx)
{
    tally(PI_TALLY_BARE_HITS);
    return 0;
}

/* Zeroed template for a thread's first op: too large for the BPF stack (and, at 78 KB, for
 * a per-CPU value); nothing ever writes it, so one copy serves every CPU. Its owner is
 * PI_SLOT_RELEASING (set by user space): a direct slot zeroed from it stays unclaimable
 * until its owner is cleared, after the copy. */
struct {
    __uint(type, BPF_MAP_TYPE_ARRAY);
    __uint(max_entries, 1);
    __type(key, u32);
    __type(value, struct pi_op_thread);
} op_thread_zero SEC(".maps");

/* ---- token level ---- */

/* llama_decode(ctx, struct llama_batch batch): the batch is passed by value in memory, and
 * n_tokens is its first field. */
/* Set at the first llama_decode (a race only sends the event twice). */
u32 decoding_seen = 0;

static __always_inline void first_decode(struct pt_regs *ctx, u32 tid, u64 now)
{
    if (decoding_seen)
        return;
    decoding_seen = 1;
    struct pi_decoding_event ev = {.kind = PI_EV_DECODING, .tid = tid, .ts_ns = now};
    if (emit(ctx, &ev, sizeof(ev)))
        count_lost(1);
}

/* The phase of the decode call under way (llamacpp.h: PI_PHASE_*, as TokenCall.phase has it),
 * PI_PHASE_OTHER between calls: the op level counted in BPF keys each op with it at the
 * op's start (a process decodes one call at a time; its graph's ops run inside it). */
u32 decode_phase = 0;

static __always_inline u32 phase_of(u32 n_tokens, u32 decoding)
{
    if (decoding >= n_tokens)
        return PI_PHASE_DECODE;
    return decoding ? PI_PHASE_MIXED : PI_PHASE_PREFILL;
}

/* A decode call is the thread's open step (common.bpf.h: open_spans). */
static __always_inline void step_begins(u32 tid, u64 now)
{
    struct pi_open_span *span = open_span(tid, PI_ENGINE_LLAMACPP);
    if (span) {
        span->step++;
        span->step_start_ns = now;
    }
}

SEC("uprobe")
int token_enter(struct pt_regs *ctx)
{
    if (!in_target())
        return other_process();
    u32 tid = current_tid();
    struct pi_token_event ev = {};
    ev.kind = PI_EV_TOKEN;
    ev.tid = tid;
    ev.tgid = bpf_get_current_pid_tgid() >> 32;
    ev.start_ns = bpf_ktime_get_ns();
    bpf_probe_read_user(&ev.n_tokens, sizeof(ev.n_tokens),
                        (void *)(PT_REGS_SP(ctx) + cfg.token_sp_off));
    first_decode(ctx, tid, ev.start_ns);
    bpf_map_update_elem(&token_open, &tid, &ev, BPF_ANY);
    step_begins(tid, ev.start_ns);
    /* llama.cpp's own rule (model.py: split_batch): one token decodes, more read a prompt */
    decode_phase = phase_of((u32)ev.n_tokens, ev.n_tokens == 1);
    return 0;
}

/* The batch's tokens as runs (llamacpp.h): each token's first sequence id (the first node of
 * its std::unordered_set of ids) and position. A run ends where the sequence changes or the
 * positions stop following on. One bpf_loop step per token (Linux 5.17): a plain loop over
 * PI_BATCH_SCAN tokens exceeds what the verifier follows.
 *
 * Everything the scan changes lives in maps (the call's open record, and its scan's state),
 * none of it on the stack: the verifier tracks no value kept in a map, so the callback's
 * state repeats at its second step. Kept on the stack, each count of runs so far and each
 * branch taken was a state of its own, and 6.18.44's verifier gave up ("the sequence of
 * 8193 jumps is too complex"; before that, a million instructions). */
struct scan_state {
    s32 seq;
    s32 pos0;
    u32 n;
    u32 unread;
    u32 decoding;      /* runs kept that add one token after position 0 (split_batch) */
};

struct {
    __uint(type, BPF_MAP_TYPE_HASH);
    __uint(max_entries, 4096);
    __type(key, u32);
    __type(value, struct scan_state);
} batch_scans SEC(".maps");

struct batch_scan {
    struct pi_token_event *ev;
    struct scan_state *st;
    u64 tokens;
    u64 size;
};

static __always_inline void close_run(struct pi_token_event *ev, struct scan_state *st)
{
    u32 k = ev->n_runs;
    if (!st->n)
        return;
    if (k < PI_MAX_RUNS) {
        ev->runs[k & (PI_MAX_RUNS - 1)].seq = st->seq;
        ev->runs[k & (PI_MAX_RUNS - 1)].pos0 = st->pos0;
        ev->runs[k & (PI_MAX_RUNS - 1)].n_tokens = st->n;
        ev->n_runs = k + 1;
        if (st->n == 1 && st->pos0 > 0)
            st->decoding++;
    } else {
        st->unread += st->n;
    }
}

static long scan_token(u64 i, void *ctx)
{
    struct batch_scan *b = ctx;
    struct scan_state *st = b->st;
    u64 tok = b->tokens + i * b->size, node = 0;
    s32 seq = -1, pos = 0;
    bpf_probe_read_user(&pos, sizeof(pos), (void *)(tok + cfg.bext_tok_off_pos));
    bpf_probe_read_user(&node, sizeof(node), (void *)(tok + cfg.bext_tok_off_seq));
    if (node)
        bpf_probe_read_user(&seq, sizeof(seq), (void *)(node + cfg.seq_node_value));
    if (st->n && seq == st->seq && pos == st->pos0 + (s32)st->n) {
        st->n++;
        return 0;
    }
    close_run(b->ev, st);
    st->seq = seq;
    st->pos0 = pos;
    st->n = 1;
    return 0;
}

/* llama_context::decode(const llama_batch_ext &): n_tokens is tokens.size(). */
static __always_inline int token_enter_batch(struct pt_regs *ctx, int read_sequences)
{
    if (!in_target())
        return other_process();
    u32 tid = current_tid();
    struct pi_token_event ev = {};
    u64 vec[2] = {};   /* std::vector: begin, end */
    ev.kind = PI_EV_TOKEN;
    ev.tid = tid;
    ev.tgid = bpf_get_current_pid_tgid() >> 32;
    ev.start_ns = bpf_ktime_get_ns();
    bpf_probe_read_user(vec, sizeof(vec), (void *)(PT_REGS_PARM2(ctx) + cfg.bext_off_tokens));
    u64 size = cfg.bext_token_size ? cfg.bext_token_size : 1;
    ev.n_tokens = vec[1] > vec[0] ? (s32)((vec[1] - vec[0]) / size) : 0;
    /* without the batch's sequences, llama.cpp's rule (model.py: split_batch) */
    u32 decoding = ev.n_tokens == 1;
    first_decode(ctx, tid, ev.start_ns);
    bpf_map_update_elem(&token_open, &tid, &ev, BPF_ANY);
    struct pi_token_event *open = read_sequences ? bpf_map_lookup_elem(&token_open, &tid) : NULL;
    struct scan_state fresh = {};
    if (open && bpf_map_update_elem(&batch_scans, &tid, &fresh, BPF_ANY) == 0) {
        struct scan_state *st = bpf_map_lookup_elem(&batch_scans, &tid);
        if (st) {
            struct batch_scan b = {.ev = open, .st = st, .tokens = vec[0], .size = size};
            u32 n = (u32)ev.n_tokens < PI_BATCH_SCAN ? (u32)ev.n_tokens : PI_BATCH_SCAN;
            bpf_loop(n, scan_token, &b, 0);
            close_run(open, st);
            open->unread = st->unread + ((u32)ev.n_tokens - n);
            if (open->n_runs)
                decoding = st->decoding;
        }
        bpf_map_delete_elem(&batch_scans, &tid);
    }
    step_begins(tid, ev.start_ns);
    decode_phase = phase_of((u32)ev.n_tokens, decoding);
    return 0;
}

SEC("uprobe")
int token_enter_ext(struct pt_regs *ctx)
{
    return token_enter_batch(ctx, 0);
}

/* The same, with the batch's sequences (llamacpp.h: runs); bpf_loop needs Linux 5.17. */
SEC("uprobe")
int token_enter_ext_seqs(struct pt_regs *ctx)
{
    return token_enter_batch(ctx, 1);
}

SEC("uretprobe")
int token_return(struct pt_regs *ctx)
{
    u32 tid = current_tid();
    struct pi_token_event *ev = bpf_map_lookup_elem(&token_open, &tid);
    if (!ev)
        return cfg.transport.follow && !in_target() ? other_return() : 0;
    ev->end_ns = bpf_ktime_get_ns();
    ev->ret = (s32)PT_REGS_RC(ctx);
    if (emit(ctx, ev, sizeof(*ev)))
        count_lost(1);
    bpf_map_delete_elem(&token_open, &tid);
    decode_phase = PI_PHASE_OTHER;
    struct pi_open_span *span = bpf_map_lookup_elem(&open_spans, &tid);
    if (span)
        span->step_start_ns = 0;
    return 0;
}

/* ---- llama-server's request marks (llamacpp.h: struct pi_request_event) ----
 * One hit per HTTP request at the queue, one per task at its launch: the request's figures
 * are joined with the decode calls in user space (decode/requests.py). */
static __always_inline void request_mark(struct pi_request_event *ev, u32 mark)
{
    ev->kind = PI_EV_REQUEST;
    ev->tid = current_tid();
    ev->tgid = bpf_get_current_pid_tgid() >> 32;
    ev->ts_ns = bpf_ktime_get_ns();
    ev->mark = mark;
    ev->slot = -1;
    ev->parent = -1;
}

/* server_queue::post(std::vector<server_task> &&, bool front) */
SEC("uprobe")
int request_posted(struct pt_regs *ctx)
{
    if (!in_target())
        return other_process();
    if (!cfg.task_size)
        return 0;
    struct pi_request_event ev = {};
    request_mark(&ev, PI_REQ_POSTED);
    u64 vec[2] = {};   /* std::vector: begin, end */
    bpf_probe_read_user(vec, sizeof(vec), (void *)PT_REGS_PARM2(ctx));
    u64 n = vec[1] > vec[0] ? (vec[1] - vec[0]) / cfg.task_size : 0;
    ev.n_tasks = (u32)n;
    for (u32 i = 0; i < PI_REQ_TASKS; i++) {
        if (i >= n)
            break;
        u64 task = vec[0] + i * cfg.task_size;
        bpf_probe_read_user(&ev.task[i], sizeof(s32), (void *)(task + cfg.task_off_id));
        bpf_probe_read_user(&ev.type[i], sizeof(s32), (void *)(task + cfg.task_off_type));
    }
    if (emit(ctx, &ev, sizeof(ev)))
        count_lost(1);
    return 0;
}

/* server_context_impl::launch_slot_with_task(server_slot &, server_task &&) */
SEC("uprobe")
int request_launched(struct pt_regs *ctx)
{
    if (!in_target())
        return other_process();
    if (!cfg.task_size)
        return 0;
    struct pi_request_event ev = {};
    request_mark(&ev, PI_REQ_LAUNCHED);
    u64 task = PT_REGS_PARM3(ctx);
    ev.n_tasks = 1;
    bpf_probe_read_user(&ev.slot, sizeof(s32), (void *)(PT_REGS_PARM2(ctx) + cfg.slot_off_id));
    bpf_probe_read_user(&ev.task[0], sizeof(s32), (void *)(task + cfg.task_off_id));
    bpf_probe_read_user(&ev.type[0], sizeof(s32), (void *)(task + cfg.task_off_type));
    bpf_probe_read_user(&ev.parent, sizeof(s32), (void *)(task + cfg.task_off_parent));
    if (emit(ctx, &ev, sizeof(ev)))
        count_lost(1);
    return 0;
}

/* ---- graph level: f(backend_or_sched, struct ggml_cgraph *) ----
 * Each graph probe has its own pair of programs, so an event says which function it came
 * from (entry points take no arguments, and attach cookies need 5.15). */

static __always_inline int graph_enter(struct pt_regs *ctx, u32 probe)
{
    if (!in_target())
        return other_process();
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

/* Per (process, probe, backend): a daemon's always-on graph level (llamacpp.h). */
struct {
    __uint(type, BPF_MAP_TYPE_HASH);
    __uint(max_entries, 1024);
    __type(key, struct pi_graph_key);
    __type(value, struct pi_graph_total);
} graph_totals SEC(".maps");

static __always_inline void count_graph(struct pi_graph_event *ev)
{
    struct pi_graph_key key = {.tgid = bpf_get_current_pid_tgid() >> 32, .probe = ev->probe,
                               .name_fn = ev->name_fn};
    struct pi_graph_total *t = bpf_map_lookup_elem(&graph_totals, &key);
    if (!t) {
        struct pi_graph_total zero = {};
        bpf_map_update_elem(&graph_totals, &key, &zero, BPF_NOEXIST);   /* or another made it */
        t = bpf_map_lookup_elem(&graph_totals, &key);
        if (!t) {                     /* full: counted as lost */
            count_lost(1);
            return;
        }
    }
    u64 ns = ev->end_ns - ev->start_ns;
    u64 us = ns >> 10;                /* ~microseconds: bucket k holds under 2^(k+1) */
    u32 b = us ? log2_u64(us) : 0;
    if (b >= PI_GRAPH_BUCKETS)
        b = PI_GRAPH_BUCKETS - 1;
    __sync_fetch_and_add(&t->calls, 1);
    __sync_fetch_and_add(&t->ns, ns);
    __sync_fetch_and_add(&t->nodes, ev->n_nodes > 0 ? (u64)ev->n_nodes : 0);
    __sync_fetch_and_add(&t->buckets[b], 1);
}

static __always_inline int graph_return(struct pt_regs *ctx, u32 probe)
{
    u64 key = ((u64)current_tid() << 32) | probe;
    struct pi_graph_event *ev = bpf_map_lookup_elem(&graph_open, &key);
    if (!ev)
        return cfg.transport.follow && !in_target() ? other_return() : 0;
    ev->end_ns = bpf_ktime_get_ns();
    if (cfg.graph_totals_only)
        count_graph(ev);
    else if (emit(ctx, ev, sizeof(*ev)))
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

/* ---- op level ---- */

/* Bumped whenever the target may make tensors at used addresses or rewrite a graph's
 * nodes (llamacpp.h, before struct pi_node_slot): descriptions read before are then checked. */
struct pi_control control SEC(".data.control") = {.graph_generation = 1, .collecting = 1};

/* ggml_reset(ctx), ggml_new_graph_custom(ctx, ...) */
SEC("uprobe")
int graphs_changed(struct pt_regs *ctx)
{
    if (!in_target())
        return other_process();
    __sync_fetch_and_add(&control.graph_generation, 1);
    return 0;
}

/* ggml_init(struct ggml_init_params): a context that can hold a tensor. ggml_graph_compute
 * makes and frees an empty one on every graph (ggml_cpu_init: mem_size 0), which is not a
 * change. The params are passed by value, in memory at the entry's stack pointer. */
SEC("uprobe")
int context_made(struct pt_regs *ctx)
{
    if (!in_target())
        return other_process();
    u64 mem_size = 0;
    if (bpf_probe_read_user(&mem_size, sizeof(mem_size),
                            (void *)(PT_REGS_SP(ctx) + cfg.init_params_sp_off)) ||
        mem_size >= PI_MIN_TENSOR_CONTEXT)          /* unreadable: assume the worst */
        __sync_fetch_and_add(&control.graph_generation, 1);
    return 0;
}

/*
 * A node starts when its thread enters ggml_cpu_extra_compute_forward (every unfused node
 * passes through it, including AMX/repacked matmuls) or a fused-op function. It ends at the
 * last ggml_barrier entered before the next node starts: ops such as MUL_MAT also wait at
 * barriers inside themselves, and that waiting belongs to the op. So a node is completed
 * only when the thread's next node starts (or user space drains the map at the end).
 */


/* The node's end on this thread, as far as counters go: re-read them unless it moved CPU. */
static __always_inline void counters_at_end(struct pi_op_thread *st)
{
    if (!cfg.n_counters || (st->cur.flags & (PI_OP_MIGRATED | PI_OP_CTR_FAILED)))
        return;
    if (bpf_get_smp_processor_id() != st->cur.cpu) {
        st->cur.flags |= PI_OP_MIGRATED;
        return;
    }
    if (read_counters(st->ctr_end, st->cur.cpu))
        st->cur.flags |= PI_OP_CTR_FAILED;
}

static __always_inline u32 ns32(u64 ns)
{
    return ns > 0xffffffffULL ? 0xffffffffU : (u32)ns;
}

/* Send the thread's batch of finished ops (its first n slots) and empty it. */
static __always_inline void send_batch(void *ctx, struct pi_op_thread *st, u32 n)
{
    st->batch.kind = PI_EV_OPS;
    if (emit(ctx, &st->batch, sizeof(st->batch)))
        count_lost(n);
    st->batch.count = 0;
}

/* Per op type and phase (llamacpp.h: PI_OP_KEY): the op level counted, not sent. Per CPU:
 * a graph's threads end the same node at the same barrier, and one shared count would move
 * its cache line between their CPUs at every node (user space sums the CPUs). */
struct {
    __uint(type, BPF_MAP_TYPE_PERCPU_HASH);
    __uint(max_entries, 1024);
    __type(key, u32);
    __type(value, struct pi_op_total);
} op_totals SEC(".maps");

static __always_inline void count_op(struct pi_op_event *op)
{
    u32 key = op->node;
    struct pi_op_total *t = bpf_map_lookup_elem(&op_totals, &key);
    if (!t) {
        struct pi_op_total zero = {};
        bpf_map_update_elem(&op_totals, &key, &zero, BPF_NOEXIST);   /* or another made it */
        t = bpf_map_lookup_elem(&op_totals, &key);
        if (!t) {
            count_lost(1);
            return;
        }
    }
    __sync_fetch_and_add(&t->calls, 1);   /* atomic: a preempted run may share the CPU */
    if (op->end_ns > op->start_ns)
        __sync_fetch_and_add(&t->ns, op->end_ns - op->start_ns);
}

/* Counted ops: the latest fused ops' entry gaps, PI_GAP_SAMPLES per CPU, from which user
 * space measures a trap as the target meets it (selfcost.trap_at_fused_entries), as it does
 * from the op events when they are sent. */
struct {
    __uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
    __uint(max_entries, PI_GAP_SAMPLES);
    __type(key, u32);
    __type(value, struct pi_gap_sample);
} gap_samples SEC(".maps");

struct {
    __uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
    __uint(max_entries, 1);
    __type(key, u32);
    __type(value, u32);
} gap_next SEC(".maps");

static __always_inline void sample_gap(struct pi_op_event *op)
{
    u32 zero = 0;
    u32 *next = bpf_map_lookup_elem(&gap_next, &zero);
    if (!next)
        return;
    u32 i = (*next)++ % PI_GAP_SAMPLES;
    struct pi_gap_sample *g = bpf_map_lookup_elem(&gap_samples, &i);
    if (g) {
        g->release_ns = op->start_ns - op->entry_gap_ns;
        g->gap_ns = op->entry_gap_ns;
    }
}

/* Add the thread's finished node to its batch, sending the batch when full. */
static __always_inline void push_op(void *ctx, struct pi_op_thread *st)
{
    if (cfg.op_totals_only) {
        count_op(&st->cur);
        if (st->cur.entry_gap_ns)
            sample_gap(&st->cur);
        return;
    }
    u32 i = st->batch.count;
    if (i >= PI_OP_BATCH)                 /* cannot happen; keeps the verifier's bounds */
        return;
    __builtin_memcpy(&st->batch.ev[i], &st->cur, sizeof(st->cur));
    st->batch.count = i + 1;
    if (i + 1 == PI_OP_BATCH)
        send_batch(ctx, st, PI_OP_BATCH);
}

/* `now` and `reads` (this CPU's counters, read together with `now`) end the node if it
 * met no barrier. When the thread is exiting, its node is sent as collection's end leaves
 * it (user space bounds its ends by its graph's): no barrier end, and without a barrier no
 * end and no counts. */
static __always_inline void op_finish(void *ctx, struct pi_op_thread *st, u64 now,
                                      struct pi_counter_read *reads, int reads_failed,
                                      int exiting)
{
    if (!st->has_cur)
        return;
    st->has_cur = 0;
    st->cur.barrier_end_ns = exiting ? 0 : now;
    if (st->cur.n_barriers == 0 && exiting) {
        st->cur.flags |= PI_OP_UNFINISHED;
    } else if (st->cur.n_barriers == 0) {  /* no barrier seen: the node ran to here */
        st->cur.end_ns = now;
        if (cfg.n_counters && !(st->cur.flags & (PI_OP_MIGRATED | PI_OP_CTR_FAILED))) {
            if (bpf_get_smp_processor_id() != st->cur.cpu)
                st->cur.flags |= PI_OP_MIGRATED;
            else if (reads_failed)
                st->cur.flags |= PI_OP_CTR_FAILED;
            else
                __builtin_memcpy(st->ctr_end, reads, sizeof(st->ctr_end));
        }
    }
    if (cfg.n_counters && !(st->cur.flags & (PI_OP_MIGRATED | PI_OP_CTR_FAILED | PI_OP_UNFINISHED))) {
#pragma unroll
        for (u32 i = 0; i < PI_MAX_COUNTERS; i++) {
            if (i >= cfg.n_counters)
                break;
            st->cur.ctr[i] = st->ctr_end[i].counter - st->ctr_start[i].counter;
            st->cur.ctr_enabled[i] = ns32(st->ctr_end[i].enabled - st->ctr_start[i].enabled);
            st->cur.ctr_running[i] = ns32(st->ctr_end[i].running - st->ctr_start[i].running);
        }
    }
    push_op(ctx, st);
}

static __always_inline u64 max_u64(u64 a, u64 b)
{
    return a > b ? a : b;
}

/* A table layout's check also reads nb, view_offs (after view_src) and data (llamacpp.h). */
static __always_inline u64 check_window(void)
{
    return cfg.check_layout ? max_u64(max_u64(cfg.t_off_nb + 32, cfg.t_off_view_src + 16),
                                      cfg.t_off_data + 8) : 0;
}

/* Bytes from a tensor's start that hold its type, ne, op, src[0..2] and name; and those that
 * hold a source's type, ne and view_src (and what a layout check reads). Constants once
 * .rodata is frozen, so the verifier checks every field's place in the window statically
 * and drops the unused branch. */
static __always_inline u64 node_window(void)
{
    return max_u64(max_u64(max_u64(cfg.t_off_type + 4, cfg.t_off_ne + 32),
                           max_u64(max_u64(cfg.t_off_op + 4, cfg.t_off_src + 24),
                                   cfg.t_off_name + PI_NAME_LEN)),
                   check_window());
}

static __always_inline u64 source_window(void)
{
    return max_u64(max_u64(max_u64(cfg.t_off_type + 4, cfg.t_off_ne + 32), cfg.t_off_view_src + 8),
                   check_window());
}

static __always_inline void copy_ne(s64 *ne, const u8 *w)
{
#pragma unroll
    for (int i = 0; i < 4; i++)
        ne[i] = *(const s64 *)(w + cfg.t_off_ne + 8 * i);
}

/* type, ne[4] and view_src of a source tensor with one read; 0 when it could not be read. */
static __always_inline u64 read_source_window(u8 *w, u64 src, s32 *type, s64 *ne)
{
    *type = -1;
    if (!src || bpf_probe_read_user(w, source_window(), (void *)src))
        return 0;
    *type = *(const s32 *)(w + cfg.t_off_type);
    copy_ne(ne, w);
    return *(const u64 *)(w + cfg.t_off_view_src);
}

/* The check fields (llamacpp.h) of source k, in the window when it was read (its type is
 * not -1), and of its view root. */
static __always_inline void check_source(struct pi_node_check *c, u8 *w, int k, s32 type, u64 root)
{
    int read = type != -1;
    c->src_data[k] = read ? *(const u64 *)(w + cfg.t_off_data) : 0;
    c->src_view_offs[k] = read ? *(const u64 *)(w + cfg.t_off_view_src + 8) : 0;
    c->root_type[k] = -1;
    c->root_data[k] = 0;
    c->root_view_src[k] = 0;
    if (root && !bpf_probe_read_user(w, source_window(), (void *)root)) {
        c->root_type[k] = *(const s32 *)(w + cfg.t_off_type);
        c->root_view_src[k] = *(const u64 *)(w + cfg.t_off_view_src);
        c->root_data[k] = *(const u64 *)(w + cfg.t_off_data);
    }
}

/* A source that is a view (of the KV cache, a reshape of a node) names through view_src the
 * tensor that holds its data; ggml keeps view_src pointing at the root, never at a view. */
static __always_inline u64 view_root(u64 src)
{
    u64 root = 0;
    if (src)
        bpf_probe_read_user(&root, sizeof(root), (void *)(src + cfg.t_off_view_src));
    return root;
}

/* The expert ids of a MUL_MAT_ID node (a view of the router's top-k: rows strided by nb[1]). */
static __always_inline void send_experts(void *ctx, struct pi_op_thread *st, u64 ids, u64 tensor)
{
    struct pi_experts_event *ex = &st->experts;
    s64 ne[2] = {};
    u64 nb1 = 0, data = 0;
    bpf_probe_read_user(ne, sizeof(ne), (void *)(ids + cfg.t_off_ne));
    bpf_probe_read_user(&nb1, sizeof(nb1), (void *)(ids + cfg.t_off_nb + 8));
    bpf_probe_read_user(&data, sizeof(data), (void *)(ids + cfg.t_off_data));
    ex->kind = PI_EV_EXPERTS;
    ex->tid = st->cur.tid;
    ex->start_ns = st->cur.start_ns;
    ex->tensor = tensor;
    ex->ids_tensor = ids;
    ex->n_used = (s32)ne[0];
    ex->n_tokens = (s32)ne[1];
    u32 rows = 0;
    for (u32 r = 0; r < PI_MAX_EXPERT_ROWS; r++) {
        if ((s64)r >= ne[1])
            break;
        bpf_probe_read_user(&ex->ids[r * PI_EXPERT_SLOTS], PI_EXPERT_SLOTS * sizeof(s32),
                            (void *)(data + r * nb1));
        rows = r + 1;
    }
    u64 size = sizeof(*ex) - sizeof(ex->ids) + (u64)rows * PI_EXPERT_SLOTS * sizeof(s32);
    if (size > sizeof(*ex))
        return;
    if (emit(ctx, ex, size))
        count_lost(1);
}

/* The expert ids of MUL_MAT_ID node t: its src[2]. */
static __always_inline void send_node_experts(void *ctx, struct pi_op_thread *st, u64 t)
{
    u64 ids = 0;
    bpf_probe_read_user(&ids, sizeof(ids), (void *)(t + cfg.t_off_src + 16));
    if (ids)
        send_experts(ctx, st, ids, t);
}

static __always_inline u64 desc_hash(const struct pi_node_desc *d)
{
    const u64 *x = (const u64 *)d;
    u64 h = 0xcbf29ce484222325ULL;
#pragma unroll
    for (int i = 0; i < sizeof(*d) / 8; i++)
        h = (h ^ x[i]) * 0x100000001b3ULL;
    return h ^ (h >> 29);
}

/* The set of st->sent where a tensor's descriptions are remembered. */
static __always_inline struct pi_node_slot *node_set(struct pi_op_thread *st, u64 tensor)
{
    u32 set = (u32)((tensor * 0x9E3779B97F4A7C15ULL) >> 32) & (PI_NODE_SETS - 1);
    return &st->sent[set * PI_NODE_WAYS];
}

/* The slot of a node whose description was read in this graph generation, or NULL. */
static __always_inline struct pi_node_slot *node_known(struct pi_node_slot *way, u64 tensor,
                                                       u64 fused_with, u32 generation)
{
#pragma unroll
    for (int i = 0; i < PI_NODE_WAYS; i++)
        if (way[i].generation == generation && way[i].tensor == tensor &&
            way[i].fused_tensor == fused_with && way[i].hash)
            return &way[i];
    return 0;
}

/* The number of the node described in st->node, slot flags included: the one this thread
 * sent before, or a new number, sent with the description now (before any op event that
 * carries it). The slot is stamped with the generation the description was read in. */
static __always_inline u32 node_number(struct pt_regs *ctx, struct pi_op_thread *st, u32 tid,
                                       struct pi_node_slot *way, u32 generation)
{
    u64 tensor = st->node.desc.tensor;
    u64 h = desc_hash(&st->node.desc) | 1;    /* never 0, which marks an empty slot */
#pragma unroll
    for (int i = 0; i < PI_NODE_WAYS; i++)
        if (way[i].hash == h) {
            way[i].generation = generation;
            return way[i].node;
        }
    st->node.kind = PI_EV_NODE;
    st->node.tid = tid;
    st->node.pad = 0;
    u32 flags = 0;
    if (cfg.op_totals_only) {       /* its type is all that is counted: nothing to send */
        st->node.node = PI_OP_KEY(st->node.desc.op, st->node.desc.fused_op);
    } else {
        st->node.node = st->next_node++ & ~PI_NODE_EXPERTS;
        flags = cfg.op_mul_mat_id >= 0 && st->node.desc.op == cfg.op_mul_mat_id &&
                st->node.desc.src[2] ? PI_NODE_EXPERTS : 0;
    }
    if (!cfg.op_totals_only && emit(ctx, &st->node, sizeof(st->node))) {
        count_lost(1);
        return st->node.node | flags;   /* not remembered: described again next time */
    }
    /* The newest description goes first and the others move down a slot, the last one out;
     * or, when the tensor had another description here, up to its slot, which it replaces. */
    u32 victim = PI_NODE_WAYS - 1;
#pragma unroll
    for (int i = PI_NODE_WAYS - 2; i >= 0; i--)
        if (way[i].hash && way[i].tensor == tensor)
            victim = i;
#pragma unroll
    for (int i = PI_NODE_WAYS - 1; i > 0; i--)
        if ((u32)i <= victim)
            way[i] = way[i - 1];
    way[0].hash = h;
    way[0].tensor = tensor;
    way[0].fused_tensor = st->node.desc.fused_tensor;
    way[0].node = st->node.node | flags;
    way[0].generation = generation;
    return way[0].node;
}

/* This thread's op state, or NULL. */
static __always_inline struct pi_op_thread *find_state(u32 tid)
{
#ifndef PI_PERF_BUFFER
    if (cfg.thread_slots) {
        u32 idx = tid & (cfg.thread_slots - 1);
        struct pi_op_thread *st = bpf_map_lookup_elem(&op_threads_direct, &idx);
        if (st && st->owner == tid)
            return st;
    }
#endif
    return bpf_map_lookup_elem(&op_threads, &tid);
}

/* A zeroed state for a thread's first op: its direct slot if free, else a hash entry. */
static __always_inline struct pi_op_thread *new_state(u32 tid)
{
#ifndef PI_PERF_BUFFER
    if (cfg.thread_slots) {
        u32 idx = tid & (cfg.thread_slots - 1);
        struct pi_op_thread *st = bpf_map_lookup_elem(&op_threads_direct, &idx);
        if (st && st->owner == 0 && __sync_val_compare_and_swap(&st->owner, 0, tid) == 0) {
            tally(PI_TALLY_SLOTS_CLAIMED);
            return st;
        }
    }
#endif
    u32 z = 0;
    struct pi_op_thread *zero = bpf_map_lookup_elem(&op_thread_zero, &z);
    if (!zero)
        return 0;
    bpf_map_update_elem(&op_threads, &tid, zero, BPF_NOEXIST);
    struct pi_op_thread *st = bpf_map_lookup_elem(&op_threads, &tid);
    if (st)
        tally(PI_TALLY_STATES_HASHED);
    return st;
}

/* Free an exiting thread's state. */
static __always_inline void free_state(u32 tid, struct pi_op_thread *st)
{
#ifndef PI_PERF_BUFFER
    if (cfg.thread_slots && st->owner == tid) {
        u32 idx = tid & (cfg.thread_slots - 1), z = 0;
        struct pi_op_thread *zero = bpf_map_lookup_elem(&op_thread_zero, &z);
        if (!zero)
            return;
        bpf_map_update_elem(&op_threads_direct, &idx, zero, BPF_ANY);  /* owner: releasing */
        /* free only once zeroed: BPF's atomics are full barriers on every architecture */
        __sync_val_compare_and_swap(&st->owner, PI_SLOT_RELEASING, 0);
        return;
    }
#endif
    bpf_map_delete_elem(&op_threads, &tid);
}

/* This thread's op state, made at its first op; NULL (and the op counted lost) when there
 * are more computing threads than user space sized the maps for. */
static __always_inline struct pi_op_thread *state_for(u32 tid)
{
    struct pi_op_thread *st = find_state(tid);
    if (!st) {
        st = new_state(tid);
        if (!st)
            count_lost(1);
    }
    return st;
}

/* False once user space has stopped collecting: the op programs then leave their state
 * alone while it is read, and send nothing while the probes are being detached. */
static __always_inline int collecting(void)
{
    return *(volatile u32 *)&control.collecting;
}

/* The number of node t (fused with fused_with, or 0) on this thread, | PI_NODE_EXPERTS for a
 * MUL_MAT_ID with expert ids: known from this graph generation, or read and described now. */
static __always_inline u32 describe_node(struct pt_regs *ctx, struct pi_op_thread *st, u32 tid,
                                         const void *t, const void *fused_with)
{
    /* Read once, before the description: if graphs_changed bumps it meanwhile, the slot
     * keeps the older stamp and the description is read again next time. */
    u32 generation = cfg.nodes_by_generation ? *(volatile u32 *)&control.graph_generation : 0;
    struct pi_node_slot *way = node_set(st, (u64)t);
    struct pi_node_slot *known = cfg.nodes_by_generation
        ? node_known(way, (u64)t, (u64)fused_with, generation) : 0;
    if (known)
        return known->node;
    tally(PI_TALLY_NODE_READS);
    struct pi_node_desc *d = &st->node.desc;
    struct pi_node_check *c = &st->node.check;
    /* a table layout is checked in each thread's first description reads only (llamacpp.h) */
    int checking = cfg.check_layout && st->layout_checks < PI_CHECK_NODES;
    if (checking)
        st->layout_checks++;
    d->tensor = (u64)t;
    d->pad = 0;
    u8 *w = st->window;
    /* user space refuses layouts whose windows exceed it; this bounds the reads for the
     * verifier. A failed read leaves zeros (bpf_probe_read_user clears on error). */
    if (node_window() <= PI_TENSOR_WINDOW && source_window() <= PI_TENSOR_WINDOW) {
        bpf_probe_read_user(w, node_window(), t);
        d->op = *(const s32 *)(w + cfg.t_off_op);
        d->type = *(const s32 *)(w + cfg.t_off_type);
        copy_ne(d->ne, w);
#pragma unroll
        for (int i = 0; i < PI_NAME_LEN / 8; i++)
            *(u64 *)&d->name[8 * i] = *(const u64 *)(w + cfg.t_off_name + 8 * i);
#pragma unroll
        for (int i = 0; i < 3; i++)
            d->src[i] = *(const u64 *)(w + cfg.t_off_src + 8 * i);
        if (checking) {
#pragma unroll
            for (int i = 0; i < 4; i++)
                c->nb[i] = *(const u64 *)(w + cfg.t_off_nb + 8 * i);
            c->view_src = *(const u64 *)(w + cfg.t_off_view_src);
            c->view_offs = *(const u64 *)(w + cfg.t_off_view_src + 8);
            c->data = *(const u64 *)(w + cfg.t_off_data);
        }
        /* the window is reused for each source once the node's fields are out of it */
        d->src_view[0] = read_source_window(w, d->src[0], &d->src0_type, d->src0_ne);
        if (checking)
            check_source(c, w, 0, d->src0_type, d->src_view[0]);
        d->src_view[1] = read_source_window(w, d->src[1], &d->src1_type, d->src1_ne);
        if (checking) {
            check_source(c, w, 1, d->src1_type, d->src_view[1]);
            d->src_view[2] = read_source_window(w, d->src[2], &c->src2_type, c->src2_ne);
            check_source(c, w, 2, c->src2_type, d->src_view[2]);
        }
    }
    if (!checking)
        d->src_view[2] = view_root(d->src[2]);
    if (cfg.check_layout)
        c->checked = checking;
    d->fused_op = -1;
    d->fused_tensor = (u64)fused_with;
    if (fused_with)
        bpf_probe_read_user(&d->fused_op, sizeof(d->fused_op), fused_with + cfg.t_off_op);
    return node_number(ctx, st, tid, way, generation);
}

/* What an op event carries for node number `node`: the number; counted in BPF, its type
 * and the phase of the decode call under way as it starts (llamacpp.h: PI_OP_KEY). */
static __always_inline u32 op_number(u32 node)
{
    node &= ~PI_NODE_EXPERTS;
    if (cfg.op_totals_only)
        node |= PI_OP_PHASE(*(volatile u32 *)&decode_phase);
    return node;
}

static __always_inline int op_begin(struct pt_regs *ctx, const void *t, const void *fused_with)
{
    if (!collecting())
        return 0;
    if (!in_target())
        return other_process();
    /* Counters are read next to the clock: what the handler does after this must fall on
     * the same side of both, or short ops lose part of their count (bench/results.md). */
    struct pi_counter_read reads[PI_MAX_COUNTERS] = {};
    u64 now = bpf_ktime_get_ns();
    int reads_failed = cfg.n_counters ? read_counters(reads, bpf_get_smp_processor_id()) : 0;
    u32 tid = current_tid();
    struct pi_op_thread *st = state_for(tid);
    if (!st)
        return 0;
    op_finish(ctx, st, now, reads, reads_failed, 0);

    struct pi_op_event *ev = &st->cur;
    ev->start_ns = now;
    ev->end_ns = 0;
    ev->barrier_end_ns = 0;
    ev->tid = tid;
    ev->cpu = bpf_get_smp_processor_id();
    ev->n_barriers = 0;
    ev->flags = 0;
    ev->entry_gap_ns = 0;
    u32 node = describe_node(ctx, st, tid, t, fused_with);
    ev->node = op_number(node);
    if (node & PI_NODE_EXPERTS)       /* MUL_MAT_ID: the experts it runs change every time */
        send_node_experts(ctx, st, (u64)t);
    if (cfg.n_counters) {
        __builtin_memset(ev->ctr, 0, sizeof(ev->ctr));
        __builtin_memset(ev->ctr_enabled, 0, sizeof(ev->ctr_enabled));
        __builtin_memset(ev->ctr_running, 0, sizeof(ev->ctr_running));
        __builtin_memcpy(st->ctr_start, reads, sizeof(st->ctr_start));
        if (reads_failed)
            ev->flags |= PI_OP_CTR_FAILED;
    }
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
    /* no in_target(): only the target's threads have op state (as at the returns) */
    if (!collecting())
        return 0;
    u32 tid = current_tid();
    struct pi_op_thread *st = find_state(tid);
    if (!st)
        return cfg.transport.follow && !in_target() ? other_process() : 0;
    if (!st->has_cur)
        return 0;
    st->cur.end_ns = bpf_ktime_get_ns();
    st->cur.n_barriers++;
    counters_at_end(st);
    return 0;
}

/*
 * The op level with one probe per node and thread (the default where the build allows it;
 * the two-probe design above serves counters, perf-buffer kernels and builds without the
 * facts below). Every thread walks the graph's nodes in order and meets a barrier after
 * each node it computes; the probes sit on those barrier calls in the graph loop only
 * (user space finds them with DWARF), on the loop's entry, and on fused-op functions:
 *  - a thread's node ends at its barrier's call (its arrival, as in the two-probe design);
 *  - the barrier releases its threads when the last one arrives, so every thread's next
 *    node starts when the last arriver leaves its probe: each thread leaving one keeps the
 *    time (an atomic maximum, per threadpool and barrier number), and a thread reads it at
 *    its next barrier, when all have left; a fused op starts at its function's entry;
 *  - which node ended is the next one the loop computes after the thread's last node: not
 *    empty (ggml_op_is_empty), flagged for compute where the build has the flag, two nodes
 *    when a fused-op function began at it.
 * What the two-probe design measures and this one cannot: a thread that is late to leave a
 * barrier (preempted as it was released) shows that delay in its next node, not in its wait.
 */
#ifndef PI_PERF_BUFFER
#define PI_RELEASE_SLOTS 8      /* barriers in flight per threadpool: threads are at most one apart */
#define PI_WALK_MAX 32          /* empty nodes skipped between two computed ones */

struct pi_release_key {
    u64 threadpool;
    u32 tgid;
    u32 pad;
};

struct pi_releases {
    u64 at[PI_RELEASE_SLOTS];   /* barrier n's release (its threads' latest probe exit), at
                                   n % PI_RELEASE_SLOTS */
};

/* least recently used out: threadpools of processes gone are never deleted */
struct {
    __uint(type, BPF_MAP_TYPE_LRU_HASH);
    __uint(max_entries, 256);
    __type(key, struct pi_release_key);
    __type(value, struct pi_releases);
} releases SEC(".maps");

/* ggml_graph_compute_thread's entry: the thread's first node starts. */
SEC("uprobe")
int op_graph_loop(struct pt_regs *ctx)
{
    if (!collecting())
        return 0;
    if (!in_target())
        return other_process();
    u64 now = bpf_ktime_get_ns();
    u32 tid = current_tid();
    struct pi_op_thread *st = state_for(tid);
    if (!st)
        return 0;
    if (st->has_cur) {          /* the last graph's last node: user space ends its wait */
        st->has_cur = 0;
        st->cur.barrier_end_ns = now;
        push_op(ctx, st);
    }
    st->walk.entry_ns = now;
    st->walk.nodes = 0;
    st->walk.fused_t = 0;
    st->walk.pos = -1;
    st->walk.barrier = 0;
    st->walk.active = 1;
    return 0;
}

/* A fused-op function (params, node, the node fused with it): the node the walk reaches
 * next is computed with the one after it. */
SEC("uprobe")
int op_fused_mark(struct pt_regs *ctx)
{
    if (!collecting())
        return 0;
    struct pi_op_thread *st = find_state(current_tid());
    if (!st)
        return cfg.transport.follow && !in_target() ? other_process() : 0;
    st->walk.fused_ns = bpf_ktime_get_ns();
    st->walk.fused_t = PT_REGS_PARM2(ctx);
    st->walk.fused_with = PT_REGS_PARM3(ctx);
    return 0;
}

static __always_inline int op_is_empty(u32 op)
{
    return op < 128 && (cfg.empty_ops[op >> 6 & 1] >> (op & 63) & 1);
}

/* Bytes from a tensor's op to its flags: both read at once. */
#define PI_OP_FLAGS_SPAN 128

struct walk_scan {
    struct pi_op_thread *st;
    u64 nodes;
    u64 tensor;              /* the node found */
    s32 n_nodes;
    s32 at;                  /* the position looked at last */
    u32 generation;
    u32 found;
};

/* One node of the walk: stops (1) at a computed node, or at the graph's end. */
static long walk_step(u64 k, void *ctx)
{
    struct walk_scan *ws = ctx;
    s32 i = ws->at + 1;
    if (i >= ws->n_nodes)
        return 1;
    ws->at = i;
    u64 t = read_u64(ws->nodes + 8 * (u64)i);
    if (!t)
        return 1;
    struct pi_op_thread *st = ws->st;
    if (cfg.nodes_by_generation && node_known(node_set(st, t), t, 0, ws->generation)) {
        ws->tensor = t;
        ws->found = 1;
        return 1;
    }
    u8 *fields = st->window;
    u64 span = cfg.compute_flag ? cfg.t_off_flags + 4 - cfg.t_off_op : 4;
    if (span > PI_OP_FLAGS_SPAN || bpf_probe_read_user(fields, span, (void *)(t + cfg.t_off_op)))
        return 1;
    if (op_is_empty(*(u32 *)fields))
        return 0;
    if (cfg.compute_flag) {
        u64 at = cfg.t_off_flags - cfg.t_off_op;
        if (at > PI_OP_FLAGS_SPAN - 4 || !(*(u32 *)(fields + at) & cfg.compute_flag))
            return 0;
    }
    ws->tensor = t;
    ws->found = 1;
    return 1;
}

/* Zero, read from memory: the verifier follows a bpf_loop callback until its state repeats,
 * and a flag that starts at a known constant makes a state of its own. */
u32 scan_counter_start = 0;

/* The index of the first node after `from` the graph loop computes, with its tensor; -1 when
 * there is none within PI_WALK_MAX. A node this thread described in this graph generation
 * was computed (only computed nodes are described), so its fields are not read again.
 * A bpf_loop (Linux 5.17): the verifier checks one step, not PI_WALK_MAX of them. */
static __always_inline s32 next_computed(struct pi_op_thread *st, s32 from, u64 *tensor)
{
    struct walk_scan ws = {
        .st = st, .nodes = st->walk.nodes, .n_nodes = st->walk.n_nodes, .at = from,
        .generation = cfg.nodes_by_generation ? *(volatile u32 *)&control.graph_generation : 0,
        .found = scan_counter_start,
    };
    bpf_loop(PI_WALK_MAX, walk_step, &ws, 0);
    if (!ws.found)
        return -1;
    *tensor = ws.tensor;
    return ws.at;
}

/* The thread leaves its probe for the barrier: the barrier releases its threads when the
 * last one does, so the latest such time of all is kept (slots hold older graphs' times,
 * all earlier). Taken as the handler ends, so that nodes do not include the probe's work. */
static __always_inline void release_at(u64 *at)
{
    u64 now = bpf_ktime_get_ns();
    for (int k = 0; k < 8; k++) {
        u64 seen = *(volatile u64 *)at;
        if (seen >= now || __sync_val_compare_and_swap(at, seen, now) == seen)
            break;
    }
}

/* A barrier call in the graph loop (ggml_barrier(threadpool)): the thread's node ends. */
SEC("uprobe")
int op_node_end(struct pt_regs *ctx)
{
    if (!collecting())
        return 0;
    u64 now = bpf_ktime_get_ns();
    u32 tid = current_tid();
    struct pi_op_thread *st = find_state(tid);
    if (!st)
        return cfg.transport.follow && !in_target() ? other_process() : 0;
    struct pi_graph_walk *w = &st->walk;
    if (!w->active)             /* a graph already under way when probes were attached */
        return 0;
    u64 tp = PT_REGS_PARM1(ctx);
    if (!w->nodes) {
        u64 cgraph = read_u64(tp + cfg.tp_off_cgraph);
        w->nodes = read_u64(cgraph + cfg.cg_off_nodes);
        w->n_nodes = 0;
        bpf_probe_read_user(&w->n_nodes, sizeof(w->n_nodes), (void *)(cgraph + cfg.cg_off_n_nodes));
    }
    struct pi_release_key key = {.threadpool = tp, .tgid = bpf_get_current_pid_tgid() >> 32};
    struct pi_releases *rel = bpf_map_lookup_elem(&releases, &key);
    if (!rel) {
        struct pi_releases none = {};
        bpf_map_update_elem(&releases, &key, &none, BPF_NOEXIST);
        rel = bpf_map_lookup_elem(&releases, &key);
        if (!rel) {
            count_lost(1);
            return 0;
        }
    }
    u32 b = w->barrier;
    u64 release = b ? rel->at[(b - 1) % PI_RELEASE_SLOTS] : w->entry_ns;
    /* A fused op starts where its function does, as in the two-probe design (its probe's
     * trap in is not the op's); any other node when the barrier before it let go. */
    u32 gap = w->fused_t && w->fused_ns > release ? ns32(w->fused_ns - release) : 0;
    u64 start = release + gap;
    if (st->has_cur) {          /* the previous node waited until this one started */
        st->cur.barrier_end_ns = start;
        push_op(ctx, st);
    }
    st->has_cur = 0;
    w->barrier = b + 1;

    struct pi_op_event *ev = &st->cur;
    ev->start_ns = start;
    ev->end_ns = now;
    ev->barrier_end_ns = 0;
    ev->tid = tid;
    ev->cpu = bpf_get_smp_processor_id();
    ev->n_barriers = 1;
    ev->flags = 0;
    ev->entry_gap_ns = gap;

    /* the same graph in the same generation walks the same way: what the walk found from
     * here last time is remembered, its reads and description look-up skipped */
    u32 generation = cfg.nodes_by_generation ? *(volatile u32 *)&control.graph_generation : 0;
    if (w->memo_nodes != w->nodes || w->memo_generation != generation) {
        w->memo_nodes = w->nodes;
        w->memo_generation = generation;
        w->memo_stamp = (w->memo_stamp + 1) & 0xffff ?: 1;
    }
    u32 from = (u32)(w->pos + 1);
    struct pi_walk_memo *m = from < PI_WALK_MEMO ? &st->memo[from & (PI_WALK_MEMO - 1)] : 0;
    u32 node;
    u64 t = 0;
    if (cfg.nodes_by_generation && m && m->stamp == w->memo_stamp) {
        w->fused_t = 0;
        if (m->node == PI_WALK_NONE) {
            w->pos = w->n_nodes;
            release_at(&rel->at[b % PI_RELEASE_SLOTS]);
            return 0;
        }
        w->pos = from + m->last;
        node = m->node;
        if (node & PI_NODE_EXPERTS)
            t = read_u64(w->nodes + 8 * (u64)(from + m->first));
    } else {
        s32 i = next_computed(st, w->pos, &t);
        if (i < 0) {            /* the loop's last barrier, after its last node */
            if (w->fused_t)
                tally(PI_TALLY_WALK_LOST);
            w->fused_t = 0;
            w->pos = w->n_nodes;
            if (m) {
                m->node = PI_WALK_NONE;
                m->stamp = w->memo_stamp;
            }
            release_at(&rel->at[b % PI_RELEASE_SLOTS]);
            return 0;
        }
        s32 first = i;
        u64 fused_with = 0;
        if (w->fused_t) {
            /* ggml fuses consecutive nodes only (ggml_can_fuse) */
            if (w->fused_t == t && i + 1 < w->n_nodes &&
                read_u64(w->nodes + 8 * (u64)(i + 1)) == w->fused_with) {
                fused_with = w->fused_with;
                i++;
            } else {
                tally(PI_TALLY_WALK_MISMATCH);
            }
            w->fused_t = 0;
        }
        w->pos = i;
        node = describe_node(ctx, st, tid, (const void *)t, (const void *)fused_with);
        /* remembered only once its description reached user space */
        if (m && cfg.nodes_by_generation && first - (s32)from < 256 && i - (s32)from < 256 &&
            node_known(node_set(st, t), t, fused_with, generation)) {
            m->node = node;
            m->first = first - from;
            m->last = i - from;
            m->stamp = w->memo_stamp;
        }
    }
    ev->node = op_number(node);
    if ((node & PI_NODE_EXPERTS) && t)
        send_node_experts(ctx, st, t);
    st->has_cur = 1;
    release_at(&rel->at[b % PI_RELEASE_SLOTS]);
    return 0;
}
#endif

/* A thread that computed ops exits: its last node and the ops it still holds are sent, and its
 * state is freed, so that threads that come and go (ggml's disposable threadpools, made for
 * each graph when the engine attaches none, as builds without OpenMP do) never fill
 * the state maps. A later thread given the same TID numbers its nodes from 0 again: user space
 * resolves op events to descriptions as each drain arrives, never by number at the end.
 * A raw tracepoint: attached by name, no tracefs and no BTF needed; `current` is the thread. */
SEC("raw_tracepoint/sched_process_exit")
int op_thread_exit(void *ctx)
{
    if (!collecting())      /* its state stays for user space to drain */
        return 0;
    u32 tid = current_tid();
    struct pi_op_thread *st = find_state(tid);
    if (!st)
        return 0;
    struct pi_counter_read none[PI_MAX_COUNTERS] = {};
    op_finish(ctx, st, bpf_ktime_get_ns(), none, 1, 1);
    if (st->batch.count)
        send_batch(ctx, st, st->batch.count);
    free_state(tid, st);
    return 0;
}
