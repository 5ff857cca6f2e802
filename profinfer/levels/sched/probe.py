"""The sched level, the same for every engine: context switches and wakeups of the watched
processes' threads (bpf/sched.bpf.c: raw tracepoints, CO-RE, so it needs kernel BTF), sent
through the engine object's own event buffer; and their records as the profile's switches
and wakeups."""
from __future__ import annotations

import os

import numpy as np

from profinfer.core.ebpf import bpfobj, kernel, layout, libbpf
from profinfer.core.base.errors import ProfinferError
from profinfer.levels.sched.records import SchedSwitch, SchedWakeup

PROGRAMS = ("sched_switch", "sched_wakeup")
_HEADER = "sched.h"


def require_btf() -> None:
    if not os.path.exists("/sys/kernel/btf/vmlinux"):
        raise ProfinferError("the sched level needs kernel BTF (/sys/kernel/btf/vmlinux, "
                             "CONFIG_DEBUG_INFO_BTF): this kernel has none")


def attach(engine_obj: libbpf.BpfObject, buffer: str, ring_wake_bytes: int, target_tgid: int,
           follow: bool) -> libbpf.BpfObject:
    """Load and attach the sched programs, sharing the engine object's event buffer (and its
    `followed` map when it watches a process tree rather than target_tgid alone)."""
    dt = layout.parse(header="transport.h")[1]["pi_core_config"]
    cfg = np.zeros(1, dt)
    cfg["transport"]["ring_wake_bytes"] = ring_wake_bytes
    cfg["transport"]["follow"] = int(follow)
    cfg["target_tgid"] = target_tgid
    cfg["switch_state_arg"] = int(kernel.release_at_least(5, 18))
    obj = libbpf.BpfObject(bpfobj.object_path("sched.bpf.c", buffer))
    try:
        obj.set_rodata(cfg.tobytes())
        shared = ["events", "lost"] + (["unread_bytes"] if buffer == "ring" else [])
        for name in shared + (["followed"] if follow else []):
            obj.reuse_map(name, engine_obj.map_fd(name))
        obj.load(set(PROGRAMS))
        for prog in PROGRAMS:
            obj.attach(prog)
    except ProfinferError:
        obj.close()
        raise
    return obj


def record_dtype() -> np.dtype:
    return layout.parse(header=_HEADER)[1]["pi_sched_event"]


def switch_kind() -> int:
    return layout.parse(header=_HEADER)[0]["PI_EV_SWITCH"]


def events(evs: np.ndarray, pids: set[int]) -> tuple[list[SchedSwitch], list[SchedWakeup]]:
    """pi_sched_event records (sorted by time) as switches and wakeups; `pids` are the
    profiled processes (a thread of one of them has its pid set, others 0)."""
    kind_switch = switch_kind()

    def text(b) -> str:
        return bytes(b).split(b"\0", 1)[0].decode("utf-8", "replace")

    def ours(tgid) -> int:
        return int(tgid) if int(tgid) in pids else 0

    switches, wakeups = [], []
    for e in evs:
        if int(e["kind"]) == kind_switch:
            switches.append(SchedSwitch(
                int(e["ts_ns"]), int(e["cpu"]), int(e["prev_tid"]), text(e["prev_comm"]),
                int(e["prev_state"]), int(e["next_tid"]), text(e["next_comm"]),
                ours(e["prev_tgid"]), ours(e["next_tgid"])))
        else:
            wakeups.append(SchedWakeup(int(e["ts_ns"]), int(e["cpu"]), int(e["next_tid"]),
                                       text(e["next_comm"]), int(e["prev_tid"])))
    return switches, wakeups


class SchedRecords:
    """The switch and wakeup records the sched programs sent through an engine object's
    event buffer, kept until the profile is built."""

    def __init__(self):
        self.dt = record_dtype()
        self._raw: list[bytes] = []

    def add(self, record: bytes) -> None:
        """A switch or wakeup record (perf-buffer records may carry padding after it)."""
        self._raw.append(record[: self.dt.itemsize])

    def __len__(self) -> int:
        return len(self._raw)

    def events(self, pids: set[int]) -> tuple[list[SchedSwitch], list[SchedWakeup]]:
        """The records so far, in time order, as switches and wakeups (see events)."""
        if not self._raw:
            return [], []
        evs = np.sort(np.frombuffer(b"".join(self._raw), self.dt), order="ts_ns")
        return events(evs, pids)
