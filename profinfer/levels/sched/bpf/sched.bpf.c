/* Scheduler level: context switches and wakeups of the target's threads.
 *
 * Raw tracepoints (attached by name: no tracefs), filtered in the kernel to the target's
 * process. The few task_struct fields are read with CO-RE, relocated by libbpf against the
 * running kernel's BTF, so no kernel headers are involved; a kernel without BTF cannot load
 * this object, which is why it is separate from the engines' uprobe programs, whose maps it
 * reuses (events, lost, and followed where a process tree is followed).
 */
#include "common.bpf.h"
#include "sched.h"
#include <bpf/bpf_core_read.h>

char LICENSE[] SEC("license") = "GPL";

struct task_struct {
    int pid;
    int tgid;
    char comm[16];
    unsigned int __state;
} __attribute__((preserve_access_index));

struct task_struct___pre514 {   /* before 5.14 the field was `long state` */
    long state;
} __attribute__((preserve_access_index));

/* One of the processes watched: the target, or with follow any followed one. */
static __always_inline int watched(u32 tgid)
{
    if (!cfg.transport.follow)
        return tgid == cfg.target_tgid;
    return bpf_map_lookup_elem(&followed, &tgid) != 0;
}

static __always_inline void fill_task(struct task_struct *t, u32 *tid, u32 *tgid, char *comm)
{
    *tid = BPF_CORE_READ(t, pid);
    *tgid = BPF_CORE_READ(t, tgid);
    /* not BPF_CORE_READ_STR_INTO: it sizes the copy by *dst, one char here */
    bpf_core_read_str(comm, PI_COMM_LEN, &t->comm);
}

SEC("raw_tp/sched_switch")
int sched_switch(struct bpf_raw_tracepoint_args *ctx)
{
    struct task_struct *prev = (struct task_struct *)ctx->args[1];
    struct task_struct *next = (struct task_struct *)ctx->args[2];
    u32 prev_tgid = BPF_CORE_READ(prev, tgid);
    u32 next_tgid = BPF_CORE_READ(next, tgid);
    if (!watched(prev_tgid) && !watched(next_tgid))
        return 0;
    struct pi_sched_event ev = {};
    ev.kind = PI_EV_SWITCH;
    ev.cpu = bpf_get_smp_processor_id();
    ev.ts_ns = bpf_ktime_get_ns();
    fill_task(prev, &ev.prev_tid, &ev.prev_tgid, ev.prev_comm);
    fill_task(next, &ev.next_tid, &ev.next_tgid, ev.next_comm);
    if (ctx->args[0]) {
        ev.prev_state = 0;            /* preempted: still runnable, whatever it was about to do */
    } else if (cfg.switch_state_arg) {
        ev.prev_state = (s64)(u32)ctx->args[3];
    } else if (bpf_core_field_exists(prev->__state)) {
        ev.prev_state = BPF_CORE_READ(prev, __state);
    } else {
        struct task_struct___pre514 *old = (void *)prev;
        ev.prev_state = BPF_CORE_READ(old, state);
    }
    if (emit(ctx, &ev, sizeof(ev)))
        count_lost(1);
    return 0;
}

SEC("raw_tp/sched_wakeup")
int sched_wakeup(struct bpf_raw_tracepoint_args *ctx)
{
    struct task_struct *woken = (struct task_struct *)ctx->args[0];
    if (!watched((u32)BPF_CORE_READ(woken, tgid)))
        return 0;
    struct pi_sched_event ev = {};
    ev.kind = PI_EV_WAKEUP;
    ev.cpu = bpf_get_smp_processor_id();
    ev.ts_ns = bpf_ktime_get_ns();
    u64 id = bpf_get_current_pid_tgid();
    ev.prev_tid = (u32)id;
    ev.prev_tgid = id >> 32;
    bpf_get_current_comm(ev.prev_comm, sizeof(ev.prev_comm));
    fill_task(woken, &ev.next_tid, &ev.next_tgid, ev.next_comm);
    if (emit(ctx, &ev, sizeof(ev)))
        count_lost(1);
    return 0;
}
