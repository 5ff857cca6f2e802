"""perf_event counters for the op level: names as perf spells them, opened once per CPU.

BPF reads them at each node's start and end (bpf_perf_event_read_value on this CPU's
event), so the events are system-wide per CPU, not per thread: user space opens one per
online CPU and puts the fds in the program's PERF_EVENT_ARRAY. A counter the machine cannot
count (no hardware PMU in a VM, an unknown raw event) is left out with one notice; when
none of the requested counters opens, task-clock (a software event that always exists)
stands in, and the notice says so.
"""
from __future__ import annotations

import errno
import os
import re
from dataclasses import dataclass

from profinfer.core.ebpf import libbpf
from profinfer.core.base.errors import ProfinferError
from profinfer.core.ebpf.perf_event_open import (PERF_TYPE_HARDWARE, PERF_TYPE_HW_CACHE, PERF_TYPE_RAW,
                                            PERF_TYPE_SOFTWARE, PerfEventAttr, perf_event_open)


HARDWARE = {"cycles": 0, "cpu-cycles": 0, "instructions": 1, "cache-references": 2,
            "cache-misses": 3, "branch-instructions": 4, "branches": 4, "branch-misses": 5,
            "bus-cycles": 6, "stalled-cycles-frontend": 7, "stalled-cycles-backend": 8,
            "ref-cycles": 9}
SOFTWARE = {"cpu-clock": 0, "task-clock": 1, "page-faults": 2, "faults": 2,
            "context-switches": 3, "cs": 3, "cpu-migrations": 4, "migrations": 4,
            "minor-faults": 5, "major-faults": 6, "alignment-faults": 7, "emulation-faults": 8}
_CACHES = {"L1-dcache": 0, "L1-icache": 1, "LLC": 2, "dTLB": 3, "iTLB": 4, "branch": 5, "node": 6}
_CACHE_OPS = {"load": 0, "store": 1, "prefetch": 2}
_CACHE_RE = re.compile(r"^(L1-dcache|L1-icache|LLC|dTLB|iTLB|branch|node)-(load|store|prefetch)(s|-misses)$")
_RAW_RE = re.compile(r"^r([0-9a-fA-F]{1,16})$")
FALLBACK = "task-clock"


@dataclass(frozen=True)
class Counter:
    name: str
    type: int
    config: int

    @property
    def hardware(self) -> bool:
        return self.type != PERF_TYPE_SOFTWARE


def parse(name: str) -> Counter:
    """A perf event name (`cycles`, `task-clock`, `LLC-load-misses`, `r01a3`) as a Counter."""
    if name in HARDWARE:
        return Counter(name, PERF_TYPE_HARDWARE, HARDWARE[name])
    if name in SOFTWARE:
        return Counter(name, PERF_TYPE_SOFTWARE, SOFTWARE[name])
    m = _CACHE_RE.match(name)
    if m:
        result = 1 if m.group(3) == "-misses" else 0
        return Counter(name, PERF_TYPE_HW_CACHE,
                       _CACHES[m.group(1)] | _CACHE_OPS[m.group(2)] << 8 | result << 16)
    m = _RAW_RE.match(name)
    if m:
        return Counter(name, PERF_TYPE_RAW, int(m.group(1), 16))
    raise ProfinferError(f"unknown counter {name!r}: use perf's names (cycles, instructions, "
                         "cache-misses, task-clock, page-faults, LLC-load-misses, ...) or a raw "
                         "event such as r01a3")


def _open(counter: Counter, cpu: int) -> int:
    """perf_event_open for every task on `cpu`; returns the fd, or -errno."""
    return perf_event_open(PerfEventAttr(counter.type, PerfEventAttr.SIZE_VER5, counter.config), -1, cpu)


def _cpu_list(path: str) -> list[int]:
    with open(path) as f:
        out = []
        for part in f.read().strip().split(","):
            lo, _, hi = part.partition("-")
            out.extend(range(int(lo), int(hi or lo) + 1))
        return out


def possible_cpus() -> int:
    """CPU ids run from 0 to this minus one (the BPF map is indexed by CPU id)."""
    return max(_cpu_list("/sys/devices/system/cpu/possible")) + 1


@dataclass
class OpenCounters:
    counters: list[Counter]
    fds: list[dict[int, int]]     # per counter: {cpu: fd}
    notice: str | None            # what was left out and why, said once

    def install(self, map_fd: int, n_cpus: int) -> None:
        """Put the counters' fds into a BPF program's `counters` map (counters.bpf.h):
        counter i of CPU c at i * n_cpus + c."""
        for i, per_cpu in enumerate(self.fds):
            for cpu, event_fd in per_cpu.items():
                libbpf.map_update(map_fd, (i * n_cpus + cpu).to_bytes(4, "little"),
                                  event_fd.to_bytes(4, "little"))

    def close(self) -> None:
        for per_cpu in self.fds:
            for fd in per_cpu.values():
                os.close(fd)
        self.fds = []


def max_counters() -> int:
    """How many counters BPF reads per op (PI_MAX_COUNTERS in counters.h)."""
    from profinfer.core.ebpf import layout
    return layout.parse(header="counters.h")[0]["PI_MAX_COUNTERS"]


def requested(names: list[str], limit: int | None = None) -> list[Counter]:
    """The distinct counters named, in order (aliases of one event, `faults` and
    `page-faults`, are one); more than BPF reads per op is an error."""
    wanted: list[Counter] = []
    for n in names:
        c = parse(n)
        if all((c.type, c.config) != (w.type, w.config) for w in wanted):
            wanted.append(c)
    limit = limit if limit is not None else max_counters()
    if len(wanted) > limit:
        raise ProfinferError(f"at most {limit} counters at a time ({len(wanted)} asked: "
                             f"{', '.join(c.name for c in wanted)})")
    return wanted


def open_counters(names: list[str], limit: int | None = None) -> OpenCounters:
    """Open each named counter on every online CPU; leave out, with one notice, what won't open.
    `limit` is PI_MAX_COUNTERS as the caller read it (the default reads it here)."""
    wanted = requested(names, limit)
    cpus = _cpu_list("/sys/devices/system/cpu/online")
    opened: list[Counter] = []
    fds: list[dict[int, int]] = []
    missing: dict[str, list[str]] = {}
    for c in wanted:
        per_cpu: dict[int, int] = {}
        err = 0
        for cpu in cpus:
            fd = _open(c, cpu)
            if fd < 0:
                err = -fd
                break
            per_cpu[cpu] = fd
        if err:
            for fd in per_cpu.values():
                os.close(fd)
            if err in (errno.EACCES, errno.EPERM):
                raise ProfinferError(f"not allowed to open perf counter {c.name} "
                                     f"({os.strerror(err)}): run as root")
            missing.setdefault(os.strerror(err), []).append(c.name)
            continue
        opened.append(c)
        fds.append(per_cpu)
    notice = None
    if missing:
        what = "; ".join(f"{', '.join(ns)}: {why}" for why, ns in missing.items())
        hw = any(parse(n).hardware for ns in missing.values() for n in ns)
        notice = (("no hardware PMU on this machine (a VM?), " if hw else "")
                  + f"counters left out ({what})")
        if not opened:
            fb = parse(FALLBACK)
            per_cpu = {}
            for cpu in cpus:
                fd = _open(fb, cpu)
                if fd < 0:
                    raise ProfinferError(f"no perf counter opens here, not even {FALLBACK}: "
                                         f"{os.strerror(-fd)}")
                per_cpu[cpu] = fd
            opened, fds = [fb], [per_cpu]
            notice += f"; counting {FALLBACK} instead"
        else:
            notice += f"; counting {', '.join(c.name for c in opened)}"
    return OpenCounters(opened, fds, notice)
