/* Event layouts shared by the BPF programs and the collector.
 *
 * This header is the single definition: profinfer/core/ebpf/layout.py parses these structs into numpy
 * dtypes, so keep to the field types it knows (u8 u16 u32 s32 u64 s64 char) and to fields
 * aligned to their size (no implicit padding).
 */
#include "transport.h"
#include "counters.h"
#include "sched.h"

#define PI_ENGINE_LLAMACPP 1     /* pi_open_span.engine (transport.h) */

#define PI_NAME_LEN 64
/* The op handler reads a tensor's fields with one read of its first bytes, not one per field
 * (each read costs ~0.1 µs here, and a node needs a dozen fields of three tensors): the
 * fields must lie within this many bytes of the tensor's start. */
#define PI_TENSOR_WINDOW 512
#define PI_OP_BATCH 64

#define PI_EV_TOKEN 1
#define PI_EV_GRAPH 2
#define PI_EV_OPS 3
#define PI_EV_EXPERTS 6
#define PI_EV_NODE 7
#define PI_EV_DECODING 8
#define PI_EV_REQUEST 9

/* A batch's tokens as runs of one sequence at consecutive positions (engines add each
 * sequence's tokens together): a sequence decoding adds one token, a prompt many. */
#define PI_MAX_RUNS 16
#define PI_BATCH_SCAN 2048    /* tokens of a batch read; the rest are counted, not read */

struct pi_batch_run {
    s32 seq;                  /* the token's first sequence id */
    s32 pos0;                 /* position of the run's first token */
    u32 n_tokens;
    u32 pad;
};

/* One llama_decode call, sent at its return. */
struct pi_token_event {
    u32 kind;
    u32 tid;
    u64 start_ns;
    u64 end_ns;
    s32 n_tokens;
    s32 ret;
    u32 n_runs;               /* 0: the batch's sequences were not read (older API) */
    u32 unread;               /* tokens past PI_MAX_RUNS runs or PI_BATCH_SCAN tokens */
    struct pi_batch_run runs[PI_MAX_RUNS];
    u32 tgid;                 /* the process (probes on a file serve every process mapping it) */
    u32 pad;
};

/* The first llama_decode seen: sent at its entry, so that user space can count the target's
 * CPU time from there (the profiler's cost is a share of it). */
struct pi_decoding_event {
    u32 kind;
    u32 tid;
    u64 ts_ns;
};


/* A server's request marks (llama-server's task queue, libllama-server-impl.so): a batch of
 * tasks posted to the queue (server_queue::post(std::vector<server_task>&&, bool): one HTTP
 * request's tasks, sent at the call's entry), and a task launched on its slot
 * (server_context_impl::launch_slot_with_task(server_slot&, server_task&&), at entry). A
 * slot's id is its sequence id in the decode batches. Task ids and types only: no prompt,
 * no text. */
#define PI_REQ_POSTED 1
#define PI_REQ_LAUNCHED 2
#define PI_REQ_TASKS 8        /* a post's tasks read; n_tasks says how many it had */

struct pi_request_event {
    u32 kind;
    u32 tid;
    u64 ts_ns;
    u32 tgid;
    u32 mark;                 /* PI_REQ_* */
    s32 slot;                 /* launched: the slot's id (-1: posted) */
    u32 n_tasks;              /* posted: tasks in the batch; launched: 1 */
    s32 parent;               /* launched: the task's id_parent (-1: none) */
    u32 pad;
    s32 task[PI_REQ_TASKS];   /* each task's id */
    s32 type[PI_REQ_TASKS];   /* and its server_task_type */
};


/* One backend graph compute, sent at its return. */
struct pi_graph_event {
    u32 kind;
    u32 tid;
    u64 start_ns;
    u64 end_ns;
    u64 name_fn;   /* backend->iface.get_name: symbolized in user space to the backend name */
    u64 graph;
    s32 n_nodes;
    u32 probe;     /* index of the probed function in the probe pack */
};

/* Graph computes counted in BPF (cfg.graph_totals_only: no graph events), per process,
 * probe and backend: calls, time, nodes, and a histogram of durations (bucket k: under
 * 2^(k+1) microseconds; the last: the rest). */
#define PI_GRAPH_BUCKETS 24

struct pi_graph_key {
    u32 tgid;
    u32 probe;
    u64 name_fn;
};

struct pi_graph_total {
    u64 calls;
    u64 ns;
    u64 nodes;
    u64 buckets[PI_GRAPH_BUCKETS];
};

/* One graph node computed by one thread. */
#define PI_OP_MIGRATED 1      /* the thread changed CPU inside the op: counter deltas dropped */
#define PI_OP_CTR_FAILED 2    /* a counter could not be read: deltas dropped */
#define PI_OP_UNFINISHED 4    /* still running when collection ended, or when its thread exited */

/* What describes a node: the same for every run of it. Sent once per thread and node as a
 * pi_node_event, and again when it changes; op events refer to it by number. */
struct pi_node_desc {
    u64 tensor;
    s64 ne[4];
    u64 src[3];          /* source tensors: the graph's edges */
    u64 src_view[3];     /* each source's view_src: the computed tensor a view looks into */
    u64 fused_tensor;    /* the second node of a fused pair (its output is the op's result) */
    s64 src0_ne[4];      /* shapes and types of the first two sources: FLOPs and bytes moved */
    s64 src1_ne[4];
    s32 op;
    s32 fused_op;        /* op of the second fused node, -1 when not fused */
    s32 type;
    s32 src0_type;       /* -1: no such source */
    s32 src1_type;
    u32 pad;
    char name[PI_NAME_LEN];
};

/* What a table layout (no DWARF) is checked with, beyond the description: the fields the
 * DAG and the MoE reads depend on. Filled (checked = 1) only when cfg.check_layout is set,
 * in a thread's first PI_CHECK_NODES description reads (~1 more read per view source, never
 * again after those, even where every run is read); not part of the description's hash. */
#define PI_CHECK_NODES 64

struct pi_node_check {
    u64 nb[4];           /* the node's byte strides */
    u64 view_src;        /* the node's own view_src, view_offs (the next field) and data */
    u64 view_offs;
    u64 data;
    u64 src_data[3];     /* each source's data and view_offs */
    u64 src_view_offs[3];
    u64 root_data[3];    /* each source's view_src (desc.src_view) read: its data, */
    u64 root_view_src[3];    /* its own view_src (0: ggml points views at the root), */
    s32 root_type[3];        /* its type (-1: not read) */
    s32 src2_type;       /* the third source's type and shape (MUL_MAT_ID: the expert ids) */
    s64 src2_ne[4];
    u32 checked;
    u32 pad;
};

struct pi_node_event {
    u32 kind;
    u32 tid;
    u32 node;            /* this thread's number for the node (op events carry it) */
    u32 pad;
    struct pi_node_desc desc;
    struct pi_node_check check;
};

struct pi_op_event {
    u64 start_ns;
    u64 end_ns;          /* entry of the last ggml_barrier before the next node */
    u64 barrier_end_ns;  /* next node's start on this thread (user space caps it at graph end) */
    u64 ctr[PI_MAX_COUNTERS];          /* perf counter deltas over [start, end], unscaled */
    u32 ctr_enabled[PI_MAX_COUNTERS];  /* ns each counter was enabled / running meanwhile: */
    u32 ctr_running[PI_MAX_COUNTERS];  /* scale = enabled / running when multiplexed */
    u32 tid;
    u32 cpu;
    u32 node;            /* the node's number on this thread (pi_node_event) */
    u32 n_barriers;      /* barriers entered during the node: >1 means the op waited inside */
    u32 flags;           /* PI_OP_* */
    u32 entry_gap_ns;    /* one-probe design: from its barrier's release to a fused op's
                            entry on this thread (the last to arrive: one trap; 0: none) */
};

/* The op level counted in BPF (cfg.op_totals_only: a daemon's, and record's or attach's
 * without a timeline): per op type and phase, its runs and their time (start to end, as
 * user space's totals). A node's number is then its type, PI_OP_KEY(op, fused_op), not a
 * description's number: no descriptions are sent, and the per-thread tables (slots, walk
 * memo) that remember numbers remember types. An op event's number adds the phase of the
 * decode call under way at its start (PI_OP_PHASE), the op_totals key. */
#define PI_OP_KEY(op, fused_op) (((u32)(op) & 0xff) | ((((u32)(fused_op) + 1) & 0xff) << 8))
#define PI_OP_PHASE(phase) (((u32)(phase) & 0xff) << 16)
/* A decode call's phase, as TokenCall.phase: ops outside every call are "other" */
#define PI_PHASE_OTHER 0
#define PI_PHASE_PREFILL 1
#define PI_PHASE_DECODE 2
#define PI_PHASE_MIXED 3

struct pi_op_total {
    u64 calls;
    u64 ns;
};

/* A fused op's entry gap (struct pi_op_event: entry_gap_ns) and the release it follows,
 * kept for the latest PI_GAP_SAMPLES fused ops of each CPU when ops are counted */
#define PI_GAP_SAMPLES 1024

struct pi_gap_sample {
    u64 release_ns;
    u64 gap_ns;
};

/* Op events travel in per-thread batches: one ring-buffer record, one wakeup per batch. */
struct pi_op_batch {
    u32 kind;
    u32 count;
    struct pi_op_event ev[PI_OP_BATCH];
};

/* MoE routing: the expert ids a MUL_MAT_ID node read (its src[2]), one row per token,
 * PI_EXPERT_SLOTS slots per row of which the first n_used are meaningful. Sent at the node's
 * start by every thread that computes it, only the rows it holds (size varies). */
#define PI_MAX_EXPERT_ROWS 128
#define PI_EXPERT_SLOTS 8
#define PI_EXPERT_IDS 1024   /* PI_MAX_EXPERT_ROWS * PI_EXPERT_SLOTS */

struct pi_experts_event {
    u32 kind;
    u32 tid;
    u64 start_ns;        /* the op's start: joins it to its op event */
    u64 tensor;          /* the MUL_MAT_ID node */
    u64 ids_tensor;
    s32 n_used;          /* experts per token (ne0 of the ids) */
    s32 n_tokens;        /* rows in the ids (ne1); rows sent: min(n_tokens, PI_MAX_EXPERT_ROWS) */
    s32 ids[PI_EXPERT_IDS];
};

/* ---- per-thread op state (BPF's, drained by user space when collection ends) ---- */


/* A node is described once per thread, and again only when its description changes; its runs
 * carry its number. Which descriptions a thread sent is remembered in its own table of
 * PI_NODE_SETS sets of PI_NODE_WAYS slots, as 64-bit hashes of the descriptions (a map of full
 * descriptions cost ~0.5 µs of cache misses per node; a set is four cache lines).
 * Reading a description (the node and two sources: ~14 cache lines, cold after a matmul)
 * costs ~1.3 µs, so it is read only when it may have changed: a ggml tensor's description
 * is fixed when it is made, and a tensor can be made again at a used address, or have its
 * sources rewritten (the scheduler's input copies), only after ggml_init (of a context that
 * can hold one), ggml_reset or ggml_new_graph_custom. Each of those bumps graph_generation,
 * and a slot stamped with the current generation is trusted without reading. Where those
 * functions cannot be probed, every run is read and compared by hash. A graph
 * replays its nodes in the same order every token, so tensors that outnumber their set's
 * slots evict each other every token: with 512 direct-mapped slots a 1.5B model's ~270 nodes
 * had 40 a thread described again every token. With eight ways that takes nine of a
 * graph's nodes in one set of 256: about one chance in 10^6 for 300 nodes. */
#define PI_NODE_SETS 256
#define PI_NODE_WAYS 8
#define PI_NODE_SLOTS 2048    /* PI_NODE_SETS * PI_NODE_WAYS */

struct pi_node_slot {
    u64 hash;            /* of the whole description, tensor address included; 0: empty */
    u64 tensor;          /* a changed description replaces its tensor's slot */
    u64 fused_tensor;    /* the node fused with it (part of the description: checked too) */
    u32 node;            /* | PI_NODE_EXPERTS when it is a MUL_MAT_ID with expert ids */
    u32 generation;      /* graph_generation when the description was last read */
};
#define PI_NODE_EXPERTS 0x80000000u
/* A ggml context smaller than this cannot hold a tensor (struct ggml_tensor alone is larger) */
#define PI_MIN_TENSOR_CONTEXT 256

/* What every handler run touches comes first, so that a run touches few cache lines and
 * pages (between two nodes the engine streams weights through the caches and the TLB, and
 * each line or page the handler touches then is a miss): the flags and the current node,
 * its counter reads, its description and the window it is read through; then the batch,
 * written one slot a run; then the tables used now and then. */
/* The one-probe op level (llamacpp.bpf.c, op_node_end): where a thread is in its graph, and
 * what its walk found after each position, remembered while the graph and its descriptions
 * stay the same (llama.cpp reuses a graph for every token of the same shape). */
#define PI_WALK_MEMO 2048     /* graph positions remembered */
#define PI_WALK_NONE 0x7fffffffu   /* memo: no computed node follows */

struct pi_walk_memo {
    u32 node;            /* the node's number (| PI_NODE_EXPERTS), or PI_WALK_NONE */
    u8 first;            /* its position, and its fused partner's (or its own), after the */
    u8 last;             /* position the walk started from */
    u16 stamp;           /* valid when equal to pi_graph_walk.memo_stamp */
};

struct pi_graph_walk {
    u64 entry_ns;        /* the thread entered the graph loop: its first node's start */
    u64 nodes;           /* the graph's cgraph->nodes, read at its first barrier (0: not yet) */
    u64 fused_t;         /* a fused op began at this node ... */
    u64 fused_with;      /* ... and also computes this one */
    u64 fused_ns;        /* when it began */
    s32 n_nodes;
    s32 pos;             /* index of the last node the thread ended */
    u32 barrier;         /* barriers this thread met in the graph */
    u32 active;          /* the thread's graph loop was seen from its start */
    u64 memo_nodes;      /* the memo holds the walk of this graph's nodes ... */
    u32 memo_generation; /* ... in this graph generation */
    u32 memo_stamp;      /* (u16) its entries' stamp */
};

struct pi_op_thread {
    u32 has_cur;
    u32 next_node;                                   /* the number the next new node gets */
    u32 owner;           /* in op_threads_direct: the TID it is for; 0 free; PI_SLOT_RELEASING */
    u32 layout_checks;   /* descriptions read with pi_node_check filled (up to PI_CHECK_NODES) */
    struct pi_op_event cur;                          /* the node this thread is computing */
    struct pi_graph_walk walk;
    struct pi_counter_read ctr_start[PI_MAX_COUNTERS];   /* at the node's start */
    struct pi_counter_read ctr_end[PI_MAX_COUNTERS];     /* at its latest barrier */
    struct pi_node_event node;       /* the latest description read (at a node's start) */
    u8 window[PI_TENSOR_WINDOW];     /* a tensor's first bytes */
    struct pi_op_batch batch;        /* finished ops not yet sent */
    struct pi_node_slot sent[PI_NODE_SLOTS];   /* what this thread last sent, per tensor */
    struct pi_experts_event experts;           /* MoE routing being sent */
    struct pi_walk_memo memo[PI_WALK_MEMO];    /* indexed by the position a walk starts from */
};

#define PI_SLOT_RELEASING 0xffffffffu   /* being zeroed: not free yet */

/* Globals the op level reads on every run, in one cache line; user space writes
 * `collecting` = 0 to stop the op programs before it detaches them and reads their state */
struct pi_control {
    u32 graph_generation;  /* see struct pi_node_slot */
    u32 collecting;
};

/* Per-CPU tallies of the op level (map op_tallies), summed by user space into meta */
#define PI_TALLY_NODE_READS 0      /* descriptions read (not known from this generation) */
#define PI_TALLY_SLOTS_CLAIMED 1   /* thread states in a direct slot */
#define PI_TALLY_STATES_HASHED 2   /* thread states in the hash map (slot held, or none) */
#define PI_TALLY_OTHER_ENTRIES 3  /* probe hits in processes not followed (record's file probes) */
#define PI_TALLY_OTHER_RETURNS 4  /* and their return probes' hits */
#define PI_TALLY_BARE_HITS 5      /* hits of bare_hit (the benchmark's floor) */
#define PI_TALLY_WALK_LOST 6      /* one-probe op level: a barrier whose node was not found */
#define PI_TALLY_WALK_MISMATCH 7  /* a fused op's node was not the one the walk reached */
#define PI_TALLIES 8


/* Facts about the target, fixed before the programs load (the object's .rodata): offsets
 * from DWARF or a validated table, so one precompiled object serves every build. */
#define PI_MAX_GRAPH_PROBES 8

struct pi_config {
    struct pi_transport transport;   /* first: the core sets it (transport.h) */
    u64 t_off_type;        /* ggml_tensor fields */
    u64 t_off_ne;
    u64 t_off_op;
    u64 t_off_name;
    u64 cg_off_n_nodes;    /* ggml_cgraph.n_nodes */
    u64 token_sp_off;      /* llama_batch (by value) relative to sp at llama_decode's probe */
    u64 bext_off_tokens;   /* llama_batch_ext.tokens (a std::vector) */
    u64 bext_token_size;   /* its element size */
    u64 t_off_src;         /* ggml_tensor.src[] */
    u64 t_off_view_src;    /* ggml_tensor.view_src */
    u64 t_off_nb;          /* ggml_tensor.nb[] (byte strides) */
    u64 t_off_data;        /* ggml_tensor.data */
    s32 op_mul_mat_id;     /* GGML_OP_MUL_MAT_ID in this build's numbering (-1: none) */
    u32 graph_totals_only; /* graph computes counted in graph_totals, not sent */
    u32 graph_has_backend; /* bit i: graph probe i's first argument is a ggml_backend */
    u32 n_counters;        /* perf counters in `counters`, at index counter * n_cpus + cpu */
    u32 n_cpus;
    u32 nodes_by_generation;  /* graph_generation is kept (its probes are attached) */
    u32 thread_slots;         /* op_threads_direct's size, a power of two; 0: unused */
    u32 op_totals_only;       /* ops counted in op_totals by type, not sent (struct pi_op_total) */
    u64 init_params_sp_off;   /* ggml_init's params (by value) relative to sp at its entry */
    u32 check_layout;         /* a table layout: fill pi_node_check for the first nodes */
    u32 pad4;
    u64 bext_tok_off_pos;     /* llama_batch_ext::token.pos[0] */
    u64 bext_tok_off_seq;     /* llama_batch_ext::token.seq_ids' first node (0: not read) */
    u64 seq_node_value;       /* offset of the value in that hash-set node */
    /* the one-probe op level (op_node_end): the graph the barrier's threadpool computes */
    u64 tp_off_cgraph;        /* ggml_threadpool.cgraph */
    u64 cg_off_nodes;         /* ggml_cgraph.nodes */
    u64 t_off_flags;          /* ggml_tensor.flags */
    u32 compute_flag;         /* GGML_TENSOR_FLAG_COMPUTE (0: the loop computes every node) */
    u32 pad5;
    u64 empty_ops[2];         /* bit op: ggml_op_is_empty(op), ops below 128 */
    /* llama-server's request marks (struct pi_request_event), offsets from DWARF */
    u64 task_size;            /* sizeof(server_task) (0: the marks are not read) */
    u64 task_off_id;          /* server_task.id */
    u64 task_off_type;        /* server_task.type */
    u64 task_off_parent;      /* server_task.id_parent */
    u64 slot_off_id;          /* server_slot.id */
};
