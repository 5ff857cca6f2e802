"""The node agent: find the inference processes on the machine, keep cheap always-on
metrics of each, and forget each one when it exits.

Discovery scans /proc once a second: a process qualifies when it maps an engine's libraries
(or its executable defines the engine's marker). A process that maps none is looked at again
when its address space has changed size (Python loads llama.cpp with dlopen): one read of
/proc/PID/stat a second per process, its mappings only when they may have changed. A process
is (pid, start time): a pid reused by a new process is a new process. Each watched process
is served by its build's shared probes (shared.py: one object per engine and library files,
the processes in a BPF map) at the always-on levels, and by its own op-level probes where the
budget allows; a process that exits leaves the map at once (the object goes with the last
one; an exit is seen at once through the process's pidfd), and its metric series are dropped
after a TTL. The cuda level is one object for every process that has a runtime.

Nothing a process does, nor its vanishing at any moment, stops the loop: an error in one
watch is logged and counted, and the others go on. The files a process maps are its own (a
tenant's): their symbols and DWARF are read in a worker process with a deadline
(parsing.py); one still being read leaves its process to be looked at again at a later scan.
"""
from __future__ import annotations

import functools
import os
import resource
import select
import threading
import time
from dataclasses import replace

from profinfer.core.target import parsing
from profinfer.core.base.errors import ProfinferError
from profinfer.core.profile.model import TokenCall
from profinfer.core.target.parsing import NotReady
from profinfer.core.plugin.packs import Pack, load_pack, pack_names
from profinfer.core.target.process import mapped_files
from profinfer.core.follow import interpreter
from profinfer.core.plugin.packfinder import engine_files, find_engine, find_packs
from profinfer.core.target.procfs import exit_fd, process_stat
from profinfer.daemon.discovery import kernel as discover
from profinfer.daemon.discovery.kernel import NodeDiscovery
from profinfer.core.profile.stats import SequenceTracker
from profinfer.core.base.waits import PARSE_DEADLINE_S, SERIES_TTL_S, STEP_UP_S, WATCH_GRACE_S
from profinfer.daemon.governor import Governor, level_rank
from profinfer.daemon.discovery.identity import Identity, identify, model_file
from profinfer.daemon.export.metrics import Metrics
from profinfer.daemon.plugins import capabilities, process_caches
from profinfer.daemon.discovery.seen import SeenProcesses
from profinfer.daemon.shared import SharedProbes, SharedRuntime, group_key
from profinfer.daemon.watch import Watch, step_call


SCAN_S = 1.0
MODEL_RECHECK_S = 10.0   # a watched process with no model file found yet is looked at again
RETRY_FIRST_S, RETRY_MAX_S = 2.0, 60.0    # a failed attach is tried again, backing off
DEFAULT_LEVELS = ("token", "graph", "cuda")
SHARED_LEVELS = ("token", "graph")    # shared per build; the op level is per process
# a process's own op-level object sends next to nothing (its ops are counted in BPF; its
# graph events bound them): 64 KiB (a ring of 4 MiB, attach's default, would be 4 MiB of
# locked memory a process)
RING_PAGES = 16
# Any process that maps a file named like an engine's library or a CUDA runtime is watched:
# at most this many at once (each holds fds, probes and series), and at most as many exited
# ones' series kept for their TTL; what is left out is counted.
DEFAULT_MAX_PROCESSES = 64


def _set_up(method):
    """The loop thread's CPU while it attaches or detaches probes (once per change, not as
    long as a process is watched) is kept apart from what watching costs over time (the
    governor's daemon share)."""
    @functools.wraps(method)
    def timed(self, *args, **kwargs):
        if self._setting_up:
            return method(self, *args, **kwargs)
        self._setting_up, began = True, time.thread_time_ns()
        try:
            return method(self, *args, **kwargs)
        finally:
            self._setting_up = False
            self.governor.setup_cpu_ns += time.thread_time_ns() - began
    return timed


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
        self.levels = set(levels or DEFAULT_LEVELS)
        self.max_processes = max_processes
        self.log = log
        self.own_pid = own_pid or os.getpid()
        all_packs = [load_pack(n) for n in pack_names()]
        engine_packs = [p for p in all_packs if not p.level]
        cuda_pack = next((p for p in all_packs if p.level == "cuda"), None) if "cuda" in self.levels else None
        self.all_packs = engine_packs + ([cuda_pack] if cuda_pack is not None else [])
        self.seen = SeenProcesses()
        # a tenant's share of the cap: a quarter unless set
        self.seen.tenants.limit = max_per_tenant or max(1, max_processes // 4)
        self.metrics = Metrics()
        self.watches: dict[int, Watch] = {}
        self.groups: dict[tuple, SharedProbes] = {}
        self.runtime: SharedRuntime | None = None    # the cuda level, once a process has one
        self.exited: list[Watch] = []
        self.unwatched: dict[tuple[int, int], Identity] = {}    # found, no always-on level
        self.attach_errors = 0
        self.loop_errors = 0
        self.retired_programs: dict[str, tuple[int, int]] = {}  # what exited watches' programs ran
        self.lock = threading.Lock()          # watches, unwatched: the HTTP threads read them
        self._setting_up = False              # in an attach or detach (_set_up)
        self._leaving: list = []              # (shared object, pid, when): moved away (_regroup)
        self.recorder = None                  # the flight recorder (recorder.py), with --trigger
        raise_fd_limit()
        self.governor = Governor(budget, self.metrics, self._relevel)
        self.log(f"probe hits priced at {self.governor.trap_costs_source}")
        if not self.governor.stats_on and "op" in self.levels:
            # the governor measures the op level's cost from the kernel's BPF run-time counts
            # (run time, and runs: the probe hits): without them it would run ungoverned
            self.levels = self.levels - {"op"}
            self.log("op level off: BPF run-time statistics are refused (they need CAP_SYS_ADMIN, "
                     "or sysctl kernel.bpf_stats_enabled=1 on the node), so its cost cannot be governed")
        self._last_scan = 0.0
        self.started = time.time()
        self.last_loop = time.monotonic()     # /healthz: the loop is alive
        for pack in self.all_packs:
            # each plugin's readers imported now: the parse worker starts with their modules
            # (it imports none once confined; one it lacks later costs a new worker)
            try:
                pack.collector_class()
            except Exception as e:
                self.log(f"{pack.engine}: its collector cannot be imported: {type(e).__name__}: {e}")
        parsing.start(deadline_s=PARSE_DEADLINE_S)     # tenants' files read away from this loop, from now on
        parsing.set_tenant_resolver(self._tenant_of)     # each in its tenant's queue
        self.discovery: NodeDiscovery | None = None
        why = discover.available() if discover_processes else "turned off"
        if why is None:
            try:
                self.discovery = NodeDiscovery(self.all_packs, log=self.log)
            except ProfinferError as e:
                why = str(e)
        self.discovery_off = why

    # ---- discovery ----

    def scan(self) -> None:
        try:
            pids = [int(d) for d in os.listdir("/proc") if d.isdigit()]
        except OSError as e:
            self._error(f"reading /proc: {e}")
            return
        alive = set(pids)
        stats: dict[int, tuple[int, int]] = {}     # read once a scan
        for pid, w in list(self.watches.items()):
            st = process_stat(pid)
            if st is None or st[0] != w.identity.start:     # exited (its pid maybe reused)
                self._gone(w)
            else:
                stats[pid] = st
        now = time.monotonic()
        self.seen.keep_alive(alive)
        if self.discovery is not None:
            for pid in sorted(self.seen.loader_pending):     # loaders read since the last scan
                self.seen.loader_pending.discard(pid)
                if pid in alive:
                    with self._on_behalf_of(pid):
                        self._hook_loader(pid)
        with self.lock:
            self.unwatched = {k: v for k, v in self.unwatched.items() if k[0] in alive}
        for w in list(self.watches.values()):
            attached = False
            if w.op_pending and w.collector is None:        # its files were being read
                with self._on_behalf_of(w.identity.pid, w.identity.start):
                    attached = self._attach_op(w)
            if attached:
                w.op_pending = False
                w.cost_mark = None
                self.metrics.level(w.identity, level_rank(w.levels))
                self.log(f"PID {w.identity.pid}: op level attached, {w.collector.n_probes} probes of its own")
            if not w.identity.model and now - w.model_checked >= MODEL_RECHECK_S:
                w.model_checked = now          # a model loaded after the process was found
                found = model_file(w.identity.pid)
                if found:
                    w.identity = replace(w.identity, model=found)
                    self.metrics.watched(w.identity, keep_counts=True)
        for pid in pids:
            if pid in self.watches or pid == self.own_pid:
                continue
            st = stats[pid] = process_stat(pid)
            if st is not None:
                self._look(pid, st, now)
        # a watched process that loads a CUDA runtime or driver later (PyTorch dlopens
        # libcudart, which dlopens libcuda): probed at once where discovery holds it at its
        # loader's hook, else within a scan
        if self.cuda_pack is not None:
            for pid, w in list(self.watches.items()):
                st = stats.get(pid)
                if st is not None and self.seen.cuda_checked.get((pid, st[0])) != st[1]:
                    with self._on_behalf_of(pid, st[0]):
                        self._look_runtime(pid, w, st)

    def _tenant_of(self, pid: int, start: int | None = None) -> str:
        if start is None:
            st = process_stat(pid)
            start = st[0] if st is not None else -1
        return self.seen.tenants.tenant((pid, start))

    def _on_behalf_of(self, pid: int, start: int | None = None):
        """The tenant's turn for the files read while looking at the process (parsing's
        queue per tenant)."""
        return parsing.on_behalf_of(self._tenant_of(pid, start))

    def _look(self, pid: int, st: tuple[int, int], now: float, settled: bool = False) -> None:
        """Watch `pid` if it maps an engine or a runtime now (settled: discovery holds it with
        its library list complete, so look even if its size is the one looked at before)."""
        key, vsize = (pid, st[0]), st[1]
        if not settled and (self.seen.not_engines.get(key) == vsize or key in self.unwatched):
            return                    # looked at, and nothing mapped since
        if key in self.seen.over_cap and not self._room_for(self.seen.tenants.of.get(key, "")):
            return                    # left out, and still no room
        with parsing.on_behalf_of(self.seen.tenants.tenant(key)):
            self._look_further(pid, st, now, settled)

    def _look_further(self, pid: int, st: tuple[int, int], now: float, settled: bool) -> None:
        key, vsize = (pid, st[0]), st[1]
        if not settled and self.discovery is not None:
            if self.discovery.pending(pid):
                return                # loading: looked at once its loader is done
            if key not in self.seen.loader_seen:
                self.seen.loader_seen.add(key)
                self._hook_loader(pid)
        retry = self.seen.failed.get(key)
        if retry is not None and now < retry[0]:
            return
        try:
            matched = find_packs(self.all_packs, pid, True, self.seen.executables_seen)
        except NotReady:
            return                    # its executable is being read: looked at again later
        except (OSError, ProfinferError):
            matched = []
        except Exception as e:          # an unreadable file of a vanishing process
            self._error(f"PID {pid}: looking for an engine: {type(e).__name__}: {e}")
            matched = []
        found = next((m for m in matched if not m[0].level), None)
        cuda = next((m for m in matched if m[0].level), None)
        if found is None and cuda is None:
            self.seen.not_engines[key] = vsize
            return
        tenant = self.seen.tenants.tenant(key)
        if self._watched_of(tenant) >= self.seen.tenants.limit:
            self._left_out(key, tenant, f"its tenant ({tenant}) has {self.seen.tenants.limit} watched (--max-per-tenant)")
            return
        if self._full() and not self._make_room():
            self._left_out(key, tenant, f"watching {self.max_processes} processes (--max-processes)")
            return
        self.seen.over_cap.discard(key)
        if found is not None:
            self._watch(pid, st[0], *found)
        else:
            self._watch_runtime_only(pid, st[0])
        if cuda is not None and pid in self.watches:
            self._watch_cuda(self.watches[pid], cuda[1])

    def _full(self) -> bool:
        return len(self.watches) + len(self.unwatched) >= self.max_processes

    def _room_for(self, tenant: str) -> bool:
        return not self._full() and self._watched_of(tenant) < self.seen.tenants.limit

    def _watched_of(self, tenant: str) -> int:
        keys = [(pid, w.identity.start) for pid, w in self.watches.items()] + list(self.unwatched)
        return sum(1 for k in keys if self.seen.tenants.of.get(k) == tenant)

    def _make_room(self) -> bool:
        """The cap reached: a watched process that made no engine call (no decode call, no
        step) in its first WATCH_GRACE_S gives its place up, from the tenant with the most
        watched (the longest watched of them). False where none may."""
        now = time.time()
        idle = [w for w in self.watches.values() if not w.callers and now - w.started_at >= WATCH_GRACE_S]
        if not idle:
            return False
        by_tenant: dict[str, int] = {}
        for w in self.watches.values():
            t = self.seen.tenants.of.get((w.identity.pid, w.identity.start), "")
            by_tenant[t] = by_tenant.get(t, 0) + 1
        w = min(idle, key=lambda w: (-by_tenant.get(self.seen.tenants.of.get((w.identity.pid, w.identity.start), ""), 0),
                                     w.started_at))
        key = (w.identity.pid, w.identity.start)
        self._gone(w, f"gave its place up: no engine call in {now - w.started_at:.0f} s, and the watch cap was reached")
        self._left_out(key, self.seen.tenants.of.get(key, ""), "")
        return True

    def _left_out(self, key: tuple[int, int], tenant: str, why: str) -> None:
        """A process found with no room (why): counted once, by tenant, said once a spell."""
        if key in self.seen.over_cap:
            return
        self.seen.over_cap.add(key)
        self.metrics.processes_dropped += 1
        self.seen.tenants.count_left_out(tenant)
        if why and not self.seen.cap_said:
            self.seen.cap_said = True
            self.log(f"PID {key[0]} left out: {why}; it and any other left out now are counted in "
                     "profinfer_processes_dropped_total, and by tenant in /status")

    @_set_up
    def _look_runtime(self, pid: int, w: Watch, st: tuple[int, int]) -> None:
        """A watched process that may have loaded a CUDA runtime since it was looked at."""
        self.seen.cuda_checked[(pid, st[0])] = st[1]
        try:
            cuda = find_engine([self.cuda_pack], pid, False, self.seen.executables_seen)
        except Exception:
            cuda = None
        if cuda is None:
            return
        if not w.cuda:
            self._watch_cuda(w, cuda[1])
        else:
            try:
                self.runtime.add(pid, cuda[1])
            except NotReady:
                self.seen.cuda_checked.pop((pid, st[0]), None)     # looked at again at the next scan
            except Exception as e:
                self._error(f"PID {pid}: probing a runtime it loaded: {e}")

    # ---- discovery from the kernel ----

    def _discovered(self) -> None:
        """What the kernel told of new processes: the held ones first (each continued
        whatever looking at it found or raised), then new executables."""
        events = self.discovery.events()
        for ev in sorted(events, key=lambda e: e.what == "exec"):
            try:
                with self._on_behalf_of(ev.tgid):
                    if ev.what == "exec":
                        self._new_executable(ev.tgid, ev.file)
                    elif ev.what == "candidate":
                        self._candidate(ev.tgid)
                    elif ev.what == "loaded":
                        self._libraries_loaded(ev.tgid)
                    elif ev.what == "seen":         # not stopped (traced, or a terminal's): look now
                        self._look_now(ev.tgid)
            except Exception as e:
                self._error(f"PID {ev.tgid}: discovery ({ev.what}): {type(e).__name__}: {e}")
            finally:
                if ev.what != "exec" and ev.tgid in self.discovery.held:
                    self.discovery.release(ev.tgid, done=False)

    def _new_executable(self, pid: int, file: bytes) -> None:
        """An executable not looked at yet: does it define an engine's or a runtime's marker
        (linked in statically)? Its later execs are held at exec if so; this one, already
        running, is looked at now."""
        ino = int.from_bytes(file[:8], "little")

        def told_of() -> bool:
            """The process's image still has the inode number the kernel told of. (By inode
            alone: stat's device is not the kernel's superblock device on btrfs or a
            multi-layer overlay, where a check by device would refuse every verdict; a
            tenant's own file of the same number on another device can still give a shared
            file its verdict: docs/security.md.)"""
            return os.stat(f"/proc/{pid}/exe").st_ino == ino

        try:
            exe = os.readlink(f"/proc/{pid}/exe").removesuffix(" (deleted)")
            if not told_of():
                return              # another image by now: nothing known of that one
            main = [m for m in mapped_files(pid) if m.path == exe]
            engine = any(engine_files(p, pid, main, True, self.seen.executables_seen)
                         for p in self.all_packs if p.marker)
            if not told_of():
                return              # it ran another image while its file was read
        except (OSError, ProfinferError):    # NotReady included: the scan looks at it later
            return
        self.discovery.executable(file, engine)
        self._hook_loader(pid)
        st = process_stat(pid)
        if engine and st is not None and pid not in self.watches:
            self._look(pid, st, time.monotonic(), settled=True)

    def _hook_loader(self, pid: int) -> None:
        """Its loader's hook probed, so that a library it (or another process using the same
        loader) completes a list with later is seen at once. A loader still being read (in
        the parsing worker) is hooked at a later scan (loader_pending)."""
        try:
            self.discovery.hook_loader(pid)
        except NotReady:
            self.seen.loader_pending.add(pid)
            return
        except Exception as e:          # a tenant's loader file: whatever reading it raised
            self._error(f"PID {pid}: hooking its loader: {type(e).__name__}: {e}")
        self.seen.loader_pending.discard(pid)

    def _candidate(self, pid: int) -> None:
        """Held at the exec of an engine's executable: hook its loader (it is held again once
        its library list is complete); a static executable, whose libraries are all there,
        is looked at now."""
        if interpreter(pid) is None:
            self._libraries_loaded(pid)
            return
        try:
            self.discovery.hook_loader(pid)
        except NotReady:
            # its loader is being read (a new loader file, the worker busy): not held for it
            # (a tenant's slow file would hold it); looked at now, hooked at a later scan
            self.seen.loader_pending.add(pid)
            self._libraries_loaded(pid)
        except ProfinferError as e:     # no hook to wait for: look now
            self._error(f"PID {pid}: {e}")
            self._libraries_loaded(pid)

    def _libraries_loaded(self, pid: int) -> None:
        """Held at its loader's hook: once the library list is complete, watch what it maps."""
        if not self.discovery.settled(pid):
            return
        self._look_now(pid)
        self.discovery.release(pid, done=True)

    def _look_now(self, pid: int) -> None:
        """What it maps now, watched (a watched process: a runtime it loaded since)."""
        st = process_stat(pid)
        if st is not None and pid != self.own_pid:
            w = self.watches.get(pid)
            if w is None:
                self._look(pid, st, time.monotonic(), settled=True)
            elif self.cuda_pack is not None:
                self._look_runtime(pid, w, st)

    @_set_up
    def _watch(self, pid: int, start: int, pack: Pack, files: list[tuple[str, str]]) -> None:
        caps = capabilities(pack)
        if not caps & {"tokens_by_process", "steps_by_process"}:
            # an engine with no always-on level: found and listed, not probed
            ident = identify(pid, start, pack.engine)
            with self.lock:
                self.unwatched[(pid, start)] = ident
            self.log(f"PID {pid} ({ident.comm}) runs {pack.engine}: found, not watched (no "
                     "always-on level for this engine yet)")
            return
        if "steps_by_process" in caps:
            shared = {"step"}             # the token level of an engine that works in steps
        else:
            shared = {lv for lv in SHARED_LEVELS if lv in self.levels} or {"token"}
        group = None
        try:
            group = self._join_group(pack, pid, files, shared)
        except NotReady:
            return                          # a file still being read: the next scan tries again
        except Exception as e:              # ProfinferError, or a process vanishing mid-read
            self._attach_failed(pid, start, pack, e)
            return
        ident = identify(pid, start, pack.engine)
        w = Watch(ident, None, set(shared), time.time(), pack=pack, files=files, group=group,
                  model_checked=time.monotonic(), step_up_wait_s=STEP_UP_S, capabilities=caps)
        if "op" in self.levels and "op_totals" in caps:
            w.op_pending = not self._attach_op(w)
        w.pidfd = exit_fd(pid, start)
        with self.lock:
            self.watches[pid] = w
        self.seen.failed.pop((pid, start), None)
        self.metrics.watched(ident)
        self.metrics.level(ident, level_rank(w.levels))
        self.log(f"watching PID {pid} ({ident.comm}, {pack.engine}"
                 + (f", model {os.path.basename(ident.model)}" if ident.model else "")
                 + (f", container {ident.container}" if ident.container else "")
                 + (f", pod {ident.namespace}/{ident.pod}" if ident.pod_uid else "")
                 + f") at {','.join(sorted(w.levels))}"
                 + (f", {w.collector.n_probes} op-level probes of its own" if w.collector else ""))

    def _join_group(self, pack: Pack, pid: int, files: list[tuple[str, str]], shared: set[str]) -> SharedProbes:
        """The process added to its build's shared probes at these levels (opened if none yet)."""
        key = group_key(pack, files) + (frozenset(shared),)
        group = self.groups.get(key)
        if group is None:
            group = SharedProbes.open(key, pack, pid, files, shared)
            self.groups[key] = group
            self.log(f"{pack.engine}: {group.collector.n_probes} probes on "
                     + ", ".join(sorted(os.path.basename(h) for h, _ in files))
                     + f" at {','.join(sorted(shared))}, shared by every process that maps them")
        else:
            group.add(pid)
        return group

    def _regroup(self, w: Watch, shared: set[str]) -> bool:
        """The graph level taken from (or given back to) one process: it moves to its build's
        shared probes at `shared` levels (the old object goes with its last process, and with
        it the probes' traps). The new object follows it first; the calls that begin from
        then on are the new object's to count, those begun before the old one's, which lets
        the process go a scan later (a call in flight ends meanwhile): no decode call is
        lost or counted twice."""
        old, pid = w.group, w.identity.pid
        if any(p == pid for _, p, _ in self._leaving):
            return False                        # still leaving the last one: at a later judgment
        try:
            new = self._join_group(w.pack, pid, w.files, shared)
        except Exception as e:
            self._error(f"PID {pid}: moving to the shared probes at {','.join(sorted(shared))}: "
                        f"{type(e).__name__}: {e}")
            return False
        moved_at = time.monotonic_ns()          # BPF's clock (CLOCK_MONOTONIC)
        new.count_from[pid] = moved_at
        old.count_until[pid] = moved_at
        if "graph" in new.key[-1]:              # its graph counts begin again there
            self._group_totals(old)
            self.metrics.carry_graphs(w.identity)
        w.group = new
        self._leaving.append((old, pid, time.monotonic() + SCAN_S))
        w.levels = (w.levels - set(SHARED_LEVELS)) | shared
        return True

    def _let_go(self, now: float, pid_now: int | None = None) -> None:
        """The shared objects processes moved away from (a scan ago, or pid_now's at once):
        drained, their graph counts kept, then they let the processes go."""
        keep = []
        for group, pid, when in self._leaving:
            if now < when and pid != pid_now:
                keep.append((group, pid, when))
                continue
            self._drain_group(group)
            w = self.watches.get(pid)
            if "graph" in group.key[-1] and w is not None:    # the graph level was taken: its last counts
                self._group_totals(group)
                self.metrics.carry_graphs(w.identity)
            try:
                group.remove(pid)
            except Exception as e:
                self._error(f"PID {pid}: leaving its shared probes: {type(e).__name__}: {e}")
            if not group.pids and group.key in self.groups:
                self._close_group(group)
        self._leaving = keep

    @_set_up
    def _attach_op(self, w: Watch) -> bool:
        """The op level's probes, attached to this process alone (with the graph probes
        its ops are bounded by), its ops counted in BPF by type."""
        pid = w.identity.pid
        coll = None
        try:
            coll = w.pack.collector_class()(pid, {"op"}, w.pack, w.files, root=f"/proc/{pid}/root",
                                            ringbuf_pages=RING_PAGES, op_totals=True)
            coll.outside_account = False
            coll.attach()
        except Exception as e:
            if coll is not None:
                try:
                    coll.detach()
                except Exception:
                    pass
            if not isinstance(e, NotReady):       # else tried again at the next scan (op_pending)
                self._error(f"PID {pid}: the op level not attached: {e}")
                w.op_pending = False
            return False
        w.collector = coll
        w.levels = w.levels | {"op"}
        return True

    @_set_up
    def _detach_op(self, w: Watch) -> None:
        """Its op level drained, its programs' counts kept, then detached."""
        if w.collector is not None:
            self._drain(w)
            self._sample_programs(w)
        coll, w.collector = w.collector, None
        w.levels = w.levels - {"op"}
        if coll is None:
            return
        self._retire(w.programs)
        w.programs = {}
        try:
            coll.detach()
        except Exception as e:
            self._error(f"PID {w.identity.pid}: detaching its op level: {type(e).__name__}: {e}")

    def _retire(self, programs: dict[str, tuple[int, int]]) -> None:
        """What detached programs ran stays in the totals."""
        for prog, (ns, runs) in programs.items():
            a, b = self.retired_programs.get(prog, (0, 0))
            self.retired_programs[prog] = (a + ns, b + runs)

    @_set_up
    def _watch_runtime_only(self, pid: int, start: int) -> None:
        """A process that runs no known engine but a CUDA runtime: watched at the cuda level."""
        ident = identify(pid, start, self.cuda_pack.engine)
        w = Watch(ident, None, set(), time.time(), model_checked=time.monotonic(), pidfd=exit_fd(pid, start),
                  step_up_wait_s=STEP_UP_S)
        with self.lock:
            self.watches[pid] = w
        self.metrics.watched(ident)

    @_set_up
    def _watch_cuda(self, w: Watch, files: list[tuple[str, str]]) -> None:
        """The cuda level beside the process's engine: counted in BPF (no timeline), by the
        one object that serves every process with a runtime."""
        pid = w.identity.pid
        try:
            if self.runtime is None:
                self.runtime = SharedRuntime.open(self.cuda_pack, pid, files)
            else:
                self.runtime.add(pid, files)
        except Exception as e:
            if self.runtime is not None and not self.runtime.pids:
                self._close_runtime()
            if w.collector is None and w.group is None:     # nothing else watches it: forget it
                with self.lock:
                    self.watches.pop(pid, None)
                self.metrics.forget(w.identity)
                if w.pidfd >= 0:
                    os.close(w.pidfd)
                    w.pidfd = -1
            if isinstance(e, NotReady):     # a file still being read: looked at again later
                self.seen.cuda_checked.pop((pid, w.identity.start), None)
                return
            self._attach_failed(pid, w.identity.start, self.cuda_pack, e)
            return
        w.cuda = True
        w.levels = w.levels | {"cuda", "cuda-detail"}
        self.log(f"PID {pid} ({w.identity.comm}): cuda level, {self.runtime.collector.n_probes} probes "
                 f"on {', '.join(self.runtime.files())}, shared by {len(self.runtime.pids)} process(es)")

    def _close_runtime(self) -> None:
        rt, self.runtime = self.runtime, None
        try:
            rt.programs = dict(rt.collector.obj.program_stats())
        except Exception:
            pass
        self._retire(rt.programs)
        try:
            rt.close()
        except Exception as e:
            self._error(f"closing the cuda level: {type(e).__name__}: {e}")

    def _attach_failed(self, pid: int, start: int, pack: Pack, e: Exception) -> None:
        st = process_stat(pid)
        if st is None or st[0] != start:
            return                          # it exited meanwhile: nothing to report
        key = (pid, start)
        first = key not in self.seen.failed
        backoff = RETRY_FIRST_S if first else min(self.seen.failed[key][1] * 2, RETRY_MAX_S)
        self.seen.failed[key] = (time.monotonic() + backoff, backoff)
        if first:                           # counted and said once a process
            self.attach_errors += 1
            self.metrics.attach_errors.labels(engine=pack.engine).inc()
            self.log(f"PID {pid} ({pack.engine}): not watched: {e} (tried again, backing off)")

    @_set_up
    def _gone(self, w: Watch, why: str = "exited") -> None:
        """Detach at once (it exited, or why); the series stay for SERIES_TTL_S."""
        if any(pid == w.identity.pid for _, pid, _ in self._leaving):
            self._let_go(time.monotonic(), w.identity.pid)
        group = w.group
        if group is not None:
            self._drain_group(group)
            self._group_totals(group)
        self._detach_op(w)
        if w.cuda and self.runtime is not None:
            self._drain_runtime()
            try:
                self.runtime.remove(w.identity.pid)
            except Exception as e:
                self._error(f"PID {w.identity.pid}: leaving the cuda level: {type(e).__name__}: {e}")
            if not self.runtime.pids:
                self._close_runtime()
        if group is not None:
            try:
                group.remove(w.identity.pid)
            except Exception as e:
                self._error(f"PID {w.identity.pid}: leaving its shared probes: {type(e).__name__}: {e}")
            if not group.pids:
                self._close_group(group)
        w.exited_at = time.monotonic()
        w.group = None     # its buffers go now; the series stay (metrics)
        w.cuda = False
        w.tracker = SequenceTracker(keep=False)    # its sequences: nothing more will come
        if self.recorder is not None:
            self.recorder.forget(w.identity)
        for caches in process_caches():           # what was read through its /proc/PID/root
            caches.forget_process(w.identity.pid)
        if w.pidfd >= 0:
            os.close(w.pidfd)
            w.pidfd = -1
        with self.lock:
            self.watches.pop(w.identity.pid, None)
            self.exited.append(w)
        # at most max_processes exited ones' series wait for their TTL: the oldest go first
        while len(self.exited) > self.max_processes:
            self.metrics.forget(self.exited.pop(0).identity)
            self.metrics.series_dropped += 1
        if not self._full():
            self.seen.cap_said = False
        self.log(f"PID {w.identity.pid} ({w.identity.comm}) {why}: detached")

    def _close_group(self, group: SharedProbes) -> None:
        """Its last process has gone: its links, programs and maps go."""
        try:
            group.programs = dict(group.collector.obj.program_stats())
        except Exception:
            pass
        self._retire(group.programs)
        self.groups.pop(group.key, None)
        try:
            group.close()
        except Exception as e:
            self._error(f"closing shared probes: {type(e).__name__}: {e}")

    def expire(self) -> None:
        now = time.monotonic()
        keep = []
        for w in self.exited:
            if now - w.exited_at >= SERIES_TTL_S:
                self.metrics.forget(w.identity)
            else:
                keep.append(w)
        self.exited = keep

    # ---- collecting ----

    def _error(self, msg: str) -> None:
        self.loop_errors += 1
        self.log(msg)

    def _drain(self, w: Watch) -> None:
        """The process's own probes: its op level."""
        coll = w.collector
        if coll is None:
            return
        try:
            coll.poll(0)
            totals = coll.take_op_totals()
            if totals:
                self.metrics.op_totals(w.identity, totals)
            lost = coll.lost()
            if lost > w.lost_seen:
                self.metrics.lost(w.identity, lost - w.lost_seen)
                w.lost_seen = lost
        except Exception as e:             # this watch's trouble, not the loop's
            w.errors += 1
            if w.errors <= 3:
                self._error(f"PID {w.identity.pid}: {type(e).__name__}: {e}")

    def _drain_group(self, group: SharedProbes) -> None:
        """A build's shared probes: each decode call goes to the process that made it."""
        coll = group.collector
        try:
            coll.poll(0)
            steps = "steps_by_process" in group.capabilities
            taken = coll.take_steps_by_process() if steps else coll.take_tokens_by_process()
            for tgid, calls in taken.items():
                w = self.watches.get(tgid)
                if w is None or (w.group is not group and tgid not in group.count_until):
                    continue            # a process that left the map while its call was queued
                if tgid in group.count_from:      # moved here: what began before, the old object counts
                    calls = [t for t in calls if t.start_ns >= group.count_from[tgid]]
                if tgid in group.count_until:     # moving away: what began since, the new object counts
                    calls = [t for t in calls if t.start_ns < group.count_until[tgid]]
                group.token_calls[tgid] = group.token_calls.get(tgid, 0) + len(calls)
                w.callers.update(t.tid for t in calls)
                for t in calls:
                    if steps:
                        # a step is known by its first op's call alone: its time at the next
                        # step, and no sequence ids to follow (time to first token, per output token)
                        step = step_call(t)
                        self.metrics.decode_call(w.identity, step, [], [], timed=False)
                        self._step_time(w, step)
                    else:
                        ttfts, tpots = w.tracker.feed(t)
                        self.metrics.decode_call(w.identity, t, ttfts, tpots)
                        if self.recorder is not None:
                            self.recorder.observe(w.identity, t, ttfts, tpots)
            self._shared_lost(group, coll.lost())
        except Exception as e:
            group.errors += 1
            if group.errors <= 3:
                self._error(f"{group.key[0]} shared probes: {type(e).__name__}: {e}")

    def _step_time(self, w: Watch, step: TokenCall) -> None:
        """A step's time, from its start to the next step's, where the engine went straight on:
        the next one decodes a sequence (one already running: nothing idled between them)."""
        prev = w.last_step
        if prev is not None and step.start_ns <= prev.start_ns:     # out of order (a move): not a next step
            return
        w.last_step = step
        if prev is None or not step.decode_tokens:
            return
        timed = replace(prev, end_ns=step.start_ns)
        self.metrics.call_time(w.identity, timed)
        if self.recorder is not None:
            self.recorder.observe(w.identity, timed, [], [])

    def _drain_runtime(self) -> None:
        """The cuda level: BPF's counts (cumulative) and the calls sent since, by process."""
        rt = self.runtime
        if rt is None:
            return
        try:
            groups, calls = rt.collector.take()
        except Exception as e:
            rt.errors += 1
            if rt.errors <= 3:
                self._error(f"cuda level: {type(e).__name__}: {e}")
            return
        by_pid: dict[int, tuple[list, list]] = {pid: ([], []) for pid in rt.pids}
        for c in groups:
            if c.pid in by_pid:
                by_pid[c.pid][0].append(c)
        for c in calls:
            if c.pid in by_pid:
                by_pid[c.pid][1].append(c)
        for pid, (g, c) in by_pid.items():
            # its calls so far (each a probe hit at entry, some at return too): its share of the cost
            rt.count_calls(pid, sum(x.count for x in g) if groups else None, len(c))
            w = self.watches.get(pid)
            if w is not None and w.cuda:
                quantities = self.metrics.level_records(w.identity, "cuda", g, c)
                if self.recorder is not None and groups:
                    for quantity, (n, ns) in quantities.items():
                        self.recorder.observe_cumulative(w.identity, quantity, n, ns)
        self._shared_lost(rt, rt.collector.lost())

    def _shared_lost(self, shared: SharedProbes | SharedRuntime, lost: int) -> None:
        """A shared ring's losses cannot be told apart: each process it serves counts them."""
        if lost <= shared.lost_seen:
            return
        for pid in shared.pids:
            if pid in self.watches:
                self.metrics.lost(self.watches[pid].identity, lost - shared.lost_seen)
        shared.lost_seen = lost

    def _group_totals(self, group: SharedProbes) -> None:
        """The graph level, counted in BPF: its cumulative counts, by process and backend."""
        if "graph_totals" not in group.capabilities:
            return
        try:
            totals = group.collector.take_graph_totals()
        except Exception as e:
            group.errors += 1
            if group.errors <= 3:
                self._error(f"{group.key[0]} shared probes: graph totals: {type(e).__name__}: {e}")
            return
        for tgid, backends in totals.items():
            w = self.watches.get(tgid)
            if w is None or (w.group is not group and tgid not in group.count_until):
                continue
            group.graph_calls[tgid] = sum(v[0] for v in backends.values())
            self.metrics.graphs(w.identity, backends)

    def _sample_programs(self, w: Watch) -> None:
        """The process's own op-level programs' kernel counts (the shared objects' are sampled
        apart)."""
        obj = getattr(w.collector, "obj", None)
        if obj is None:
            w.programs = {}
            return
        try:
            w.programs = dict(obj.program_stats())
        except Exception:
            pass

    def poll(self, timeout_s: float) -> None:
        """Wait for events (up to timeout_s), drain every watch, scan when due."""
        self.last_loop = time.monotonic()
        self.governor.loop_tid = threading.get_native_id()
        with self.lock:
            watches = list(self.watches.values())
        groups = list(self.groups.values())
        poller = select.poll()          # no FD_SETSIZE limit
        shared = [g.collector for g in groups] + ([self.runtime.collector] if self.runtime else [])
        for coll in shared + [w.collector for w in watches]:
            try:
                poller.register(coll.fileno(), select.POLLIN)
            except Exception:
                pass
        exits = {w.pidfd: w for w in watches if w.pidfd >= 0}
        for fd in exits:
            poller.register(fd, select.POLLIN)
        if self.discovery is not None:
            poller.register(self.discovery.fileno(), select.POLLIN)
        ready = poller.poll(timeout_s * 1000)
        parsing.pump()                      # readings finished meanwhile, the next one started
        if self.discovery is not None:      # a held process waits on this: first
            self._discovered()
        for g in groups:
            self._drain_group(g)
        self._drain_runtime()
        for w in watches:
            self._drain(w)
        for fd, _ in ready:                 # exited: detached now, not at the next scan
            w = exits.get(fd)
            if w is not None and self.watches.get(w.identity.pid) is w:
                self._gone(w)
        if self._leaving:
            self._let_go(time.monotonic())
        if self.recorder is not None:
            try:
                self.recorder.judge()
            except Exception as e:          # the recorder's trouble, not the loop's
                self._error(f"flight recorder: {type(e).__name__}: {e}")
        if time.monotonic() - self._last_scan >= SCAN_S:
            self._last_scan = time.monotonic()
            self.scan()
            self.expire()
            for g in list(self.groups.values()) + ([self.runtime] if self.runtime else []):
                if isinstance(g, SharedProbes):
                    self._group_totals(g)
                try:
                    g.programs = dict(g.collector.obj.program_stats())
                except Exception:
                    pass
            for w in list(self.watches.values()):
                self._sample_programs(w)
            self.metrics.self_metrics(self)
        if self.governor.due():
            self.governor.govern(list(self.groups.values()), self.runtime, list(self.watches.values()),
                                 self.levels)

    # ---- the overhead budget (governor.py judges; this changes the levels) ----

    @_set_up
    def _relevel(self, w: Watch, levels: set[str], why: str) -> bool:
        """Take away or give back one level of the process: its op level (its own probes), the
        cuda level's per-call detail (a flag in the cuda object's map), or the graph level (it
        moves to its build's shared probes without it). The floor (token or step, the cuda
        level's counts by function) stays: it is never left unprofiled."""
        pid, old = w.identity.pid, set(w.levels)
        changed = (levels - w.levels) | (w.levels - levels)
        if changed == {"op"}:
            if "op" in levels and not self._attach_op(w):
                return False
            if "op" not in levels:
                self._detach_op(w)
        elif changed == {"cuda-detail"} and w.cuda and self.runtime is not None:
            try:
                self.runtime.detail(pid, "cuda-detail" in levels)
            except OSError as e:
                self._error(f"PID {pid}: the cuda level's detail: {e}")
                return False
            w.levels = set(levels)
        elif changed == {"graph"} and w.group is not None:
            shared = (w.levels & set(SHARED_LEVELS)) ^ {"graph"}
            if not self._regroup(w, shared):
                return False
        else:
            return False
        w.cost_mark, w.share = None, None       # judged afresh at its new levels (shares: the last judgment's)
        self.metrics.level(w.identity, level_rank(w.levels), changed=True)
        self.log(f"PID {pid}: levels {','.join(sorted(old))} -> {','.join(sorted(w.levels))} ({why})")
        return True

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

    @property
    def cuda_pack(self) -> Pack | None:
        """The cuda level's pack, where the daemon has that level (the last of all_packs)."""
        return next((p for p in self.all_packs if p.level == "cuda"), None)

    def status(self) -> dict:
        with self.lock:
            watches = list(self.watches.values())
            unwatched = list(self.unwatched.values())
        discovery = self.discovery       # the loop may close it meanwhile
        return {
            "pid": self.own_pid, "started": self.started, "levels": sorted(self.levels),
            "budget": self.governor.budget, "attach_errors": self.attach_errors, "loop_errors": self.loop_errors, "otlp_event_errors": self.metrics.otlp_event_errors,
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
                              for g in list(self.groups.values())]
            + ([{"engine": "CUDA", "files": self.runtime.files(), "probes": self.runtime.collector.n_probes,
                 "probes_stepped": self.runtime.collector.probes_stepped,
                 "processes": sorted(self.runtime.pids)}] if self.runtime else []),
            "found_not_watched": [{**i.as_dict(), "why": "no always-on level for this engine yet"}
                                  for i in unwatched],
            "gpu": self.metrics.gpu_state,
            "limits": {"max_processes": self.max_processes, "max_per_tenant": self.seen.tenants.limit,
                       "processes_dropped": self.metrics.processes_dropped,
                       "dropped_by_tenant": dict(self.seen.tenants.left_out),
                       "series_dropped": self.metrics.series_dropped,
                       "left_out_now": len(self.seen.over_cap)},
            "caches": {**{k: v for m in process_caches() for k, v in m.cache_sizes().items()},
                       "process_series": len(self.metrics.processes),
                       "sequences": sum(len(w.tracker.current) for w in watches + list(self.exited))},
            "discovery": ({"loaders_hooked": len(discovery.loaders), "holds": discovery.holds,
                           "held": discovery.held_now(), "hold_deadline_s": discovery.deadline_s,
                           "ended_by_deadline": discovery.deadline_ended()}
                          if discovery is not None else {"off": self.discovery_off}),
            **({"flight_recorder": self.recorder.status()} if self.recorder is not None else {}),
            "parse_worker": parsing.status(),
        }

    def release_held(self) -> None:
        """Discovery closed: nothing is held from then on, and every held process continued."""
        if self.discovery is not None:
            try:
                self.discovery.close()
            except Exception as e:
                self._error(f"closing discovery: {type(e).__name__}: {e}")
            self.discovery = None

    def close(self) -> None:
        self.release_held()
        parsing.stop()
        parsing.set_tenant_resolver(None)
        with self.lock:
            watches = list(self.watches.values())
            self.watches.clear()
        for w in watches:
            try:
                if w.collector is not None:
                    w.collector.detach()
            except Exception:
                pass
            if w.pidfd >= 0:
                os.close(w.pidfd)
        if self.runtime is not None:
            try:
                self.runtime.close()
            except Exception:
                pass
            self.runtime = None
        for g in list(self.groups.values()):
            try:
                g.close()
            except Exception:
                pass
        self.groups.clear()
        self.governor.close()

