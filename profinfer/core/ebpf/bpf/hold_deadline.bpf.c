/* A deadline for discovery's holds that the agent's liveness does not decide: a process
 * that discover.bpf.c stopped for this daemon (an entry of the node's `held` map naming it
 * as holder) is continued by the kernel once it has been held `deadline_ns`, whether the
 * daemon is stopped (SIGSTOP), frozen by a cgroup freezer, or stuck in its loop.
 *
 * The stop is seen where it is generated (the signal_generate tracepoint): a BTF tracing
 * program, since tracing programs of the older kinds (uprobes, raw tracepoints: discovery's
 * own) cannot use BPF timers. The timer's callback continues the process with the
 * bpf_send_signal_task kfunc (Linux 6.13), if the entry is still the same process's (the
 * daemon, continuing it itself, deletes the entry first), and deletes the entry. The kfunc
 * refuses (EPERM) where the CPU does not run a user task's memory map (nmi_uaccess_okay): a
 * callback that interrupted an idle CPU or a kernel thread, as on an idle node it mostly
 * does; a timer re-armed from its callback stays on that CPU, which may stay idle for
 * minutes. So a refused deadline is left pending, and the next switch away from a user
 * task on any CPU (the sched_switch tracepoint: that task's memory map is still loaded) ends
 * it. While nothing is pending the switch program reads one global (its cost:
 * bench/results.md). The daemon, thawed, or another daemon on the node (STUCK_S) may end
 * the hold first, as before. Where this object does not load (an older kernel), the daemon
 * says so and its watchdogs are the only
 * deadline. A daemon killed takes this object with it: then the node's other daemons (and the
 * one restarted in its place) continue its held processes, as before. */
#include <linux/types.h>
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_tracing.h>
#include <bpf/bpf_core_read.h>

typedef __u32 u32;
typedef __u64 u64;

#include "transport.h"
#include "held.bpf.h"

char LICENSE[] SEC("license") = "GPL";

#define CLOCK_MONOTONIC 1
#define PI_SIGNAL_CONT 18
#define PI_SIGNAL_STOP 19

struct task_struct {
    int tgid;
    struct task_struct *group_leader;
    u64 start_boottime;
} __attribute__((preserve_access_index));

enum pid_type { PIDTYPE_PID, PIDTYPE_TGID, PIDTYPE_PGID, PIDTYPE_SID, PIDTYPE_MAX };

extern struct task_struct *bpf_task_from_pid(int pid) __ksym;
extern void bpf_task_release(struct task_struct *p) __ksym;
extern int bpf_send_signal_task(struct task_struct *task, int sig, enum pid_type type, u64 value) __ksym;

const volatile struct pi_hold_deadline_config cfg = {};


#define ARMED 0         /* its timer runs */
#define PENDING 1       /* the timer's signal was refused: the next user task's switch tries */
#define CLAIMED 2       /* one CPU's switch tries it now */

/* Raised by each refusal; a switch that finds nothing pending lowers it back to 0 only if no
 * refusal came meanwhile (compare-and-swap), so a pending deadline is never left unseen. */
volatile u64 refusals = 0;

struct deadline {
    struct bpf_timer timer;
    struct pi_process_id process;
    u64 since_ns;           /* the hold's (the held entry's): a later hold of the process re-arms */
    u64 state;              /* ARMED, PENDING or CLAIMED */
};

/* One per process held by this daemon now (its timer armed at the stop). */
struct {
    __uint(type, BPF_MAP_TYPE_HASH);
    __uint(max_entries, PI_MAX_RECORDED);
    __type(key, u32);
    __type(value, struct deadline);
} deadlines SEC(".maps");

/* How many holds the deadline ended (user space says so). */
struct {
    __uint(type, BPF_MAP_TYPE_ARRAY);
    __uint(max_entries, 1);
    __type(key, u32);
    __type(value, u64);
} ended SEC(".maps");

static __always_inline u64 start_ticks(struct task_struct *task)
{
    return BPF_CORE_READ(task, group_leader, start_boottime) / PI_NS_PER_TICK;
}

static __always_inline int same_hold(struct pi_held *h, struct deadline *d, u64 since)
{
    return h && h->since_ns == since && h->process.start_ticks == d->process.start_ticks
        && h->holder.tgid == cfg.holder.tgid && h->holder.start_ticks == cfg.holder.start_ticks;
}

/* The deadline element goes only where no later hold re-armed it meanwhile. */
static __always_inline void forget(void *map, u32 *tgid, struct deadline *d, u64 since)
{
    if (d->since_ns == since)
        bpf_map_delete_elem(map, tgid);
}

/* Continue the held process if it still waits for this hold: 0 when done (the deadline
 * element is gone), 1 when the kernel refused the signal here (the element stays). */
static int try_end(void *map, u32 *tgid, struct deadline *d)
{
    u64 since = d->since_ns;
    struct pi_held *h = bpf_map_lookup_elem(&held, tgid);
    if (!same_hold(h, d, since)) {
        if (!h || h->since_ns == since)     /* continued meanwhile, or another's now */
            forget(map, tgid, d, since);
        return 0;                           /* else a later hold: its arming restarted this timer */
    }
    struct task_struct *task = bpf_task_from_pid(*tgid);
    long err = 0;
    int same = 0;
    if (task) {
        same = start_ticks(task) == d->process.start_ticks;
        if (same)
            err = bpf_send_signal_task(task, PI_SIGNAL_CONT, PIDTYPE_TGID, 0);
        bpf_task_release(task);
    }
    if (err)
        return 1;
    /* continued (or gone): out of the node's map, unless a later hold is there now (the
     * daemon's own SIGCONT, should it come too, finds the process running) */
    h = bpf_map_lookup_elem(&held, tgid);
    if (same_hold(h, d, since) || (!same && h && h->since_ns == since))
        bpf_map_delete_elem(&held, tgid);
    if (same) {
        u32 zero = 0;
        u64 *n = bpf_map_lookup_elem(&ended, &zero);
        if (n)
            __sync_fetch_and_add(n, 1);
    }
    forget(map, tgid, d, since);
    return 0;
}

/* Refused here: pending, and `refusals` raised after it, so a switch that swept meanwhile and
 * found nothing pending cannot lower it past this one. */
static __always_inline void refused(struct deadline *d)
{
    d->state = PENDING;
    __sync_fetch_and_add(&refusals, 1);
}

/* The timer's callback: the deadline came. */
static int end_hold(void *map, u32 *tgid, struct deadline *d)
{
    if (try_end(map, tgid, d))
        refused(d);
    return 0;
}

struct sweep {
    u64 pending;            /* one was seen (a flag: a count would make the verifier walk each value) */
};

static long retry_pending(void *map, u32 *tgid, struct deadline *d, struct sweep *sweep)
{
    if (d->state == ARMED)
        return 0;
    sweep->pending = 1;                     /* pending, or another CPU's switch tries it now */
    if (__sync_val_compare_and_swap(&d->state, PENDING, CLAIMED) != PENDING)
        return 0;
    if (try_end(map, tgid, d))
        refused(d);                         /* this task was no user task's (a kernel thread) */
    return 0;
}

/* sched_switch(preempt, prev, next, prev_state): the task switched away from is current, its
 * memory map loaded, so a refused deadline's signal can be sent here. */
SEC("tp_btf/sched_switch")
int BPF_PROG(hold_deadline_retry)
{
    u64 seen = refusals;
    if (!seen)
        return 0;
    struct sweep sweep = {};
    bpf_for_each_map_elem(&deadlines, retry_pending, &sweep, 0);
    if (!sweep.pending)
        __sync_val_compare_and_swap(&refusals, seen, 0);
    return 0;
}

/* signal_generate(sig, info, task, group, result): a SIGSTOP for a process this daemon holds
 * arms (or re-arms: a later hold of the same process) its deadline. */
SEC("tp_btf/signal_generate")
int BPF_PROG(hold_deadline_arm, int sig, void *info, struct task_struct *task, int group, int result)
{
    if (sig != PI_SIGNAL_STOP)
        return 0;
    u32 tgid = task->tgid;
    struct pi_held *h = bpf_map_lookup_elem(&held, &tgid);
    if (!h || h->holder.tgid != cfg.holder.tgid || h->holder.start_ticks != cfg.holder.start_ticks)
        return 0;
    struct deadline fresh = {.process = h->process};
    bpf_map_update_elem(&deadlines, &tgid, &fresh, BPF_NOEXIST);
    struct deadline *d = bpf_map_lookup_elem(&deadlines, &tgid);
    if (!d)
        return 0;
    d->process = h->process;
    d->since_ns = h->since_ns;
    d->state = ARMED;
    bpf_timer_init(&d->timer, &deadlines, CLOCK_MONOTONIC);    /* -EBUSY when armed before */
    bpf_timer_set_callback(&d->timer, end_hold);
    bpf_timer_start(&d->timer, cfg.deadline_ns, 0);
    return 0;
}
