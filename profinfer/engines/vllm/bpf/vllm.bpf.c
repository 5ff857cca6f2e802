/* Uprobe programs for vLLM's native ops (the `_C` libraries' torch custom ops).
 *
 * One entry and one return program serve every op: the attach cookie says where the probe
 * sits (vllm.h: on the op's function, or on torch's kernel wrapper for the op's C++ signature,
 * where the op is looked up from the function the wrapper calls), and `op_specs` (filled by
 * the decoder from the op's C++ signature) says where each parameter arrives and whether it
 * is a tensor. At entry the tensors' shapes and dtypes are read from
 * their c10::TensorImpl (offsets in cfg), and the values of one small integer tensor where
 * the spec asks (a step's query start locations); the call is sent at its return.
 * Where no timeline is asked (cfg.op_totals_only), a call is counted at its return instead
 * (count_call), and sent only where its spec says.
 * Attach cookies need Linux 5.15, bpf_loop 5.17.
 */
#define PI_ENGINE_EVENTS "vllm.h"
#ifndef offsetof
#define offsetof(type, member) __builtin_offsetof(type, member)
#endif
#include "common.bpf.h"
#include "counters.bpf.h"

char LICENSE[] SEC("license") = "GPL";

struct {
    __uint(type, BPF_MAP_TYPE_ARRAY);
    __uint(max_entries, 2 * PV_MAX_OPS);
    __type(key, u32);
    __type(value, struct pv_op_spec);
} op_specs SEC(".maps");

/* The op each probed function is, by (library, address in its file): a wrapper's lookup. */
struct {
    __uint(type, BPF_MAP_TYPE_HASH);
    __uint(max_entries, PV_MAX_OPS);
    __type(key, struct pv_fn_key);
    __type(value, u32);
} op_by_fn SEC(".maps");

struct {
    __uint(type, BPF_MAP_TYPE_HASH);
    __uint(max_entries, 4096);
    __type(key, u32);
    __type(value, struct pv_thread);
} threads SEC(".maps");

/* A zeroed thread state to insert from (it is larger than the BPF stack). */
struct {
    __uint(type, BPF_MAP_TYPE_ARRAY);
    __uint(max_entries, 1);
    __type(key, u32);
    __type(value, struct pv_thread);
} zero_thread SEC(".maps");

/* ops entered deeper than PV_MAX_DEPTH, probe hits in processes not followed, wrapper hits
 * not sent (a call of a function that is no probed op, or a wrapper inside the same op's
 * wrapper), and calls seen through a typed (unboxed) wrapper */
#define PV_TALLY_TOO_DEEP 0
#define PV_TALLY_OTHER 1
#define PV_TALLY_OTHER_FN 2
#define PV_TALLY_TYPED 3
#define PV_TALLY_UNSENT_RETURNED 4     /* of the wrapper hits not sent, those ended by a return probe */
struct {
    __uint(type, BPF_MAP_TYPE_ARRAY);
    __uint(max_entries, 5);
    __type(key, u32);
    __type(value, u64);
} tallies SEC(".maps");

static __always_inline void tally(u32 which)
{
    tally_in(&tallies, which);
}

/* The op level counted (vllm.h: PV_PHASE_OTHER): calls by op, signature, thread, phase and
 * nesting; each signature's tensors, kept at its first call; each op's durations. */
struct {
    __uint(type, BPF_MAP_TYPE_HASH);
    __uint(max_entries, 16384);
    __type(key, struct pv_total_key);
    __type(value, struct pv_call_total);
} call_totals SEC(".maps");

struct {
    __uint(type, BPF_MAP_TYPE_HASH);
    __uint(max_entries, 4096);
    __type(key, struct pv_total_key);
    __type(value, struct pv_call_total);
} call_totals_unkept SEC(".maps");

struct {
    __uint(type, BPF_MAP_TYPE_HASH);
    __uint(map_flags, BPF_F_NO_PREALLOC);     /* 2 KiB a signature: made as they come */
    __uint(max_entries, 4096);
    __type(key, struct pv_sig_key);
    __type(value, struct pv_tensor[PV_MAX_TENSORS]);
} call_sigs SEC(".maps");

struct {
    __uint(type, BPF_MAP_TYPE_ARRAY);
    __uint(max_entries, 1);                   /* sized to the ops probed */
    __type(key, u32);
    __type(value, struct pv_op_hist);
} op_hists SEC(".maps");

/* An integer argument slot: registers first, then the stack above the return address (the
 * entry probe sits before the function moves its stack pointer). */
static __always_inline u64 slot_value(struct pt_regs *ctx, u32 slot)
{
    switch (slot) {
    case 0: return PT_REGS_PARM1(ctx);
    case 1: return PT_REGS_PARM2(ctx);
    case 2: return PT_REGS_PARM3(ctx);
    case 3: return PT_REGS_PARM4(ctx);
    case 4: return PT_REGS_PARM5(ctx);
    case 5: return PT_REGS_PARM6(ctx);
    }
    return read_u64(PT_REGS_SP(ctx) + 8 * (slot - 5));
}

/* TensorImpl from its SizesAndStrides to its dtype, where they lie together (every known
 * layout: SizesAndStrides' size word, 5 inline sizes and 5 strides, then storage_offset_,
 * numel_ and data_type_, 106 bytes): read at once, one user-memory read a tensor, not two.
 * PV_TI_READ bytes are read, which end within the object (tensors.py: sizes at 64 or 56 in
 * a TensorImpl of 184 or 176 bytes), into words indexed under a power-of-two mask. */
#define PV_TI_READ 112
struct pv_ti_span {
    u64 words[16];
};

static __always_inline void mark_unreadable(struct pv_tensor *t)
{
    /* nothing read: what the slot held before must not tell calls apart */
    __builtin_memset(t->sizes, 0, sizeof(t->sizes));
    t->numel = 0;
    t->dtype = 0;
}

static __always_inline void read_tensor(struct pv_tensor *t, u64 impl)
{
    t->ndim = 0xff;
    t->pad = 0;                 /* the slot may hold what a call's values left (their copy) */
    if (!impl) {
        mark_unreadable(t);
        return;
    }
    u64 ndim;
    u64 numel_at = cfg.ti_off_numel - cfg.ti_off_sizes, dtype_at = cfg.ti_off_dtype - cfg.ti_off_sizes;
    if (cfg.ti_off_numel > cfg.ti_off_sizes && cfg.ti_off_dtype == cfg.ti_off_numel + 8
        && numel_at % 8 == 0 && dtype_at + 8 <= PV_TI_READ) {
        struct pv_ti_span span;
        if (bpf_probe_read_user(&span, PV_TI_READ, (void *)(impl + cfg.ti_off_sizes))) {
            mark_unreadable(t);
            return;
        }
        ndim = span.words[0];
        __builtin_memcpy(t->sizes, &span.words[1], sizeof(t->sizes));
        t->numel = span.words[(numel_at / 8) & 15];
        t->dtype = (u16)span.words[(dtype_at / 8) & 15];
    } else {
        /* SizesAndStrides' size word and its inline sizes in one read, into numel and sizes
         * (adjacent in pv_tensor): numel holds the dimension count until it is read itself */
        if (bpf_probe_read_user(&t->numel, sizeof(t->numel) + sizeof(t->sizes),
                                (void *)(impl + cfg.ti_off_sizes))) {
            mark_unreadable(t);
            return;
        }
        ndim = t->numel;
        bpf_probe_read_user(&t->dtype, sizeof(t->dtype), (void *)(impl + cfg.ti_off_dtype));
        bpf_probe_read_user(&t->numel, sizeof(t->numel), (void *)(impl + cfg.ti_off_numel));
    }
    /* up to 5 dims inline (sizes, then strides); beyond, the first word points to them */
    if (ndim > 5)
        bpf_probe_read_user(t->sizes, sizeof(t->sizes), (void *)t->sizes[0]);
    t->ndim = ndim > 254 ? 254 : ndim;
}

/* The values of a small integer tensor (ScalarType Int or Long), as many as fit. */
static __always_inline void read_values(struct pv_op_event *ev, u64 impl, u16 dtype)
{
    u32 bytes = dtype == 3 ? 4 : dtype == 4 ? 8 : 0;
    if (!impl || !bytes)
        return;
    u64 storage = read_u64(impl + cfg.ti_off_storage);
    u64 data = storage ? read_u64(storage + cfg.st_off_data) : 0;
    u64 numel = read_u64(impl + cfg.ti_off_numel);
    if (!data)
        return;
    data += read_u64(impl + cfg.ti_off_storage_offset) * bytes;
    u32 n = numel < PV_MAX_VALUES * 8 / bytes ? numel : PV_MAX_VALUES * 8 / bytes;
    u32 size = (n * bytes) & (PV_MAX_VALUES * 8 - 1);
    if (!size && n)
        size = PV_MAX_VALUES * 8;
    if (size && !bpf_probe_read_user(ev->values, size, (void *)data)) {
        ev->n_values = n;
        ev->value_bytes = bytes;
    }
}

/* A boxed call's last arguments' IValues, read at once (one user-memory read, not one a
 * tensor) into ev->values, free until the arguments are read. */
#define PV_IVALUES_READ (sizeof(((struct pv_op_event *)0)->values) / sizeof(struct pv_ivalue))

/* What the walk changes lives in maps (ev->n_tensors, th->values_impl), never here on the
 * stack: a counter on the stack is a new value to the verifier at each pass of bpf_loop's
 * callback, which Linux 6.7+ verifies until its states repeat (with it here, vop_enter took
 * 27,000 verifier states, ~250 MiB of kernel memory charged to the loader's cgroup). */
struct arg_walk {
    struct pt_regs *ctx;
    struct pv_op_spec *spec;
    struct pv_op_event *ev;
    struct pv_thread *th;
    u32 boxed;                /* the arguments are IValues (a boxed wrapper's), not SysV slots */
    u64 ivalues_end;          /* a boxed call's: its stack's end (0: unreadable) */
    u32 ivalues_read;         /* its last IValues, read at once into ev->values (free until
                               * the walk ends) */
};

/* A tensor argument of a boxed call: its IValue, n_args - i from the stack's end; None
 * (an empty optional) has no TensorImpl. */
static __always_inline u64 ivalue_impl(struct arg_walk *a, u32 i)
{
    struct pv_ivalue iv = {};
    u32 back = a->spec->n_args - i;
    if (back <= a->ivalues_read) {
        struct pv_ivalue *read = (struct pv_ivalue *)a->ev->values;
        iv = read[(a->ivalues_read - back) & (PV_IVALUES_READ - 1)];
    } else {
        bpf_probe_read_user(&iv, sizeof(iv), (void *)(a->ivalues_end - sizeof(iv) * (u64)back));
    }
    return iv.tag == PV_IVALUE_TAG_TENSOR ? iv.payload : 0;
}

static __always_inline void read_ivalues(struct arg_walk *a)
{
    u32 n = a->spec->n_args;
    if (n > PV_IVALUES_READ)
        n = PV_IVALUES_READ;
    if (n && !bpf_probe_read_user(a->ev->values, n * sizeof(struct pv_ivalue),
                                  (void *)(a->ivalues_end - n * sizeof(struct pv_ivalue))))
        a->ivalues_read = n;
}

/* A tensor argument in a SysV slot: its TensorImpl (0: an empty optional). */
static __always_inline u64 slot_impl(struct pt_regs *ctx, u8 kind, u32 slot)
{
    u64 p = slot_value(ctx, slot);
    if (kind == PV_ARG_OPT_TENSOR || kind == PV_ARG_OPT_STABLE_TENSOR) {
        u8 engaged = 0;
        bpf_probe_read_user(&engaged, 1, (void *)(p + (kind == PV_ARG_OPT_TENSOR ? 8 : 16)));
        if (!engaged)
            p = 0;
    }
    if (p && (kind == PV_ARG_STABLE_TENSOR || kind == PV_ARG_OPT_STABLE_TENSOR))
        p = read_u64(p);            /* the shared_ptr's pointer: an at::Tensor */
    return p ? read_u64(p) : 0;     /* an at::Tensor's one word: its TensorImpl */
}

/* One C++ parameter (bpf_loop's callback: one verification whatever the count). */
static long read_arg(u32 i, struct arg_walk *a)
{
    u32 n = a->ev->n_tensors;
    if (i >= PV_MAX_ARGS || i >= a->spec->n_args || n >= PV_MAX_TENSORS)
        return 1;
    u8 kind = a->spec->kind[i];
    if (kind == PV_ARG_SKIP)
        return 0;
    u64 impl = !a->boxed ? slot_impl(a->ctx, kind, a->spec->slot[i])
               : a->ivalues_end ? ivalue_impl(a, i) : 0;
    struct pv_tensor *t = &a->ev->t[n & (PV_MAX_TENSORS - 1)];
    t->arg = i;
    read_tensor(t, impl);
    if (i == a->spec->values_of)
        a->th->values_impl = impl;
    a->ev->n_tensors = n + 1;
    return 0;
}

/* The op a wrapper is calling: the function its functor points to, less the load bias (the
 * probe's address at run time less its address in the file). */
static __always_inline u32 wrapped_op(struct pt_regs *ctx, u64 cookie, u32 at)
{
    /* both read (the verifier refuses a context offset chosen at run time) */
    u64 first = PT_REGS_PARM1(ctx), second = PT_REGS_PARM2(ctx);
    asm volatile("" : "+r"(first), "+r"(second));
    u64 functor = at == PV_AT_UNBOXED_SRET ? second : first;
    u64 fn = read_u64(functor + ((cookie >> 40) & 0xff));
    u64 bias = PT_REGS_IP(ctx) - (cookie & ((1ULL << 40) - 1));
    struct pv_fn_key key = {.lib = (cookie >> 48) & 0xff, .vaddr = fn - bias};
    u32 *op = bpf_map_lookup_elem(&op_by_fn, &key);
    return op ? *op : PV_OP_NONE;
}

/* A step's phase from its query start locations (steps.py, Step.phase): a sequence of one
 * new token decodes, any other prefills. */
struct phase_walk {
    struct pv_op_event *ev;
    s64 prev;
    u32 prefill;
    u32 decode;
};

static long phase_of_seq(u32 i, struct phase_walk *w)
{
    struct pv_op_event *ev = w->ev;
    if (i >= ev->n_values)
        return 1;
    s64 v = ev->value_bytes == 4 ? (s64)((s32 *)ev->values)[i & (2 * PV_MAX_VALUES - 1)]
                                 : ev->values[i & (PV_MAX_VALUES - 1)];
    if (i) {
        if (v - w->prev == 1)
            w->decode = 1;
        else
            w->prefill = 1;
    }
    w->prev = v;
    return 0;
}

static __always_inline u32 step_phase(struct pv_op_event *ev)
{
    struct phase_walk w = {.ev = ev};
    bpf_loop(2 * PV_MAX_VALUES, phase_of_seq, &w, 0);
    if (!w.prefill)
        return PV_PHASE_DECODE;
    return w.decode ? PV_PHASE_MIXED : PV_PHASE_PREFILL;
}

/* The thread's next step begins at this step op's call: the one before, as its calls
 * ended, goes with this call's record. */
static __always_inline void begin_step(struct pv_thread *th, struct pv_op_event *ev, u64 step, u32 phase)
{
    ev->prev_step = th->step;
    ev->prev_step_end_ns = th->step_end_ns;
    ev->prev_step_calls = th->step_calls;
    th->step = step;
    th->step_end_ns = 0;
    th->step_calls = 0;
    th->phase = phase;
}

/* A call's argument signature: its tensors' arguments, dtypes and sizes, hashed (0 is kept
 * for "not kept"). */
struct sig_walk {
    struct pv_op_event *ev;
    u64 h;
};

static __always_inline u64 mix(u64 h, u64 word)
{
    h = (h ^ word) * 0x9e3779b97f4a7c15ULL;
    return h ^ (h >> 29);
}

static long hash_tensor(u32 i, struct sig_walk *w)
{
    if (i >= w->ev->n_tensors || i >= PV_MAX_TENSORS)
        return 1;
    struct pv_tensor *t = &w->ev->t[i & (PV_MAX_TENSORS - 1)];
    u64 h = mix(w->h, ((u64)t->arg << 24) | ((u64)t->ndim << 16) | t->dtype);
    u32 ndim = t->ndim == 0xff ? 0 : t->ndim;
#pragma unroll
    for (u32 d = 0; d < PV_MAX_DIMS; d++) {
        if (d < ndim)
            h = mix(h, t->sizes[d]);
    }
    w->h = h;
    return 0;
}

/* vllm.h: PV_HIST_SUB buckets a power of two (8: the shift by e - 3) */
static __always_inline u32 hist_bucket(u64 ns)
{
    if (ns < PV_HIST_SUB)
        return ns;
    u32 e = log2_u64(ns);
    if (e > PV_HIST_MAX_LOG2)
        return PV_HIST_BUCKETS - 1;
    return PV_HIST_SUB * (e - 2) + ((ns >> (e - 3)) & (PV_HIST_SUB - 1));
}

/* The call counted, not sent: into its key's total (a new key's signature kept), and its
 * duration into its op's histogram. */
static __always_inline void count_call(struct pv_op_event *ev, u32 depth)
{
    struct sig_walk w = {.ev = ev, .h = 0xcbf29ce484222325ULL};
    bpf_loop(PV_MAX_TENSORS, hash_tensor, &w, 0);
    struct pv_total_key key = {.sig = w.h ? w.h : 1, .op = ev->op, .tid = ev->tid,
                               .tgid = ev->tgid, .phase = ev->phase, .nested = depth > 0};
    struct pv_call_total *t = bpf_map_lookup_elem(&call_totals, &key);
    if (!t) {
        struct pv_call_total zero = {};
        if (!bpf_map_update_elem(&call_totals, &key, &zero, BPF_NOEXIST)) {
            struct pv_sig_key sk = {.sig = key.sig, .op = ev->op,
                                    .n_tensors = ev->n_tensors > PV_MAX_TENSORS ? PV_MAX_TENSORS : ev->n_tensors};
            bpf_map_update_elem(&call_sigs, &sk, ev->t, BPF_NOEXIST);
        }
        t = bpf_map_lookup_elem(&call_totals, &key);
        if (!t) {               /* full: its op's calls of signatures not kept */
            key.sig = 0;
            t = bpf_map_lookup_elem(&call_totals_unkept, &key);
            if (!t) {
                bpf_map_update_elem(&call_totals_unkept, &key, &zero, BPF_NOEXIST);
                t = bpf_map_lookup_elem(&call_totals_unkept, &key);
            }
        }
    }
    u64 ns = ev->end_ns > ev->start_ns ? ev->end_ns - ev->start_ns : 0;
    if (t) {
        __sync_fetch_and_add(&t->calls, 1);
        __sync_fetch_and_add(&t->ns, ns);
    } else {
        count_lost(1);          /* in its op's count below, in no signature's */
    }
    u32 op = ev->op;
    struct pv_op_hist *h = bpf_map_lookup_elem(&op_hists, &op);
    if (h) {
        __sync_fetch_and_add(&h->calls, 1);
        __sync_fetch_and_add(&h->ns, ns);
        u32 b = hist_bucket(ns);
        if (b < PV_HIST_BUCKETS)
            __sync_fetch_and_add(&h->buckets[b], 1);
    }
}

SEC("uprobe")
int vop_enter(struct pt_regs *ctx)
{
    if (!in_target()) {
        tally(PV_TALLY_OTHER);
        return 0;
    }
    u64 id = bpf_get_current_pid_tgid();
    u64 cookie = bpf_get_attach_cookie(ctx);
    u32 at = cookie >> 56;
    u32 tid = (u32)id, op = at == PV_AT_FUNCTION ? (u32)cookie : wrapped_op(ctx, cookie, at);
    u32 spec_at = at >= PV_AT_UNBOXED ? op + PV_MAX_OPS : op;
    struct pv_op_spec *spec = op == PV_OP_NONE ? 0 : bpf_map_lookup_elem(&op_specs, &spec_at);
    if (!spec && at == PV_AT_FUNCTION)
        return 0;
    struct pv_thread *th = bpf_map_lookup_elem(&threads, &tid);
    if (!th) {
        u32 zero = 0;
        struct pv_thread *z = bpf_map_lookup_elem(&zero_thread, &zero);
        if (!z)
            return 0;
        bpf_map_update_elem(&threads, &tid, z, BPF_NOEXIST);
        th = bpf_map_lookup_elem(&threads, &tid);
        if (!th)
            return 0;
    }
    /* an open call has its return address above this one's: those at or below never
     * returned (see vop_return) */
    u64 sp = PT_REGS_SP(ctx);
    u32 open = th->depth;
    /* calls opened beyond the deepest kept one are known by their count alone: where the
     * deepest kept one never returned, neither did they */
    if (open > PV_MAX_DEPTH && th->sp[PV_MAX_DEPTH - 1] <= sp)
        open = PV_MAX_DEPTH;
    if (open <= PV_MAX_DEPTH) {
#pragma unroll
        for (u32 k = 0; k < PV_MAX_DEPTH; k++) {
            if (open && th->sp[(open - 1) & (PV_MAX_DEPTH - 1)] <= sp)
                open--;
        }
        th->depth = open;
    }
    u32 depth = th->depth++;
    if (depth >= PV_MAX_DEPTH) {
        tally(PV_TALLY_TOO_DEEP);
        return 0;
    }
    struct pv_op_event *ev = &th->ev[depth & (PV_MAX_DEPTH - 1)];
    th->sp[depth & (PV_MAX_DEPTH - 1)] = sp;     /* the return address's slot */
    th->site[depth & (PV_MAX_DEPTH - 1)] = at == PV_AT_FUNCTION ? 0 : cookie & PV_SITE_MASK;
    /* a boxed wrapper that calls the typed one of the same signature: the call is the outer's */
    if (spec && at != PV_AT_FUNCTION && depth && th->ev[(depth - 1) & (PV_MAX_DEPTH - 1)].op == op)
        spec = 0;
    if (!spec) {                /* not sent: its return pops this */
        ev->op = PV_OP_NONE;
        tally(PV_TALLY_OTHER_FN);
        return 0;
    }
    if (at >= PV_AT_UNBOXED)
        tally(PV_TALLY_TYPED);
    ev->kind = PV_EV_OP;
    ev->tid = tid;
    ev->tgid = id >> 32;
    ev->op = op;
    ev->depth = depth;
    ev->n_values = 0;
    ev->value_bytes = 0;
    ev->step = 0;
    ev->prev_step = 0;
    ev->send = spec->send == 1 || (spec->send > 1 && th->sampled++ % spec->send == 0);
    struct arg_walk a = {.ctx = ctx, .spec = spec, .ev = ev, .th = th};
    if (at == PV_AT_BOXED) {    /* std::vector<IValue>*: its end pointer is its second word */
        a.boxed = 1;
        a.ivalues_end = read_u64(PT_REGS_PARM4(ctx) + 8);
        if (a.ivalues_end)
            read_ivalues(&a);
    }
    ev->n_tensors = 0;
    th->values_impl = 0;
    bpf_loop(PV_MAX_ARGS, read_arg, &a, 0);
    u64 values_impl = th->values_impl;
    if (values_impl) {
        u16 dtype = 0;
        bpf_probe_read_user(&dtype, sizeof(dtype), (void *)(values_impl + cfg.ti_off_dtype));
        read_values(ev, values_impl, dtype);
    }
    u32 phase = spec->starts_step ? step_phase(ev) : PV_PHASE_OTHER;
    ev->flags = 0;
    if (cfg.n_counters) {       /* last before the clock: the call's own work is what counts */
        ev->cpu = bpf_get_smp_processor_id();
        if (read_counters(ev->ctr, ev->cpu))
            ev->flags |= PV_CTR_FAILED;
    }
    ev->start_ns = bpf_ktime_get_ns();
    /* what is open on this thread, for levels under the engine (common.bpf.h) */
    struct pi_open_span *span = open_span(tid, PI_ENGINE_VLLM);
    if (span) {
        if (spec->starts_step) {
            span->step++;
            span->step_start_ns = ev->start_ns;
            begin_step(th, ev, span->step, phase);
        }
        span->op = op;
        span->op_start_ns = ev->start_ns;
        ev->step = span->step;
    }
    ev->phase = ev->step ? th->phase : PV_PHASE_OTHER;
    return 0;
}

/* The thread's open call at `depth` (its innermost) ends at `now` (by a return probe:
 * returned): counted or sent. */
static __always_inline int end_call(struct pt_regs *ctx, struct pv_thread *th, u32 depth, u64 now,
                                    int returned)
{
    th->depth = depth;
    u32 tid = current_tid();
    struct pv_op_event *ev = &th->ev[depth & (PV_MAX_DEPTH - 1)];
    if (ev->op == PV_OP_NONE) { /* nothing was opened: nothing to send or reopen */
        if (returned)
            tally(PV_TALLY_UNSENT_RETURNED);
        return 0;
    }
    ev->end_ns = now;
    if (ev->step && ev->step == th->step) {     /* the step's end, as its calls return */
        th->step_calls++;
        if (now > th->step_end_ns)
            th->step_end_ns = now;
    }
    if (cfg.n_counters && !ev->flags) {
        if (bpf_get_smp_processor_id() != ev->cpu) {
            ev->flags |= PV_CTR_MIGRATED;
        } else {
            struct pi_counter_read end[PI_MAX_COUNTERS] = {};
            if (read_counters(end, ev->cpu))
                ev->flags |= PV_CTR_FAILED;
#pragma unroll
            for (u32 i = 0; i < PI_MAX_COUNTERS; i++) {
                ev->ctr[i].counter = end[i].counter - ev->ctr[i].counter;
                ev->ctr[i].enabled = end[i].enabled - ev->ctr[i].enabled;
                ev->ctr[i].running = end[i].running - ev->ctr[i].running;
            }
        }
    }
    if (cfg.op_totals_only && !ev->send) {
        count_call(ev, depth);
    } else {
        /* a record as long as what it holds: most calls have a few tensors and no values,
         * and those with values a few of them */
        u32 size = sizeof(*ev);
        u32 n = ev->n_tensors;
        if (n > PV_MAX_TENSORS)
            n = PV_MAX_TENSORS;
        if (!ev->n_values) {
            size = offsetof(struct pv_op_event, t) + n * sizeof(struct pv_tensor);
        } else if (n <= PV_VALUES_FOLLOW) {
            u32 bytes = ev->n_values * ev->value_bytes;
            if (bytes > sizeof(ev->values))
                bytes = sizeof(ev->values);
            bpf_probe_read_kernel(&ev->t[n], bytes, ev->values);
            size = offsetof(struct pv_op_event, t) + n * sizeof(struct pv_tensor) + bytes;
        }
        if (emit(ctx, ev, size))
            count_lost(1);
    }
    struct pi_open_span *span = bpf_map_lookup_elem(&open_spans, &tid);
    if (span) {                 /* the op that called this one, if any, is open again */
        struct pv_op_event *outer = &th->ev[(depth - 1) & (PV_MAX_DEPTH - 1)];
        u32 open = depth && outer->op != PV_OP_NONE;
        span->op = open ? outer->op : 0;
        span->op_start_ns = open ? outer->start_ns : 0;
    }
    return 0;
}

/* The thread's open calls once those entered below `bound` are dropped (they never ended
 * here: an exception unwound them, or they entered before the probe ending them was
 * attached); NULL where none is left, or where the call ending is one too deep to have been
 * kept. */
static __always_inline struct pv_thread *open_calls_from(u64 bound)
{
    u32 tid = current_tid();
    struct pv_thread *th = bpf_map_lookup_elem(&threads, &tid);
    if (!th || !th->depth)
        return 0;
    if (th->depth > PV_MAX_DEPTH) {     /* beyond the deepest kept call: see vop_enter */
        if (th->sp[PV_MAX_DEPTH - 1] >= bound) {
            th->depth--;                /* one too deep to have been kept ends */
            return 0;
        }
        th->depth = PV_MAX_DEPTH;
    }
    u32 depth = th->depth;
#pragma unroll
    for (u32 k = 0; k < PV_MAX_DEPTH; k++) {
        if (depth && th->sp[(depth - 1) & (PV_MAX_DEPTH - 1)] < bound)
            depth--;
    }
    th->depth = depth;
    return depth ? th : 0;
}

/* A return probe: the call returning is the open one whose return address sat just below
 * this stack pointer; none where it began before the probes were attached. */
SEC("uretprobe")
int vop_return(struct pt_regs *ctx)
{
    u64 now = bpf_ktime_get_ns();
    u64 sp = PT_REGS_SP(ctx);
    struct pv_thread *th = open_calls_from(sp - 8);
    if (!th || th->sp[(th->depth - 1) & (PV_MAX_DEPTH - 1)] + 8 != sp)
        return 0;
    return end_call(ctx, th, th->depth - 1, now, 1);
}

/* A wrapper's end probe: the first instruction the kernel emulates after its call of the op
 * returned (wrappers.py): one emulated trap, and nothing put on the stack where C++'s
 * unwinder would meet it. The wrapper's frame lies below its entry's stack pointer, so open
 * calls entered at or below this one never ended; the call ending is the one the same
 * wrapper opened (its cookie), else none (it began before the probes). */
SEC("uprobe")
int vop_end(struct pt_regs *ctx)
{
    u64 now = bpf_ktime_get_ns();
    struct pv_thread *th = open_calls_from(PT_REGS_SP(ctx) + 1);
    if (!th || th->site[(th->depth - 1) & (PV_MAX_DEPTH - 1)] != (bpf_get_attach_cookie(ctx) & PV_SITE_MASK))
        return 0;
    return end_call(ctx, th, th->depth - 1, now, 0);
}
