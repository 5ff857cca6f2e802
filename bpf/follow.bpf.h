/* What the follower's objects share (follow.bpf.c, follow_fork.bpf.c): telling user space
 * about a followed process. */
#pragma once

#include "common.bpf.h"

/* 0 when the record is in the buffer. */
static __always_inline long tell(void *ctx, u32 tgid, u32 what, u32 child)
{
    struct pi_follow_event ev = {.kind = PI_EV_FOLLOW, .tgid = tgid, .what = what,
                                 .child = child, .ts_ns = bpf_ktime_get_ns()};
#ifdef PI_PERF_BUFFER
    long err = bpf_perf_event_output(ctx, &events, BPF_F_CURRENT_CPU, &ev, sizeof(ev));
#else
    /* a stopped process waits for this record: wake the reader now */
    long err = bpf_ringbuf_output(&events, &ev, sizeof(ev), BPF_RB_FORCE_WAKEUP);
#endif
    if (err)
        count_lost(1);
    return err;
}

static __always_inline u32 followed_tgid(void)
{
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    return bpf_map_lookup_elem(&followed, &tgid) ? tgid : 0;
}
