"""CPU time of the profiled processes and of profinfer itself, read from /proc: what the
probes' cost is judged against."""
from __future__ import annotations

import os
import resource
import time
from typing import Callable

from profinfer.core.calibration.loadcheck import busy_ticks

from profinfer.core.target.procfs import stat_fields


def cpu_s(pid: int) -> float | None:
    """CPU time (user + system, all threads) `pid` has used so far."""
    fields = stat_fields(pid)
    try:
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK") if fields else None
    except (ValueError, IndexError):
        return None


def own_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def rss_kb() -> int:
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmRSS:"))


class ProcessesCpu:
    """CPU time a changing set of processes used from when each was first sampled to its
    last sample (one that exited keeps its last)."""

    def __init__(self):
        self.first: dict[int, float] = {}
        self.last: dict[int, float] = {}

    def sample(self, pids) -> None:
        for p in pids:
            v = cpu_s(p)
            if v is not None:
                self.first.setdefault(p, v)
                self.last[p] = v

    def used(self) -> float:
        return sum(self.last[p] - self.first[p] for p in self.last)


def _schedstat_ns(task: str) -> tuple[int, int] | None:
    """(ns on a CPU, ns waiting runnable for one) of a thread, as /proc's schedstat counts
    them (exact, where stat's utime and stime come in clock ticks)."""
    try:
        with open(f"/proc/{task}/schedstat") as f:
            ran, waited = f.read().split()[:2]
        return int(ran), int(waited)
    except (OSError, ValueError):
        return None


class ThreadsCpu:
    """CPU time of each thread of a set of processes, from when it was first sampled to its
    last sample (one that exited keeps its last): a probe's cost is borne by the thread that
    takes it, so it is judged against that thread's time, not the whole tree's. Beside it,
    the time each waited, runnable, for a CPU: the most that anything else running (the
    collector among them) can have delayed it."""

    def __init__(self):
        self.first: dict[int, tuple[int, int]] = {}      # tid -> (ran ns, waited ns)
        self.last: dict[int, tuple[int, int]] = {}

    def sample(self, pids) -> None:
        for pid in pids:
            try:
                tids = os.listdir(f"/proc/{pid}/task")
            except OSError:
                continue
            for t in tids:
                read = _schedstat_ns(f"{pid}/task/{t}")
                if read is not None:
                    self.first.setdefault(int(t), read)
                    self.last[int(t)] = read

    def waited_s(self, tids) -> dict[int, float]:
        """{tid: seconds it waited for a CPU between its first and last sample}."""
        return {t: (self.last[t][1] - self.first[t][1]) / 1e9 for t in tids if t in self.last}

    def used_s(self, min_s: float = 0.0) -> dict[int, float]:
        """{tid: CPU seconds used between its first and last sample}, those above min_s."""
        used = {t: (self.last[t][0] - self.first[t][0]) / 1e9 for t in self.last}
        return {t: s for t, s in used.items() if s > min_s}


class CpuShares:
    """The target's CPU time while probed, and ours, counted from when the engine's work
    began (BPF sends an event at llama_decode's entry; without the token level, the first
    event), so that loading a model does not dilute the shares. Made once the probes are in."""

    def __init__(self, pid: int):
        self.pid = pid                       # the process profiled (maybe our child)
        self.own_at_attach = own_cpu_s()
        self.target_from, self.own_from = cpu_s(pid), self.own_at_attach
        self.target_last = self.target_from  # the engine's, sampled while it lives
        self.others = ProcessesCpu()         # the engine's other processes (vLLM's workers)
        self.from_work = False               # counting from the engine's first work
        self.child_cpu: list[float] = []     # our child's, once reaped
        self.threads = ThreadsCpu()          # each thread's, from the engine's first work
        self.threads_at = 0.0                # when last sampled (monotonic)
        self.busy_from, self.wall_from = busy_ticks(), time.monotonic()   # every CPU's busy time

    def work_began(self, engine_pid: int) -> None:
        self.target_from, self.own_from, self.from_work = cpu_s(engine_pid), own_cpu_s(), True
        self.busy_from, self.wall_from = busy_ticks(), time.monotonic()

    def others_cpus(self, own_now: float, target_used: float | None) -> float | None:
        """Other processes' CPU use while the target worked, in CPUs (all CPUs' busy time
        less the target's and ours): a neighbour that took CPUs from the target makes its
        times the neighbour's as much as its own (said by diff, judged by nobody else)."""
        wall = time.monotonic() - self.wall_from
        if target_used is None or wall <= 0:
            return None
        busy = (busy_ticks() - self.busy_from) / os.sysconf("SC_CLK_TCK")
        return max(busy - target_used - (own_now - self.own_from), 0.0) / wall

    def target(self, engine_pid: int, others: Callable[[], list[int]]) -> float | None:
        """The target's CPU time while probed, its other processes' included: what the
        probes' cost is a share of."""
        if engine_pid == self.pid:
            used = self.child_cpu[0] if self.child_cpu else cpu_s(self.pid)
        else:
            used = cpu_s(engine_pid) or self.target_last
        if used is not None and self.target_from is not None:
            used -= self.target_from
            self.others.sample(others())
            used += self.others.used()
        return used
