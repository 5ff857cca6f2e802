/* The processes discovery holds now, by this daemon or another (transport.h's pi_held):
 * pinned by user space (profinfer/core/ebpf/held.py), so that they outlive a daemon killed while
 * holding one, and shared by discover.bpf.c (which enters them) and hold_deadline.bpf.c
 * (which ends them by deadline). A hash, not an LRU: an entry evicted would be a process
 * nobody continues. */
#pragma once

#include <bpf/bpf_helpers.h>
#include "transport.h"

struct {
    __uint(type, BPF_MAP_TYPE_HASH);
    __uint(max_entries, PI_MAX_RECORDED);
    __type(key, u32);
    __type(value, struct pi_held);
} held SEC(".maps");
