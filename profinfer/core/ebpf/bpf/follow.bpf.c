/* Following a process tree for `record`: the command, what it exec's, the processes it forks,
 * and the libraries their loaders map later (dlopen), each probed before its first call.
 *
 * `followed` (common.bpf.h) holds the tgids: a fork of a followed process adds the child
 * before it first runs, an exit removes it. At an exec, and whenever the dynamic loader
 * announces a change of its library list (glibc calls _dl_debug_state, the debuggers' r_debug
 * hook, after mapping a library and before relocating it or running its constructors), the
 * process is stopped (SIGSTOP, taking effect before it runs another user instruction) and
 * user space is told at once; it attaches the probes the new code needs, then sends SIGCONT.
 * Engine objects reuse `followed` and run only for these tgids. The node's `recorded`
 * (recorded.bpf.h) holds them too, with their start times, for a daemon's discovery to leave
 * alone: follow_fork adds a child, follow_exit removes a process.
 *
 * Forks are followed by follow_fork.bpf.c, a separate object because it reads the child's
 * task_struct with CO-RE (kernel BTF): this one loads without BTF.
 */
#include "follow.bpf.h"

char LICENSE[] SEC("license") = "GPL";


/* Stop the current (followed) process until user space has looked at its new mappings. */
static __always_inline void stop_and_tell(void *ctx, u32 tgid, u32 what)
{
    PI_STOP_AND_TELL(tell(ctx, tgid, what, 0));
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

/* sched_process_exit runs for every exiting thread; a process is let go when its leader
 * thread exits (a leader that exits before the process's other threads ends following early). */
SEC("raw_tp/sched_process_exit")
int follow_exit(void *ctx)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32;
    if ((u32)id != tgid || !bpf_map_lookup_elem(&followed, &tgid))
        return 0;
    bpf_map_delete_elem(&followed, &tgid);
    bpf_map_delete_elem(&recorded, &tgid);
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
