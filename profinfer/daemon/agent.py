"""The node agent: find the inference processes on the machine, keep cheap always-on
metrics of each, and forget each one when it exits.

Discovery scans /proc once a second: a process qualifies when it maps an engine's libraries
(or its executable defines the engine's marker). A process that maps none is looked at again
when its address space has changed size since (Python loads llama.cpp with dlopen): one read
of /proc/PID/stat a second per process, its mappings only when they may have changed. Each
watched process gets its engine's
collector at the daemon's levels, with probes filtered to that process; a process that exits
is detached at once, and its metric series are dropped after a TTL.
"""
from __future__ import annotations

import os
import select
import threading
import time
from dataclasses import dataclass, field, replace

from .. import discovery, libbpf
from ..errors import ProfinferError
from ..probepack import Pack, load_pack, pack_names
from ..session import find_engine
from ..stats import SequenceTracker
from .identity import Identity, identify, model_file
from .metrics import Metrics

SCAN_S = 1.0
SERIES_TTL_S = 300.0     # an exited process's series stay this long (a last scrape sees them)
# each watched process's event ring: 64 KiB holds a few hundred token events, drained every
# 0.2 s (a ring of 4 MiB each, attach's default, would be 4 MiB of locked memory a process)
RING_PAGES = 16
DEFAULT_LEVELS = ("token",)


@dataclass
class Watch:
    identity: Identity
    collector: object
    levels: set[str]
    started_at: float
    tracker: SequenceTracker = field(default_factory=lambda: SequenceTracker(keep=False))
    exited_at: float | None = None
    lost_seen: int = 0


def _stat(pid: int) -> tuple[int, int] | None:
    """(start time in clock ticks since boot: a pid's identity with its number; virtual
    memory size: what a new mapping changes), from /proc/PID/stat; None once it has exited
    (a zombie not yet reaped included)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        if fields[0] in ("Z", "X"):
            return None
        return int(fields[19]), int(fields[20])
    except (OSError, ValueError, IndexError):
        return None


def _start_time(pid: int) -> int | None:
    st = _stat(pid)
    return st[0] if st else None


class Agent:
    def __init__(self, levels: set[str] | None = None, budget: float = 0.04,
                 log=lambda msg: None, own_pid: int | None = None):
        self.levels = set(levels or DEFAULT_LEVELS)
        self.budget = budget
        self.log = log
        self.own_pid = own_pid or os.getpid()
        self.packs: list[Pack] = [p for p in (load_pack(n) for n in pack_names()) if not p.level]
        self.metrics = Metrics()
        self.watches: dict[int, Watch] = {}
        self.exited: list[Watch] = []
        self.unwatched: dict[int, Identity] = {}    # found, with no always-on level
        self.not_engines: dict[tuple[int, int], int] = {}   # (pid, start time) -> vsize when looked at
        self.executables_seen: dict[tuple, bool] = {}       # executable file: defines a marker
        self.attach_errors = 0
        self.lock = threading.Lock()          # watches, as the HTTP thread reads them
        self._stats_fd = libbpf.enable_run_time_stats()
        self._last_scan = 0.0
        self.started = time.time()
        self.last_loop = time.monotonic()     # /healthz: the loop is alive

    # ---- discovery ----

    def scan(self) -> None:
        pids = [int(d) for d in os.listdir("/proc") if d.isdigit()]
        alive = set(pids)
        for pid, w in list(self.watches.items()):
            if pid not in alive or _start_time(pid) is None:
                self._gone(w)
        self.not_engines = {k: v for k, v in self.not_engines.items() if k[0] in alive}
        self.unwatched = {p: i for p, i in self.unwatched.items() if p in alive}
        for w in list(self.watches.values()):
            if not w.identity.model:        # a model loaded after the process was found
                found = model_file(w.identity.pid)
                if found:
                    w.identity = replace(w.identity, model=found)
                    self.metrics.watched(w.identity, keep_counts=True)
        for pid in pids:
            if pid in self.watches or pid == self.own_pid:
                continue
            st = _stat(pid)
            if st is None:
                continue
            start, vsize = st
            if self.not_engines.get((pid, start)) == vsize:
                continue              # looked at, and nothing mapped since
            try:
                found = find_engine(self.packs, pid, True, self.executables_seen)
            except (OSError, ProfinferError):
                found = None
            if found is None:
                self.not_engines[(pid, start)] = vsize
                continue
            self._watch(pid, *found)

    def _watch(self, pid: int, pack: Pack, files: list[tuple[str, str]]) -> None:
        cls = pack.collector_class()
        if not hasattr(cls, "take_tokens"):
            # no always-on level for this engine yet (vLLM's steps come from its op level,
            # whose calls a daemon would have to aggregate in BPF): found and listed, not probed
            st = _stat(pid)
            if st is not None:
                self.not_engines[(pid, st[0])] = st[1]
            ident = identify(pid, pack.engine)
            if pid not in self.unwatched:
                self.unwatched[pid] = ident
                self.log(f"PID {pid} ({ident.comm}) runs {pack.engine}: found, not watched (no "
                         "always-on level for this engine yet)")
            return
        levels = {lv for lv in self.levels if lv in pack.raw.get("levels", self.levels)} or self.levels
        try:
            coll = cls(pid, levels, pack, files, root=f"/proc/{pid}/root", ringbuf_pages=RING_PAGES)
            coll.attach()
        except ProfinferError as e:
            self.attach_errors += 1
            self.metrics.attach_errors.labels(engine=pack.engine).inc()
            st = _stat(pid)
            if st is not None:
                self.not_engines[(pid, st[0])] = st[1]
            if discovery.process_exists(pid):
                self.log(f"PID {pid} ({pack.engine}): not watched: {e}")
            return
        ident = identify(pid, pack.engine)
        w = Watch(ident, coll, levels, time.time())
        with self.lock:
            self.watches[pid] = w
        self.metrics.watched(ident)
        self.log(f"watching PID {pid} ({ident.comm}, {pack.engine}"
                 + (f", model {os.path.basename(ident.model)}" if ident.model else "")
                 + (f", container {ident.container}" if ident.container else "")
                 + (f", pod {ident.namespace}/{ident.pod}" if ident.pod_uid else "")
                 + f") at {','.join(sorted(levels))}, {coll.n_probes} probes")

    def _gone(self, w: Watch) -> None:
        """Detach at once; the series stay for SERIES_TTL_S."""
        self._drain(w)
        try:
            w.collector.detach()
        except ProfinferError as e:
            self.log(f"PID {w.identity.pid}: detaching: {e}")
        w.exited_at = time.time()
        w.collector = None          # its buffers go now; the series stay (metrics)
        with self.lock:
            self.watches.pop(w.identity.pid, None)
            self.exited.append(w)
        self.metrics.exited(w.identity)
        self.log(f"PID {w.identity.pid} ({w.identity.comm}) exited: detached")

    def expire(self) -> None:
        now = time.time()
        keep = []
        for w in self.exited:
            if now - w.exited_at >= SERIES_TTL_S:
                self.metrics.forget(w.identity)
            else:
                keep.append(w)
        self.exited = keep

    # ---- collecting ----

    def _drain(self, w: Watch) -> None:
        coll = w.collector
        try:
            coll.poll(0)
        except ProfinferError as e:
            self.log(f"PID {w.identity.pid}: {e}")
            return
        take = getattr(coll, "take_tokens", None)
        if take is not None:
            for t in take():
                ttfts, tpots = w.tracker.feed(t)
                self.metrics.decode_call(w.identity, t, ttfts, tpots)
        lost = coll.lost()
        if lost > w.lost_seen:
            self.metrics.lost(w.identity, lost - w.lost_seen)
            w.lost_seen = lost

    def poll(self, timeout_s: float) -> None:
        """Wait for events (up to timeout_s), drain every watch, scan when due."""
        self.last_loop = time.monotonic()
        with self.lock:
            watches = list(self.watches.values())
        fds = []
        for w in watches:
            try:
                fds.append(w.collector.fileno())
            except (AttributeError, ProfinferError):
                pass
        if fds:
            select.select(fds, [], [], timeout_s)
        else:
            time.sleep(timeout_s)
        for w in watches:
            self._drain(w)
        if time.monotonic() - self._last_scan >= SCAN_S:
            self._last_scan = time.monotonic()
            self.scan()
            self.expire()
            self.metrics.self_metrics(self)

    def program_stats(self) -> dict[str, tuple[int, int]]:
        """The kernel's count of every watched collector's BPF programs: {program: (ns, runs)}."""
        out: dict[str, tuple[int, int]] = {}
        with self.lock:
            watches = list(self.watches.values())
        for w in watches:
            obj = getattr(w.collector, "obj", None)
            if obj is None:
                continue
            try:
                stats = obj.program_stats()
            except ProfinferError:
                continue
            for prog, (ns, runs) in stats.items():
                a, b = out.get(prog, (0, 0))
                out[prog] = (a + ns, b + runs)
        return out

    def status(self) -> dict:
        with self.lock:
            watches = list(self.watches.values())
        return {
            "pid": self.own_pid, "started": self.started, "levels": sorted(self.levels),
            "budget": self.budget, "attach_errors": self.attach_errors,
            "processes": [{**w.identity.as_dict(), "levels": sorted(w.levels),
                           "probes": getattr(w.collector, "n_probes", 0),
                           "events": getattr(w.collector, "n_events", 0),
                           "lost": w.lost_seen, "watched_since": w.started_at} for w in watches],
            "gpu": self.metrics.gpu_state,
            "found_not_watched": [{**i.as_dict(), "why": "no always-on level for this engine yet"}
                                  for i in self.unwatched.values()],
        }

    def close(self) -> None:
        with self.lock:
            watches = list(self.watches.values())
            self.watches.clear()
        for w in watches:
            try:
                w.collector.detach()
            except ProfinferError:
                pass
        if self._stats_fd >= 0:
            os.close(self._stats_fd)
            self._stats_fd = -1
