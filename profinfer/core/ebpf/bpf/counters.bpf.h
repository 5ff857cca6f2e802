/* The perf counters an engine's programs read around each op (opened per CPU by user space,
 * profinfer/core/ebpf/perfevents.py): counter i of CPU c at i * cfg.n_cpus + c. Counting is per CPU, not
 * per thread, so an op whose thread changes CPU has no valid delta: the engine flags it and
 * user space counts it instead of summing it. The engine's cfg has n_counters and n_cpus. */
#pragma once

struct {
    __uint(type, BPF_MAP_TYPE_PERF_EVENT_ARRAY);
    __uint(key_size, sizeof(u32));
    __uint(value_size, sizeof(u32));
    __uint(max_entries, 1);            /* set by user space */
} counters SEC(".maps");

/* Read every configured counter of this CPU into v; 0 when all reads succeeded. */
static __always_inline int read_counters(struct pi_counter_read *v, u32 cpu)
{
    int failed = 0;
#pragma unroll
    for (u32 i = 0; i < PI_MAX_COUNTERS; i++) {
        if (i >= cfg.n_counters)
            break;
        if (bpf_perf_event_read_value(&counters, (u64)(i * cfg.n_cpus + cpu),
                                      (struct bpf_perf_event_value *)&v[i], sizeof(v[i])))
            failed = 1;
    }
    return failed;
}
