/* What the follower's objects share (follow.bpf.c, follow_fork.bpf.c): telling user space
 * about a followed process, and the node's set of recorded processes (recorded.bpf.h). */
#pragma once

#include "common.bpf.h"
#include "recorded.bpf.h"

/* 0 when the record is in the buffer. */
static __always_inline long tell(void *ctx, u32 tgid, u32 what, u32 child)
{
    struct pi_follow_event ev = {.kind = PI_EV_FOLLOW, .tgid = tgid, .what = what,
                                 .child = child, .ts_ns = bpf_ktime_get_ns()};
    return emit_urgent(ctx, &ev, sizeof(ev));
}

static __always_inline u32 followed_tgid(void)
{
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    return bpf_map_lookup_elem(&followed, &tgid) ? tgid : 0;
}
