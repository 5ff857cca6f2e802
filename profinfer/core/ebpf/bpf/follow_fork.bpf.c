/* Following forks (see follow.bpf.c): a fork of a followed process adds the child to
 * `followed`, and to the node's `recorded` with its start time, before the child first runs.
 * The child's pid, tgid and start time are read with CO-RE, so this object needs kernel BTF;
 * it reuses the follower's maps. */
#include "follow.bpf.h"
#include <bpf/bpf_core_read.h>

char LICENSE[] SEC("license") = "GPL";

struct task_struct {
    int pid;
    int tgid;
    u64 start_boottime;       /* Linux 5.5; /proc/PID/stat's start time, in ns */
} __attribute__((preserve_access_index));

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
    if (bpf_core_field_exists(child->start_boottime)) {   /* before 5.5: no daemon discovery */
        u64 start = BPF_CORE_READ(child, start_boottime) / PI_NS_PER_TICK;
        bpf_map_update_elem(&recorded, &tgid, &start, BPF_ANY);
    }
    tell(ctx, parent, PI_FOLLOW_FORK, tgid);
    return 0;
}
