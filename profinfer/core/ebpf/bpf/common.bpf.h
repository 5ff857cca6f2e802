/* What every profinfer BPF object shares: types, the configuration in .rodata, the event
 * transport (ring buffer, or perf buffers before 5.12), the lost-event counter.
 * Each engine's configuration begins with the transport's (transport.h).
 * A second object (sched.bpf.c) is loaded with these maps reused from the first
 * (bpf_map__reuse_fd), so all events arrive in one buffer in one order. */
#pragma once

#include <linux/types.h>
#include <linux/bpf.h>
#include <linux/ptrace.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_tracing.h>

typedef __u8 u8;
typedef __u16 u16;
typedef __u32 u32;
typedef __s32 s32;
typedef __u64 u64;
typedef __s64 s64;

/* An engine's object defines PI_ENGINE_EVENTS (its header, which defines struct pi_config)
 * before including this file; the core's own objects (follow) configure the transport only. */
#ifdef PI_ENGINE_EVENTS
#include PI_ENGINE_EVENTS
#else
#include "transport.h"
#define pi_config pi_core_config
#endif

const volatile struct pi_config cfg = {};

struct {
    __uint(type, BPF_MAP_TYPE_ARRAY);
    __uint(max_entries, 1);
    __type(key, u32);
    __type(value, u64);
} lost SEC(".maps");

static __always_inline void count_lost(u64 n)
{
    u32 k = 0;
    u64 *v = bpf_map_lookup_elem(&lost, &k);
    if (v)
        __sync_fetch_and_add(v, n);
}

#ifdef PI_PERF_BUFFER
/* Kernels before 5.12 (no ring buffer before 5.8, and the ring build's atomics need 5.12):
 * per-CPU perf buffers, whose wakeups user space
 * batches with wakeup_events. */
struct {
    __uint(type, BPF_MAP_TYPE_PERF_EVENT_ARRAY);
    __uint(key_size, sizeof(u32));
    __uint(value_size, sizeof(u32));
} events SEC(".maps");

static __always_inline int emit(void *ctx, void *data, u32 size)
{
    return bpf_perf_event_output(ctx, &events, BPF_F_CURRENT_CPU, data, size);
}
#else
/* max_entries (the ring's size) is set by the collector before loading. */
struct {
    __uint(type, BPF_MAP_TYPE_RINGBUF);
    __uint(max_entries, 4096);
} events SEC(".maps");

/* Wake the collector only when the ring is filling up: it drains the ring on a timer, and a
 * wakeup per record would preempt an inference thread on a busy machine every time.
 * unread_bytes counts what was submitted since the collector's last drain (it zeroes it). */
struct {
    __uint(type, BPF_MAP_TYPE_ARRAY);
    __uint(max_entries, 1);
    __type(key, u32);
    __type(value, u64);
} unread_bytes SEC(".maps");

static __always_inline u64 wakeup_flag(u64 size)
{
    u32 k = 0;
    u64 *v = bpf_map_lookup_elem(&unread_bytes, &k);
    if (!v)
        return 0;
    u64 before = __sync_fetch_and_add(v, size);
    return before < cfg.transport.ring_wake_bytes && before + size >= cfg.transport.ring_wake_bytes
        ? BPF_RB_FORCE_WAKEUP : BPF_RB_NO_WAKEUP;
}

/* Send one record to user space; 0 on success. */
static __always_inline int emit(void *ctx, void *data, u32 size)
{
    return bpf_ringbuf_output(&events, data, size, wakeup_flag(size));
}
#endif

/* Send a record a stopped process waits on: the reader is woken now. 0 when it was sent. */
static __always_inline long emit_urgent(void *ctx, void *data, u32 size)
{
#ifdef PI_PERF_BUFFER
    long err = bpf_perf_event_output(ctx, &events, BPF_F_CURRENT_CPU, data, size);
#else
    long err = bpf_ringbuf_output(&events, data, size, BPF_RB_FORCE_WAKEUP);
#endif
    if (err)
        count_lost(1);
    return err;
}

#define PI_SIGCONT 18
#define PI_SIGSTOP 19

/* Stop the current process for user space, which is told by `told` (0: it was). The stop is
 * pending before the record can be read, so user space's SIGCONT always comes after it; a
 * record that could not be sent takes the stop back (SIGCONT discards a pending stop), as a
 * process stopped without its record would wait for ever. */
#define PI_STOP_AND_TELL(told) ({                   \
    bpf_send_signal(PI_SIGSTOP);                    \
    long __err = (told);                            \
    if (__err)                                      \
        bpf_send_signal(PI_SIGCONT);                \
    __err; })

/* The processes a `record` follows (the command, its exec'd images and forked children):
 * follow.bpf.c keeps the set; engine objects reuse the map. */
struct {
    __uint(type, BPF_MAP_TYPE_HASH);
    __uint(max_entries, PI_MAX_FOLLOWED);
    __type(key, u32);
    __type(value, u32);
} followed SEC(".maps");

/* True when the current process is the target. Probes attached to one process (attach --pid)
 * need no check; probes attached to a library file for a followed process tree fire in every
 * process that maps the file, and run for the followed ones only. */
static __always_inline int in_target(void)
{
    if (!cfg.transport.follow)
        return 1;
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    return bpf_map_lookup_elem(&followed, &tgid) != 0;
}

#ifndef PT_REGS_PARM6           /* libbpf before 1.2 names five */
#if defined(__TARGET_ARCH_x86)
#define PT_REGS_PARM6(x) (((const struct pt_regs *)(x))->r9)
#elif defined(__TARGET_ARCH_arm64)
#define PT_REGS_PARM6(x) (((const struct user_pt_regs *)(x))->regs[5])
#endif
#endif

/* A user-space word; 0 where it cannot be read. */
static __always_inline u64 read_u64(u64 addr)
{
    u64 v = 0;
    bpf_probe_read_user(&v, sizeof(v), (void *)addr);
    return v;
}

/* Count one more of `which` in an object's array of u64 tallies. */
static __always_inline void tally_in(void *tallies, u32 which)
{
    u64 *v = bpf_map_lookup_elem(tallies, &which);
    if (v)
        __sync_fetch_and_add(v, 1);
}

/* floor(log2(v)) (0 for 0): a histogram's power of two */
static __always_inline u32 log2_u64(u64 v)
{
    u32 r = 0;
    if (v >> 32) { v >>= 32; r += 32; }
    if (v >> 16) { v >>= 16; r += 16; }
    if (v >> 8) { v >>= 8; r += 8; }
    if (v >> 4) { v >>= 4; r += 4; }
    if (v >> 2) { v >>= 2; r += 2; }
    if (v >> 1) r += 1;
    return r;
}

static __always_inline u32 current_tid(void)
{
    return (u32)bpf_get_current_pid_tgid();
}

/* Per thread: what is open on it (transport.h: struct pi_open_span). LRU: threads that exit
 * leave their entry, the least recently used go first. */
struct {
    __uint(type, BPF_MAP_TYPE_LRU_HASH);
    __uint(max_entries, 4096);
    __type(key, u32);
    __type(value, struct pi_open_span);
} open_spans SEC(".maps");

/* The thread's open span, made (zeroed) on first use; NULL only if the map refuses. */
static __always_inline struct pi_open_span *open_span(u32 tid, u32 engine)
{
    struct pi_open_span *s = bpf_map_lookup_elem(&open_spans, &tid);
    if (s)
        return s;
    struct pi_open_span fresh = {.engine = engine};
    bpf_map_update_elem(&open_spans, &tid, &fresh, BPF_NOEXIST);
    return bpf_map_lookup_elem(&open_spans, &tid);
}

