/* The sched level's events (sched.bpf.c), the same for every engine: the core's kinds. */
#pragma once

#define PI_EV_SWITCH 4
#define PI_EV_WAKEUP 5

/* A context switch or wakeup involving one of the target's threads (sched level).
 * Switch: prev left the CPU in prev_state (0: still runnable, i.e. preempted) for next.
 * Wakeup: prev (the waker, current task) made next runnable. */
#define PI_COMM_LEN 16

struct pi_sched_event {
    u32 kind;
    u32 cpu;
    u64 ts_ns;
    s64 prev_state;
    u32 prev_tid;
    u32 prev_tgid;
    u32 next_tid;
    u32 next_tgid;
    char prev_comm[PI_COMM_LEN];
    char next_comm[PI_COMM_LEN];
};
