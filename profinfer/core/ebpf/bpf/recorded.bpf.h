/* The node's processes that a `record` follows (transport.h's PI_MAX_RECORDED), pinned in
 * bpffs by user space (profinfer/core/ebpf/followed.py) and shared by every record's follower,
 * which adds and removes its processes, and every daemon's discovery, which does not hold
 * them: the record's own stop is the one that must last until its probes are on. */
#pragma once

#include "common.bpf.h"

struct {
    __uint(type, BPF_MAP_TYPE_LRU_HASH);
    __uint(max_entries, PI_MAX_RECORDED);
    __type(key, u32);
    __type(value, u64);
} recorded SEC(".maps");
