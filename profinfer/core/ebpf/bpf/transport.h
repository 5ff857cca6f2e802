/* What every engine's events share with the core: the event kinds the core reads itself
 * (a followed process's changes) and the transport's configuration. An engine's header
 * (llamacpp.h for llama.cpp, vllm.h, ...) includes this one, and defines `struct pi_config`,
 * its object's .rodata, whose first member is `struct pi_transport`.
 *
 * Event kinds are one number space across engines: the core's below 16, each engine's in
 * its own range (llama.cpp 1-8, vLLM 32-47). Layout rules: llamacpp.h's (profinfer/core/ebpf/layout.py).
 */
#pragma once

#define PI_EV_FOLLOW 9
#define PI_EV_DISCOVER 20

/* The transport and process following, configured by the core for every object. */
struct pi_transport {
    u64 ring_wake_bytes;      /* unread bytes that wake the collector early */
    u32 follow;               /* probes are attached to files: run only for `followed` tgids */
    u32 pad;
};

/* The configuration of the core's own objects (follow, sched): theirs is the transport's,
 * and for sched the process to watch (without follow: one tgid). */
struct pi_core_config {
    struct pi_transport transport;
    u32 target_tgid;
    u32 switch_state_arg;     /* sched_switch passes prev_state as its 4th argument (5.18+) */
};

/* A followed process changed (follow.bpf.c). At PI_FOLLOW_EXEC and PI_FOLLOW_MAPPED it has been
 * sent SIGSTOP: user space attaches what the new code needs, then sends SIGCONT. */
#define PI_FOLLOW_EXEC 1      /* it exec'd a new image (kernel-mapped: executable, loader) */
#define PI_FOLLOW_MAPPED 2    /* its loader announced a library list change (_dl_debug_state) */
#define PI_FOLLOW_FORK 3      /* it forked a new process: `child` is followed from now on */
#define PI_FOLLOW_EXIT 4      /* its last thread exited */
#define PI_MAX_FOLLOWED 4096

/* The node's processes a `record` follows, for every record and daemon on it (recorded.bpf.h,
 * profinfer/core/ebpf/followed.py): tgid -> its start time in clock ticks since boot (/proc/PID/stat's
 * 22nd field), so that a reused PID is not taken for the process that had it. */
#define PI_MAX_RECORDED 16384
#define PI_NS_PER_TICK 10000000   /* USER_HZ is 100 (x86-64, arm64): nsec_to_clock_t() */

struct pi_follow_event {
    u32 kind;
    u32 tgid;
    u32 what;                 /* PI_FOLLOW_* */
    u32 child;                /* PI_FOLLOW_FORK: the new process */
    u64 ts_ns;
};

/* A file as the kernel names it (inode number, the kernel's encoding of its device). */
struct pi_file_key {
    u64 ino;
    u32 dev;
    u32 pad;
};

/* Node-wide discovery (discover.bpf.c). At PI_DISCOVER_CANDIDATE and PI_DISCOVER_LOADED the
 * process has been sent SIGSTOP: user space looks, then sends SIGCONT. */
#define PI_DISCOVER_EXEC 1        /* it exec'd a file not looked at yet (`file`); not stopped */
#define PI_DISCOVER_CANDIDATE 2   /* it maps a file named like an engine's, or exec'd an engine */
#define PI_DISCOVER_LOADED 3      /* its loader completed a list with an engine-named library */
#define PI_DISCOVER_SEEN 4        /* either of those where it may not be stopped: not stopped */
#define PI_EXEC_NONE 0            /* discover.bpf.c's verdicts on an executable file */
#define PI_EXEC_ENGINE 1
#define PI_EXEC_UNKNOWN 2
#define PI_MAX_HOOK_SITES 256     /* calls of _dl_debug_state probed, over every loader file */

struct pi_discover_event {
    u32 kind;
    u32 tgid;
    u32 what;                 /* PI_DISCOVER_* */
    u32 pad;
    u64 ts_ns;
    struct pi_file_key file;  /* PI_DISCOVER_EXEC */
};

/* A process discovery holds, in the node's pinned map `held` (core/ebpf/held.py): since when
 * (bpf_ktime_get_ns, CLOCK_MONOTONIC), which process (its start time in clock ticks,
 * /proc/PID/stat's) and which daemon holds it (the same): any daemon on the node continues
 * one whose holder died holding it. */
struct pi_process_id {
    u32 tgid;
    u32 pad;
    u64 start_ticks;
};

/* Every version from this one on keeps these fields first, in this order: a daemon reads
 * another version's map of held processes by them (held.py). */
struct pi_held {
    u64 since_ns;
    struct pi_process_id process;
    struct pi_process_id holder;
};

/* hold_deadline.bpf.c's configuration: the daemon whose holds it ends, and after how long. */
struct pi_hold_deadline_config {
    struct pi_process_id holder;
    u64 deadline_ns;
};


/* What is open on a thread now, for a level that runs under any engine (the CUDA runtime's
 * calls are attributed to it): the engine's step (a llama_decode call, a vLLM step) and its
 * innermost native op. Every engine's programs keep it in `open_spans` (common.bpf.h); such a
 * level's object reuses the map. */

struct pi_open_span {
    u64 step;                 /* steps begun on this thread so far (0: none) */
    u64 step_start_ns;        /* 0: no step open (llama.cpp: between decode calls) */
    u64 op_start_ns;          /* 0: no op open */
    u32 op;                   /* the engine's number for the op (vLLM: its op index) */
    u32 engine;               /* the engine's own number (its header defines it) */
};
