/* vLLM's event layouts, shared by vllm.bpf.c and its decoder (profinfer/engines/vllm).
 * Layout rules: llamacpp.h's (profinfer/core/ebpf/layout.py parses this file). */
#pragma once

#include "transport.h"
#include "counters.h"

#define PI_ENGINE_VLLM 2         /* pi_open_span.engine (transport.h) */

#define PV_EV_OP 32           /* one call of a native op, sent at its return */

#define PV_MAX_OPS 1024       /* ops probed (op_specs holds two specs per op: below) */
#define PV_MAX_ARGS 40        /* C++ parameters described per op */
#define PV_MAX_TENSORS 32     /* tensor arguments read per call (a power of two) */
#define PV_MAX_DIMS 6         /* sizes kept per tensor (more: ndim says how many it had) */
#define PV_MAX_VALUES 64      /* integer values read from one small tensor per call */
/* A call sent with values and at most this many tensors has them sent right after its
 * tensors (in t: the record ends there), not in `values` (the whole record sent) */
#define PV_VALUES_FOLLOW 24
#define PV_MAX_DEPTH 4        /* ops open at once on one thread (an op calling another) */
#define PV_CTR_MIGRATED 1     /* the thread changed CPU inside the call */
#define PV_CTR_FAILED 2       /* a counter could not be read */

/* The op level counted in BPF (cfg.op_totals_only: no timeline asked): calls are added to
 * call_totals by op, argument shapes, thread, phase and nesting, and to the op's duration
 * histogram, not sent; the calls of ops whose spec says `send` (a step op, an op whose
 * argument values a cost model reads, an op the in-target trap is measured on) still are.
 * A phase is the thread's step's, read at its step op from the query start locations. */
#define PV_PHASE_OTHER 0      /* before the thread's first step (as core.stats.PHASES) */
#define PV_PHASE_PREFILL 1
#define PV_PHASE_DECODE 2
#define PV_PHASE_MIXED 3
/* A call's duration histogram: below 8 ns one bucket a nanosecond, then 8 buckets for each
 * power of two up to 2^40 ns (each within 1/8 of its lower bound). */
#define PV_HIST_SUB 8
#define PV_HIST_MAX_LOG2 40
#define PV_HIST_BUCKETS 312   /* PV_HIST_SUB * (PV_HIST_MAX_LOG2 - 2) + PV_HIST_SUB */

/* How a C++ parameter arrives (x86-64 SysV, after the hidden return pointer if any). */
#define PV_ARG_SKIP 0         /* in a vector register (double), or nothing to read */
#define PV_ARG_TENSOR 1       /* at::Tensor, by reference or by value: a pointer to its TensorImpl* */
#define PV_ARG_OPT_TENSOR 2   /* std::optional<at::Tensor>: a pointer to {TensorImpl*, bool engaged} */
#define PV_ARG_STABLE_TENSOR 3   /* torch::stable::Tensor&: a pointer to a shared_ptr whose first
                                  * word is an at::Tensor* (one more indirection) */
#define PV_ARG_OPT_STABLE_TENSOR 4   /* std::optional<torch::stable::Tensor>: a pointer to
                                      * {shared_ptr (two words), bool engaged} */

/* Where a probe sits: the attach cookie's top byte.
 * - PV_AT_FUNCTION: on the op's own C++ function; the cookie's low 32 bits are the op's index.
 * - on one of torch's kernel wrappers for a C++ signature (vLLM registers its ops by runtime
 *   function pointer, so one wrapper serves every op of that signature): the wrapper calls
 *   the op's function through a pointer in its functor (the OperatorKernel*), and that
 *   pointer, less the file's load bias, names the op in `op_by_fn`. The cookie carries
 *   the file (bits 48-55: a library index), the pointer's offset in the functor (bits
 *   40-47) and the probed instruction's address in the file (bits 0-39): the probe's
 *   address at run time minus it is the load bias.
 *   - PV_AT_BOXED: make_boxed_from_unboxed_functor<...>::call(functor, op handle, keys,
 *     std::vector<IValue>* stack): the op's arguments are the stack's last n_args IValues.
 *   - PV_AT_UNBOXED(_SRET): wrap_kernel_functor_unboxed_<...>::call([sret,] functor, keys,
 *     args...): SysV, each argument two or three integer slots further on than in the op's
 *     own function (its spec at op + PV_MAX_OPS); the functor in rdi (rsi after an sret). */
#define PV_AT_FUNCTION 0
#define PV_AT_BOXED 1
#define PV_AT_UNBOXED 2
#define PV_AT_UNBOXED_SRET 3
#define PV_OP_NONE 0xffffffff  /* a wrapper's call of a function that is no probed op */
#define PV_SITE_MASK ((1ULL << 56) - 1)   /* a wrapper probe's cookie less its kind */

/* An IValue (c10::IValue): a payload word (a Tensor's: its TensorImpl*), then a tag. */
struct pv_ivalue {
    u64 payload;
    u32 tag;
    u32 rest;
};
#define PV_IVALUE_TAG_TENSOR 1   /* None is 0: an empty optional */

struct pv_fn_key {
    u32 lib;                  /* the cookie's library index */
    u32 pad;
    u64 vaddr;                /* the op's function's address in that file */
};

/* Per op: each parameter's kind and its integer slot (0-5: rdi..r9, 6 on: the stack). */
struct pv_op_spec {
    u8 n_args;
    u8 values_of;             /* read the values of this tensor argument (0xff: none) */
    u8 starts_step;           /* a call of this op begins the thread's next step */
    u8 send;                  /* counted in BPF, still sent (see PV_PHASE_OTHER): 0 none, 1 every
                               * call, n: one in n of the thread's calls of such ops */
    u8 pad[4];
    u8 kind[PV_MAX_ARGS];
    u8 slot[PV_MAX_ARGS];
};

struct pv_tensor {
    u16 dtype;                /* c10::ScalarType */
    u8 arg;                   /* the C++ parameter it was */
    u8 ndim;                  /* 0xff: an empty optional, or unreadable */
    u32 pad;
    s64 numel;                /* TensorImpl's own count: the layout's live check */
    s64 sizes[PV_MAX_DIMS];
};

struct pv_op_event {
    u32 kind;
    u32 tid;
    u32 tgid;
    u32 op;                   /* index in the decoder's op list (PV_OP_NONE: not sent) */
    u64 start_ns;
    u64 end_ns;
    u64 step;                 /* the thread's step (open_spans) when the call began */
    u16 n_tensors;
    u16 depth;                /* ops already open on this thread when it began */
    u32 n_values;             /* values read (of values_of), at most PV_MAX_VALUES */
    u32 value_bytes;          /* 4 or 8 */
    u32 cpu;                  /* where it began (counters are per CPU) */
    u32 flags;                /* PV_CTR_*: why its counter deltas are not valid */
    u8 send;                  /* sent, not counted (its spec's send, at entry) */
    u8 phase;                 /* PV_PHASE_*: its thread's step's at entry */
    u16 pad;
    /* a step op's call: the thread's previous step as BPF saw it end (its last call's end
     * and its calls; 0: none), for a recording whose other calls were counted, not sent */
    u64 prev_step;
    u64 prev_step_end_ns;
    u64 prev_step_calls;
    struct pi_counter_read ctr[PI_MAX_COUNTERS];   /* read at entry; sent: end minus entry */
    struct pv_tensor t[PV_MAX_TENSORS];   /* sent: the first n_tensors, */
    s64 values[PV_MAX_VALUES];            /* and these only when n_values */
};

/* A thread's open ops (innermost last), each with the stack pointer at its entry probe (its
 * return address's slot: its return is matched by it). */
struct pv_thread {
    u32 depth;
    u32 phase;                /* PV_PHASE_* of its current step */
    u32 sampled;              /* its calls of ops sent one in n (pv_op_spec.send) */
    u32 pad;
    u64 sp[PV_MAX_DEPTH];
    u64 site[PV_MAX_DEPTH];   /* the wrapper each open call entered (its cookie less the
                               * place's kind: file and address), 0 on an op's own function */
    u64 step;                 /* the step its step_* count (open_spans' number) */
    u64 step_end_ns;          /* the latest end of a call begun in that step */
    u64 step_calls;           /* calls begun in that step that returned */
    u64 values_impl;          /* vop_enter's walk of the arguments: the TensorImpl whose
                               * values it reads */
    struct pv_op_event ev[PV_MAX_DEPTH];
};

/* call_totals' key: an op's calls with one argument signature (sig: a hash of its tensors'
 * arguments, dtypes and sizes) on one thread, in one phase, at the top level or inside
 * another op; call_totals_unkept's, with sig 0: those calls whose signature found
 * call_totals full. */
struct pv_total_key {
    u64 sig;
    u32 op;
    u32 tid;
    u32 tgid;
    u8 phase;
    u8 nested;
    u16 pad;
};

struct pv_call_total {
    u64 calls;
    u64 ns;
};

/* call_sigs' key: a signature's tensors (the value: pv_tensor[PV_MAX_TENSORS], the first
 * n_tensors as read at the first call that had it). */
struct pv_sig_key {
    u64 sig;
    u32 op;
    u32 n_tensors;
};

/* An op's counted calls: how many, their time, their durations' histogram. */
struct pv_op_hist {
    u64 calls;
    u64 ns;
    u64 buckets[PV_HIST_BUCKETS];
};

/* c10::TensorImpl's fields as this torch build lays them out (debug info or a validated
 * table: profinfer/engines/vllm/probes/tensors.py). */
struct pi_config {
    struct pi_transport transport;
    u64 ti_off_storage;       /* c10::Storage (an intrusive_ptr<StorageImpl>) */
    u64 st_off_data;          /* StorageImpl's data pointer */
    u64 ti_off_sizes;         /* SizesAndStrides: size_, then the inline sizes (or a pointer) */
    u64 ti_off_storage_offset;
    u64 ti_off_numel;
    u64 ti_off_dtype;         /* caffe2::TypeMeta's index: the ScalarType */
    u32 n_counters;           /* perf counters in `counters` (counters.bpf.h) */
    u32 n_cpus;
    u32 op_totals_only;       /* count calls (call_totals), sending only those whose spec says */
    u32 pad;
};
