/* Per-CPU perf counters read around each op, for every engine that reads them: the layout of
 * one read (struct bpf_perf_event_value's). Layout rules: llamacpp.h's. */
#pragma once

#define PI_MAX_COUNTERS 4

struct pi_counter_read {
    u64 counter;
    u64 enabled;
    u64 running;
};
