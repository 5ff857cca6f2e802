"""What the agent holds of the node, shared by its stages (discovery's finder, attach,
drain) and read by the HTTP threads under `lock`: the watched processes, the shared probes
serving them, the exited ones whose series wait for their TTL, and the counts of what went
wrong. Also the mark that keeps the CPU of attaching and detaching apart from what watching
costs over time (set_up)."""
from __future__ import annotations

import functools
import threading
import time

from profinfer.core.plugin.packs import Pack
from profinfer.daemon.discovery.identity import Identity
from profinfer.daemon.discovery.seen import SeenProcesses
from profinfer.daemon.export.metrics import Metrics
from profinfer.daemon.shared import SharedProbes, SharedRuntime
from profinfer.daemon.watch import Watch

SCAN_S = 1.0        # the agent's scan of /proc (the finder's); a process moved away is let go a scan later


class Node:
    def __init__(self, levels: set[str], all_packs: list[Pack], log, own_pid: int,
                 max_processes: int, max_per_tenant: int | None):
        self.levels = levels
        self.all_packs = all_packs
        self.log = log
        self.own_pid = own_pid
        self.max_processes = max_processes
        self.seen = SeenProcesses()
        # a tenant's share of the cap: a quarter unless set
        self.seen.tenants.limit = max_per_tenant or max(1, max_processes // 4)
        self.metrics = Metrics()
        self.watches: dict[int, Watch] = {}
        self.groups: dict[tuple, SharedProbes] = {}
        self.runtime: SharedRuntime | None = None    # the cuda level, once a process has one
        self.exited: list[Watch] = []
        self.unwatched: dict[tuple[int, int], Identity] = {}    # found, no always-on level
        self.leaving: list = []               # (shared object, pid, when): moved away (attach's regroup)
        self.retired_programs: dict[str, tuple[int, int]] = {}  # what exited watches' programs ran
        self.lock = threading.Lock()          # watches, unwatched: the HTTP threads read them
        self.attach_errors = 0
        self.loop_errors = 0
        self.recorder = None                  # the flight recorder (flight/recorder.py), with --trigger
        self.governor = None                  # the agent's, once its stages exist
        self.setting_up = False               # in an attach or detach (set_up)

    @property
    def cuda_pack(self) -> Pack | None:
        """The cuda level's pack, where the daemon has that level (the last of all_packs)."""
        return next((p for p in self.all_packs if p.level == "cuda"), None)

    def error(self, msg: str) -> None:
        self.loop_errors += 1
        self.log(msg)

    def full(self) -> bool:
        return len(self.watches) + len(self.unwatched) >= self.max_processes

    def retire(self, programs: dict[str, tuple[int, int]]) -> None:
        """What detached programs ran stays in the totals."""
        for prog, (ns, runs) in programs.items():
            a, b = self.retired_programs.get(prog, (0, 0))
            self.retired_programs[prog] = (a + ns, b + runs)

    def program_totals(self) -> dict[str, tuple[int, int]]:
        """Every watched and exited collector's BPF programs: {program: (ns, runs)}, from the
        kernel's counts (each watch's last sample, exited ones' final)."""
        out = dict(self.retired_programs)
        with self.lock:
            watches = list(self.watches.values())
        shared = list(self.groups.values()) + ([self.runtime] if self.runtime else [])
        for programs in [w.programs for w in watches] + [g.programs for g in shared]:
            for prog, (ns, runs) in programs.items():
                a, b = out.get(prog, (0, 0))
                out[prog] = (a + ns, b + runs)
        return out


def set_up(method):
    """The loop thread's CPU while a stage attaches or detaches probes (once per change, not
    as long as a process is watched) is kept apart from what watching costs over time (the
    governor's daemon share)."""
    @functools.wraps(method)
    def timed(self, *args, **kwargs):
        node = self.node
        if node.setting_up:
            return method(self, *args, **kwargs)
        node.setting_up, began = True, time.thread_time_ns()
        try:
            return method(self, *args, **kwargs)
        finally:
            node.setting_up = False
            node.governor.setup_cpu_ns += time.thread_time_ns() - began
    return timed
