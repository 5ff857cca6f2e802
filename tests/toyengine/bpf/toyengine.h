/* The toy engine's event layout, shared by toyengine.bpf.c and its collector (layout rules:
 * the core's layout.py parses this file). */
#pragma once

#include "transport.h"

#define TOY_EV_DECODE 48      /* one toy_decode call, sent at its return */
#define TOY_EV_OP 49          /* one toy_op call, sent at its return */

struct toy_event {
    u32 kind;
    u32 tid;
    u32 tgid;
    s32 ret;                  /* decode: its return value */
    u64 start_ns;
    u64 end_ns;
    s32 seq;                  /* decode: the sequence, its first position, its tokens */
    s32 pos0;
    s32 n_tokens;             /* decode and op alike */
    u32 op;                   /* op: toy_op's first argument (the pack names it) */
    u32 cpu;                  /* where it began */
    u32 pad;
};

struct pi_config {
    struct pi_transport transport;
};
