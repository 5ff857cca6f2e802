"""The node's processes that a `record` follows, shared with every daemon on the node.

A record's follower stops a process at each exec and loader change until its probes are on;
a daemon's discovery stops processes that map an engine until it has looked at them. The
kernel does not count stops: the daemon's SIGCONT would let a recorded process run while the
record still attaches. So the followers keep their processes in one BPF map pinned in bpffs
(PIN_DIR/recorded), tgid -> start time (clock ticks since boot, /proc/PID/stat's 22nd field: a reused PID
is not taken for the process that had it), and discovery does not hold those (its BPF
`may_stop`, bpf/discover.bpf.c); the follower's BPF adds forked children and removes exited
processes (bpf/follow*.bpf.c). The map is an LRU: entries a crashed record left are dropped
in time, and match no later process meanwhile.

Only root can write it (core/ebpf/pinned.py). Without bpffs at /sys/fs/bpf there is nothing to
share: each side keeps a private map and a daemon may hold a recorded process (said once by
the daemon).
"""
from __future__ import annotations

import os
from typing import Callable

from profinfer.core.ebpf import layout, libbpf, pinned
from profinfer.core.target import procfs
from profinfer.core.ebpf.pinned import PIN_DIR

MAP_NAME = "recorded"           # the objects' map (bpf/recorded.bpf.h), pinned by that name
_START_TIME_FIELD = 19          # procfs.stat_fields' index of field 22, starttime


def _shape() -> tuple[int, int, int, int]:
    consts = layout.parse(header="transport.h")[0]
    return libbpf.BPF_MAP_TYPE_LRU_HASH, 4, 8, consts["PI_MAX_RECORDED"]


def open_shared(warn: Callable[[str], None], pin_dir: str = PIN_DIR) -> int | None:
    """A descriptor of the node's map, made and pinned if none is; None where it cannot be
    shared (pinned.open_shared). pin_dir: the tests' own."""
    if os.sysconf("SC_CLK_TCK") != 100:     # transport.h's PI_NS_PER_TICK
        return None
    return pinned.open_shared(MAP_NAME, _shape(), warn, "a daemon on this node may hold recorded processes",
                              pin_dir)


def start_time(pid: int) -> int | None:
    """The process's start time as `recorded` holds it; None once it is gone."""
    fields = procfs.stat_fields(pid)
    return int(fields[_START_TIME_FIELD]) if fields and len(fields) > _START_TIME_FIELD else None


def add(fd: int, pid: int) -> None:
    start = start_time(pid)
    if start is not None:
        libbpf.map_update(fd, pid.to_bytes(4, "little"), start.to_bytes(8, "little"))


def remove(fd: int, pid: int) -> None:
    """Remove `pid` unless it is another process now (whose PID may be another record's)."""
    key = pid.to_bytes(4, "little")
    value = libbpf.map_lookup(fd, key, 8)
    start = start_time(pid)
    if value is not None and (start is None or int.from_bytes(value, "little") == start):
        libbpf.map_delete(fd, key)
