/* Following a process tree for `record`: the command, what it exec's, the processes it forks,
 * and the libraries their loaders map later (dlopen), each probed before its first call.
 *
 * `followed` (common.bpf.h) holds the tgids: a fork of a followed process adds the child
 * before it first runs, an exit removes it. At an exec, and whenever the dynamic loader
 * announces a change of its library list (glibc calls _dl_debug_state, the debuggers' r_debug
 * hook, after mapping a library and before relocating it or running its constructors), the
 * process is stopped (SIGSTOP, taking effect before it runs another user instruction) and
 * user space is told at once; it attaches the probes the new code needs, then sends SIGCONT.
 * Engine objects reuse `followed` and run only for these tgids.
 *
 * The fork program reads the child's task_struct with CO-RE (kernel BTF); the others need none.
 */
#include "common.bpf.h"
#include <bpf/bpf_core_read.h>

char LICENSE[] SEC("license") = "GPL";

#define SIGSTOP 19

struct task_struct {
    int pid;
    int tgid;
} __attribute__((preserve_access_index));

static __always_inline void tell(void *ctx, u32 tgid, u32 what, u32 child)
{
    struct pi_follow_event ev = {.kind = PI_EV_FOLLOW, .tgid = tgid, .what = what,
                                 .child = child, .ts_ns = bpf_ktime_get_ns()};
#ifdef PI_PERF_BUFFER
    if (bpf_perf_event_output(ctx, &events, BPF_F_CURRENT_CPU, &ev, sizeof(ev)))
#else
    /* a stopped process waits for this record: wake the reader now */
    if (bpf_ringbuf_output(&events, &ev, sizeof(ev), BPF_RB_FORCE_WAKEUP))
#endif
        count_lost(1);
}

static __always_inline u32 followed_tgid(void)
{
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    return bpf_map_lookup_elem(&followed, &tgid) ? tgid : 0;
}

/* Stop the current (followed) process until user space has looked at its new mappings. */
static __always_inline void stop_and_tell(void *ctx, u32 tgid, u32 what)
{
    bpf_send_signal(SIGSTOP);
    tell(ctx, tgid, what, 0);
}

/* sched_process_fork(struct task_struct *parent, struct task_struct *child): runs in the
 * parent before the child is first scheduled. A new thread is not a new process. */
SEC("raw_tp/sched_process_fork")
int follow_fork(struct bpf_raw_tracepoint_args *ctx)
{
    u32 parent = followed_tgid();
    if (!parent)
        return 0;
    struct task_struct *child = (struct task_struct *)ctx->args[1];
    u32 pid = BPF_CORE_READ(child, pid), tgid = BPF_CORE_READ(child, tgid);
    if (pid != tgid || tgid == parent)
        return 0;
    u32 one = 1;
    if (bpf_map_update_elem(&followed, &tgid, &one, BPF_ANY))
        count_lost(1);        /* more followed processes than PI_MAX_FOLLOWED */
    tell(ctx, parent, PI_FOLLOW_FORK, tgid);
    return 0;
}

/* sched_process_exec: `current` has its new image (same tgid). */
SEC("raw_tp/sched_process_exec")
int follow_exec(void *ctx)
{
    u32 tgid = followed_tgid();
    if (tgid)
        stop_and_tell(ctx, tgid, PI_FOLLOW_EXEC);
    return 0;
}

/* sched_process_exit runs for every exiting thread; the process ends with its leader's. */
SEC("raw_tp/sched_process_exit")
int follow_exit(void *ctx)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32;
    if ((u32)id != tgid || !bpf_map_lookup_elem(&followed, &tgid))
        return 0;
    bpf_map_delete_elem(&followed, &tgid);
    tell(ctx, tgid, PI_FOLLOW_EXIT, 0);
    return 0;
}

/* _dl_debug_state() in the dynamic loader, attached to the loader's file for all processes. */
SEC("uprobe")
int loader_changed(struct pt_regs *ctx)
{
    u32 tgid = followed_tgid();
    if (tgid)
        stop_and_tell(ctx, tgid, PI_FOLLOW_MAPPED);
    return 0;
}
