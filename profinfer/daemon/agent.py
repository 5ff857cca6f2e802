"""The node agent: find the inference processes on the machine, keep cheap always-on
metrics of each, and forget each one when it exits.

The agent is its loop and its status; the work is done in stages, each its own module:
the finder (discovery/finder.py: which processes to watch, from /proc and from the kernel's
news of new processes), attach (attach.py: their probes, their levels, letting them go),
drain (drain.py: what the probes sent, handed to the metrics), and the governor
(governor.py: the overhead budget), over what they share of the node (node.py).

Each watched process is served by its build's shared probes (shared.py: one object per
engine and library files, the processes in a BPF map) at the always-on levels, and by its
own op-level probes where the budget allows; a process that exits leaves the map at once
(the object goes with the last one; an exit is seen at once through the process's pidfd),
and its metric series are dropped after a TTL. The cuda level is one object for every
process that has a runtime.

Nothing a process does, nor its vanishing at any moment, stops the loop: an error in one
watch is logged and counted, and the others go on. The files a process maps are its own (a
tenant's): their symbols and DWARF are read in a worker process with a deadline
(parsing.py); one still being read leaves its process to be looked at again at a later scan.
"""
from __future__ import annotations

import os
import resource
import select
import threading
import time

from profinfer.core.base.errors import ProfinferError
from profinfer.core.base.waits import PARSE_DEADLINE_S
from profinfer.core.plugin.packs import load_pack, pack_names
from profinfer.core.target import parsing
from profinfer.daemon.attach import Attach
from profinfer.daemon.discovery import kernel
from profinfer.daemon.discovery.finder import Finder
from profinfer.daemon.discovery.kernel import NodeDiscovery
from profinfer.daemon.drain import Drain
from profinfer.daemon.governor import Governor
from profinfer.daemon.node import SCAN_S, Node
from profinfer.daemon.plugins import process_caches

DEFAULT_LEVELS = ("token", "graph", "cuda")
# Any process that maps a file named like an engine's library or a CUDA runtime is watched:
# at most this many at once (each holds fds, probes and series), and at most as many exited
# ones' series kept for their TTL; what is left out is counted.
DEFAULT_MAX_PROCESSES = 64


def raise_fd_limit() -> None:
    """Each build's shared object, and each process's own op level, holds ~25 fds (maps,
    programs, links, ring): the soft limit goes up to the hard one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


class Agent:
    def __init__(self, levels: set[str] | None = None, budget: float = 0.04,
                 log=lambda msg: None, own_pid: int | None = None, discover_processes: bool = True,
                 max_processes: int = DEFAULT_MAX_PROCESSES, max_per_tenant: int | None = None):
        levels = set(levels or DEFAULT_LEVELS)
        all_packs = [load_pack(n) for n in pack_names()]
        engine_packs = [p for p in all_packs if not p.level]
        cuda_pack = next((p for p in all_packs if p.level == "cuda"), None) if "cuda" in levels else None
        self.node = node = Node(levels, engine_packs + ([cuda_pack] if cuda_pack is not None else []),
                                log, own_pid or os.getpid(), max_processes, max_per_tenant)
        self.drain = Drain(node)
        self.attach = Attach(node, self.drain)
        raise_fd_limit()
        self.governor = node.governor = Governor(budget, node.metrics, self.attach.relevel)
        log(f"probe hits priced at {self.governor.trap_costs_source}")
        if not self.governor.stats_on and "op" in levels:
            # the governor measures the op level's cost from the kernel's BPF run-time counts
            # (run time, and runs: the probe hits): without them it would run ungoverned
            node.levels = levels - {"op"}
            log("op level off: BPF run-time statistics are refused (they need CAP_SYS_ADMIN, "
                "or sysctl kernel.bpf_stats_enabled=1 on the node), so its cost cannot be governed")
        self._last_scan = 0.0
        self.started = time.time()
        self.last_loop = time.monotonic()     # /healthz: the loop is alive
        for pack in node.all_packs:
            # each plugin's readers imported now: the parse worker starts with their modules
            # (it imports none once confined; one it lacks later costs a new worker)
            try:
                pack.collector_class()
            except Exception as e:
                log(f"{pack.engine}: its collector cannot be imported: {type(e).__name__}: {e}")
        self.finder = Finder(node, self.attach, None)
        parsing.start(deadline_s=PARSE_DEADLINE_S)     # tenants' files read away from this loop, from now on
        parsing.set_tenant_resolver(self.finder.tenant_of)     # each in its tenant's queue
        # the kernel's hooks last: a process held from then on waits for no start-up of ours
        why = kernel.available() if discover_processes else "turned off"
        if why is None:
            try:
                self.finder.discovery = NodeDiscovery(node.all_packs, log=log)
            except ProfinferError as e:
                why = str(e)
        self.discovery_off = why

    # what the HTTP threads, the flight recorder, the captures and the tests read of the node
    levels = property(lambda self: self.node.levels)
    watches = property(lambda self: self.node.watches)
    lock = property(lambda self: self.node.lock)
    metrics = property(lambda self: self.node.metrics)
    seen = property(lambda self: self.node.seen)
    log = property(lambda self: self.node.log)
    discovery = property(lambda self: self.finder.discovery)
    program_totals = property(lambda self: self.node.program_totals)

    @property
    def loop_errors(self) -> int:
        return self.node.loop_errors

    @loop_errors.setter
    def loop_errors(self, n: int) -> None:      # the daemon's loop counts a fault of its own here
        self.node.loop_errors = n

    @property
    def recorder(self):
        return self.node.recorder

    @recorder.setter
    def recorder(self, recorder) -> None:
        self.node.recorder = recorder

    def poll(self, timeout_s: float) -> None:
        """Wait for events (up to timeout_s), drain every watch, scan when due."""
        node = self.node
        self.last_loop = time.monotonic()
        self.governor.loop_tid = threading.get_native_id()
        with node.lock:
            watches = list(node.watches.values())
        groups = list(node.groups.values())
        poller = select.poll()          # no FD_SETSIZE limit
        shared = [g.collector for g in groups] + ([node.runtime.collector] if node.runtime else [])
        for coll in shared + [w.collector for w in watches]:
            try:
                poller.register(coll.fileno(), select.POLLIN)
            except Exception:
                pass
        exits = {w.pidfd: w for w in watches if w.pidfd >= 0}
        for fd in exits:
            poller.register(fd, select.POLLIN)
        discovery = self.finder.discovery
        if discovery is not None:
            poller.register(discovery.fileno(), select.POLLIN)
        ready = poller.poll(timeout_s * 1000)
        parsing.pump()                      # readings finished meanwhile, the next one started
        if discovery is not None:           # a held process waits on this: first
            self.finder.discovered()
        for g in groups:
            self.drain.group(g)
        self.drain.runtime()
        for w in watches:
            self.drain.process(w)
        for fd, _ in ready:                 # exited: detached now, not at the next scan
            w = exits.get(fd)
            if w is not None and node.watches.get(w.identity.pid) is w:
                self.attach.gone(w)
        if node.leaving:
            self.attach.let_go(time.monotonic())
        if node.recorder is not None:
            try:
                node.recorder.judge()
            except Exception as e:          # the recorder's trouble, not the loop's
                node.error(f"flight recorder: {type(e).__name__}: {e}")
        if time.monotonic() - self._last_scan >= SCAN_S:
            self._last_scan = time.monotonic()
            self.finder.scan()
            self.attach.expire()
            self.drain.sample_all()
            node.metrics.self_metrics(self)
        if self.governor.due():
            self.governor.govern(list(node.groups.values()), node.runtime, list(node.watches.values()),
                                 node.levels)

    def status(self) -> dict:
        node = self.node
        with node.lock:
            watches = list(node.watches.values())
            unwatched = list(node.unwatched.values())
        discovery = self.finder.discovery       # the loop may close it meanwhile
        runtime = node.runtime
        return {
            "pid": node.own_pid, "started": self.started, "levels": sorted(node.levels),
            "budget": self.governor.budget, "attach_errors": node.attach_errors, "loop_errors": node.loop_errors,
            "otlp_event_errors": node.metrics.otlp_event_errors,
            "trap_costs_ns": self.governor.trap_costs, "traps_calibrated": self.governor.traps_calibrated,
            "trap_costs_source": self.governor.trap_costs_source,
            "processes": [{**w.identity.as_dict(), "levels": sorted(w.levels), "cost_share": w.share,
                           "cost_by_level": w.shares, "idle": w.idle, "step_up_wait_s": w.step_up_wait_s,
                           "probes": getattr(w.collector, "n_probes", 0),
                           "probes_stepped": getattr(w.collector, "probes_stepped", 0),
                           "shared_probes": w.group.collector.n_probes if w.group else 0,
                           "events": getattr(w.collector, "n_events", 0),
                           "lost": w.lost_seen, "watched_since": w.started_at} for w in watches],
            "shared_probes": [{"engine": g.key[0], "files": sorted(os.path.basename(f.path) for f in g.collector.elfs),
                               "probes": g.collector.n_probes, "probes_stepped": g.collector.probes_stepped,
                               "processes": sorted(g.pids)}
                              for g in list(node.groups.values())]
            + ([{"engine": "CUDA", "files": runtime.files(), "probes": runtime.collector.n_probes,
                 "probes_stepped": runtime.collector.probes_stepped,
                 "processes": sorted(runtime.pids)}] if runtime else []),
            "found_not_watched": [{**i.as_dict(), "why": "no always-on level for this engine yet"}
                                  for i in unwatched],
            "gpu": node.metrics.gpu_state,
            "limits": {"max_processes": node.max_processes, "max_per_tenant": node.seen.tenants.limit,
                       "processes_dropped": node.metrics.processes_dropped,
                       "dropped_by_tenant": dict(node.seen.tenants.left_out),
                       "series_dropped": node.metrics.series_dropped,
                       "left_out_now": len(node.seen.over_cap)},
            "caches": {**{k: v for m in process_caches() for k, v in m.cache_sizes().items()},
                       "process_series": len(node.metrics.processes),
                       "sequences": sum(len(w.tracker.current) for w in watches + list(node.exited))},
            "discovery": ({"loaders_hooked": len(discovery.loaders), "holds": discovery.holds,
                           "held": discovery.held_now(), "hold_deadline_s": discovery.deadline_s,
                           "ended_by_deadline": discovery.deadline_ended()}
                          if discovery is not None else {"off": self.discovery_off}),
            **({"flight_recorder": node.recorder.status()} if node.recorder is not None else {}),
            "parse_worker": parsing.status(),
        }

    def release_held(self) -> None:
        """Discovery closed: nothing is held from then on, and every held process continued."""
        if self.finder.discovery is not None:
            try:
                self.finder.discovery.close()
            except Exception as e:
                self.node.error(f"closing discovery: {type(e).__name__}: {e}")
            self.finder.discovery = None

    def close(self) -> None:
        self.release_held()
        parsing.stop()
        parsing.set_tenant_resolver(None)
        self.attach.close()
        self.governor.close()
