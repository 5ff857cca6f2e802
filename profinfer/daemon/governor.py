"""The overhead budget: what each watched process's probes cost it, and its op level taken
away or given back to keep that under the budget.

Each process's cost (kernel-counted BPF time + probe hits x this machine's calibrated trap
costs, plus its share of the CPU of the daemon's thread that watches, over its own CPU time)
is checked every GOVERN_S; over the budget, its op level goes (the token and graph levels, a
few probe hits per decode call shared by every process of its build, are the floor), and
comes back after STEP_UP_S with room (under half the budget), waiting twice as long each time
a step up went over again.
"""
from __future__ import annotations

import os
import time
from typing import Callable

from profinfer.core import libbpf
from profinfer.core.procfs import stat_fields
from profinfer.daemon.watch import Watch

GOVERN_S = 2.0
STEP_DOWN_ORDER = ("op",)
STEP_UP_S = 20.0
LEVEL_RANK = {"op": 3, "graph": 2, "token": 1, "step": 1}
# what a level needs its engine's plugin to declare
LEVEL_NEEDS = {"op": "op_totals"}
TRAP_KEYS = ("emulated_ns", "stepped_ns", "uretprobe_extra_ns")
MIN_CPU_TO_JUDGE_NS = 50_000_000
MAX_STEP_UP_WAIT_S = 600.0


def level_rank(levels: set[str]) -> int:
    return max((LEVEL_RANK.get(lv, 0) for lv in levels), default=0)


def can_have(w: Watch, level: str) -> bool:
    need = LEVEL_NEEDS.get(level)
    return need is None or need in w.capabilities


class Governor:
    """Judges each watch's cost share every GOVERN_S and asks `relevel(watch, levels, why)`
    (True when done) to step its op level down or up."""

    def __init__(self, budget: float, metrics, relevel: Callable[[Watch, set[str], str], bool]):
        self.budget = budget
        self.metrics = metrics
        self.relevel = relevel
        # the kernel's BPF run-time counts (run time, and runs: the probe hits), on while
        # this fd is open; refused, the op level cannot be governed
        self.stats_fd = libbpf.enable_run_time_stats()
        self.ticks = os.sysconf("SC_CLK_TCK")
        self.last = 0.0
        from profinfer.core.probecost import cached
        costs = cached()
        # a probe hit's trap by kind, as calibrated here (profinfer calibrate); without it,
        # the kernel-counted BPF time alone (said in /status and at start)
        self.trap_costs = {k: float(costs[k]) for k in TRAP_KEYS} if costs else dict.fromkeys(TRAP_KEYS, 0.0)
        self.traps_calibrated = costs is not None
        self.loop_tid: int | None = None      # the thread running the agent's loop: the one that watches

    @property
    def stats_on(self) -> bool:
        return self.stats_fd >= 0

    def close(self) -> None:
        if self.stats_fd >= 0:
            os.close(self.stats_fd)
            self.stats_fd = -1

    def cpu_ns(self, pid: int, tid: int | None = None) -> int | None:
        """A process's CPU time (utime + stime), or one of its threads' (tid)."""
        fields = stat_fields(pid if tid is None else f"{pid}/task/{tid}")
        if fields is None or len(fields) < 13:
            return None
        return (int(fields[11]) + int(fields[12])) * 1_000_000_000 // self.ticks

    def watching_cpu_ns(self) -> int:
        """The CPU of the daemon's thread that watches: the loop, where every probe's events are
        drained, every process looked at and every BPF object loaded. Not the HTTP threads'
        (a flood of scrapes is no watched process's cost), nor NVML's or OTLP's; the discovery
        watchdog's is left out too (it sleeps but to continue a process held too long)."""
        if self.loop_tid is None:
            return 0
        return self.cpu_ns(os.getpid(), self.loop_tid) or 0

    def cost_ns(self, coll) -> int | None:
        """What a collector's probes cost so far: kernel-counted BPF time plus the hits by
        kind at this machine's calibrated trap costs (the accounting `attach` reports)."""
        try:
            c = coll.cost_counts()
        except Exception:
            return None
        if not c:
            return None
        t = self.trap_costs
        return int(c["bpf_ns"] + c["hits_emulated"] * t["emulated_ns"] + c["hits_stepped"] * t["stepped_ns"]
                   + c["hits_return"] * t["uretprobe_extra_ns"])

    def probe_cost_ns(self, w: Watch) -> int | None:
        """The process's own probes' cost, plus its share of its build's shared probes'."""
        if w.group is None:
            return None
        own = self.cost_ns(w.collector) if w.collector is not None else 0
        return None if own is None else int(own + w.group.charged_ns.get(w.identity.pid, 0.0))

    def due(self) -> bool:
        if time.monotonic() - self.last < GOVERN_S:
            return False
        self.last = time.monotonic()
        return True

    def govern(self, groups: list, watches: list[Watch], levels: set[str]) -> None:
        """Charge the shared probes' cost to their processes, then judge each process
        (`levels`: the daemon's, the most a process is given back)."""
        now = time.monotonic()
        for g in groups:
            cost = self.cost_ns(g.collector)
            if cost is not None:
                g.charge(cost)
        own = self.watching_cpu_ns()
        for w in watches:
            cpu = self.cpu_ns(w.identity.pid)
            probes = self.probe_cost_ns(w)
            if cpu is None or probes is None:
                continue
            mark = w.cost_mark
            if mark is not None and cpu - mark[1] < MIN_CPU_TO_JUDGE_NS:   # too little CPU yet to judge
                continue
            w.cost_mark = (now, cpu, probes, own)
            if mark is None:
                continue
            # the watching thread's CPU, shared out among the processes it watches: on a busy
            # machine it is taken from them
            daemon = (own - mark[3]) / max(len(watches), 1)
            w.share = max(0.0, ((probes - mark[2]) + daemon) / (cpu - mark[1]))
            self.metrics.cost(w.identity, w.share)
            self._judge(w, now, levels)

    def _judge(self, w: Watch, now: float, levels: set[str]) -> None:
        lower = next((lv for lv in STEP_DOWN_ORDER if lv in w.levels), None)
        if w.share > self.budget:
            w.calm_since = None
            if lower is not None and self.relevel(
                    w, w.levels - {lower}, f"costs {w.share:.1%} > budget {self.budget:.1%}"):
                if w.stepped_up:          # the level it went back up to did not fit
                    w.step_up_wait_s = min(w.step_up_wait_s * 2, MAX_STEP_UP_WAIT_S)
                w.stepped_up = False
        elif w.share <= self.budget / 2:
            w.calm_since = now if w.calm_since is None else w.calm_since
            missing = [lv for lv in reversed(STEP_DOWN_ORDER)
                       if lv in levels and lv not in w.levels and can_have(w, lv)]
            if missing and now - w.calm_since >= w.step_up_wait_s and self.relevel(
                    w, w.levels | {missing[0]}, f"costs {w.share:.1%}, room under {self.budget:.1%}"):
                w.stepped_up, w.calm_since = True, None
        else:
            w.calm_since = None
