"""One profiling session: attach, poll until told to stop, always detach, return the Profile.

Stops on --duration, SIGINT, SIGTERM, or the target's exit. Detaching happens in a finally
block, and libbpf creates uprobes through the perf uprobe PMU, so even a SIGKILL of profinfer
leaves nothing behind: the kernel drops the probes with our file descriptors.
"""
from __future__ import annotations

import os
import resource
import select
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable

import psutil

from profinfer.core.target import process, procfs
from profinfer.core.ebpf import kernel, layout, libbpf
from profinfer.core.base import registry
from profinfer.core.calibration.cputime import CpuShares, cpu_s, own_cpu_s, rss_kb
from profinfer.core.plugin.collector import Collector
from profinfer.core.plugin.group import CollectorGroup
from profinfer.core.base.errors import ProfinferError
from profinfer.core.follow import Change, Follower
from profinfer.core.profile.model import Profile
from profinfer.core.plugin.packfinder import engine_process, find_engine, find_packs, stripped_note
from profinfer.core.plugin.packs import RUNTIME_LEVELS, Pack, load_pack, pack_names

# The collector sleeps this long between drains unless BPF wakes it (the ring buffer past
# its wakeup level; perf buffers every PERF_WAKEUP_EVENTS records) or a signal stops it:
# each drain costs CPU taken from a target whose threads fill the machine
# (bench/results.md has what each rate costs).
POLL_MS = 1000
# Until the target decodes (a model still loading), drains are this frequent, so that its
# CPU time is counted from its first llama_decode to within one of them.
POLL_BEFORE_DECODING_MS = 20
THREAD_CPU_MIN_S = 0.02   # threads that used less while probed are left out of the record
THREADS_SAMPLE_S = 0.9    # each thread's CPU read this often (a thread that ends keeps its last)
REFRESH_S = 5.0     # thread names and mappings are read again this often (and at the end)


def _watch_tree(pid: int, buffer: str, warn: Callable[[str], None]) -> Follower | None:
    """attach with a runtime level: follow the process and its descendants, so that a
    runtime any of them loads from now on (PyTorch dlopens libcudart, which dlopens libcuda
    at its first call) is probed before its first call, as for record: each loader's hook
    stops the process while its new libraries are probed. None (said) when that cannot be set
    up: the level then covers what is loaded now."""
    try:
        follower = Follower(pid, kernel.event_buffer_kind(buffer), warn)
    except ProfinferError as e:
        warn(f"libraries loaded from now on will not be probed: {e}")
        return None
    try:
        tree = [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        tree = []
    for p in [pid] + tree:
        try:
            if p != pid:
                follower.add(p)
            follower.loaders.watch(p)
        except (OSError, ProfinferError) as e:
            if process.process_exists(p):
                warn(f"PID {p}: libraries it loads from now on will not be probed: {e}")
    return follower


def shared_open_spans() -> int:
    """The per-thread open-span map (bpf/transport.h), made before any object that uses it:
    the engine's and the levels' objects load with it."""
    span = layout.parse(header="transport.h")[1]["pi_open_span"]
    return libbpf.create_map(libbpf.BPF_MAP_TYPE_LRU_HASH, "open_spans", 4, span.itemsize, 4096)


def _alive(pid: int, child_status: list[int] | None, child_cpu: list[float]) -> bool:
    if child_status is not None:
        if child_status:
            return False
        try:
            done, status, usage = os.wait4(pid, os.WNOHANG)
        except ChildProcessError:
            return False
        if done:
            child_status.append(os.waitstatus_to_exitcode(status))
            child_cpu.append(usage.ru_utime + usage.ru_stime)
        return done == 0
    fields = procfs.stat_fields(pid)
    return bool(fields) and fields[0] not in ("Z", "X")


class StatusLine:
    """A live one-line status on stderr (only on a terminal)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.t0 = time.monotonic()
        self.last = 0.0
        self.last_tokens = 0
        self.rate = 0.0

    def update(self, coll: Collector, force: bool = False) -> None:
        now = time.monotonic()
        if not self.enabled or (now - self.last < 0.5 and not force):
            return
        if now - self.last >= 0.5:
            # Current decode rate: tokens since the previous update, not since attach.
            self.rate = (coll.n_decode_tokens - self.last_tokens) / (now - self.last) if self.last else 0.0
            self.last, self.last_tokens = now, coll.n_decode_tokens
        el = now - self.t0
        sys.stderr.write(f"\rprofinfer: {el:6.1f} s | {self.rate:7.2f} tok/s | "
                         f"{coll.n_events:>10,} events | {coll.lost():,} lost ")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")


@dataclass(frozen=True)
class SessionOptions:
    """What to probe and for how long (profile_process's arguments, less the target's)."""
    levels: set[str]
    duration: float | None = None
    tensor_layout: str | None = None
    buffer: str = "auto"
    counters: list[str] | None = None
    status: bool | None = None           # the live status line (None: on a terminal)
    follow: bool = False                 # the target is our child, held before its exec
    extra_packs: tuple[str, ...] = ()    # pack files tried before the bundled ones
    # False: a level counts calls in BPF instead, and an engine that can counts its ops per
    # type and phase (its plugin's capability "op_totals")
    timeline: bool = True


def counts_ops(pack: Pack) -> bool:
    """The pack's engine can count its ops in BPF per op type and phase instead of sending
    each (its collector's op_totals)."""
    plugin = registry.plugin_of_pack(pack)
    return plugin is not None and plugin.can("op_totals")


def _quiet(_msg: str) -> None:
    pass


class Session:
    """Profile `pid` until stopped (see profile_process): finds the engine and the runtime
    levels beside it, attaches their collectors (or follows a held child until it maps one),
    drains them, counts the CPU time their cost is judged against, and builds the Profile."""

    def __init__(self, pid: int, options: SessionOptions, child_status: list[int] | None = None,
                 on_attached: Callable[[], None] | None = None,
                 warn: Callable[[str], None] = _quiet, note: Callable[[str], None] = _quiet):
        self.pid = pid
        self.opts = options
        self.child_status = child_status        # our child: its exit code is appended there
        self.on_attached = on_attached
        self.warn, self.note = warn, note
        self.packs: list[Pack] = []             # the engines' (none when only runtime levels)
        self.level_packs: list[Pack] = []       # the runtime levels asked for
        self.pack: Pack | None = None           # the engine's (or the level's) being profiled
        self.engine_pid = pid                   # where it runs
        self.executables_seen: dict[tuple, bool] = {}   # follow: does it define the marker
        self.follower: Follower | None = None
        self.coll: CollectorGroup | None = None
        self.open_spans_fd: int | None = None
        self.exit_fd = -1                       # readable once the target exits: no wait past it
        self.stop_reason: list[str] = []
        self.line: StatusLine | None = None
        self.cpu: CpuShares | None = None

    # ---- setting up ----

    def _load_packs(self) -> None:
        levels = self.opts.levels
        all_packs = [load_pack(name) for name in (*self.opts.extra_packs, *pack_names())]
        self.level_packs = [p for p in all_packs if p.level and p.level in levels]
        # engines, unless only runtime levels are asked for (cuda alone: no engine's probes)
        self.packs = [p for p in all_packs if not p.level] if levels - set(RUNTIME_LEVELS) else []
        self.pack = (self.packs or self.level_packs)[0]

    def _make(self, p: Pack, where: int, files: list[tuple[str, str]]) -> Collector:
        extra: dict = {}
        if self.follower is not None and (self.opts.follow or p.level):   # attach: the engine keeps its own
            extra["followed_map_fd"] = self.follower.followed_map_fd()
        if self.open_spans_fd is not None:
            extra["open_spans_fd"] = self.open_spans_fd
        if p.level:
            extra["timeline"] = self.opts.timeline
        elif not self.opts.timeline and counts_ops(p):
            extra["op_totals"] = True
        return p.collector_class()(where, self.opts.levels, p, files, root=f"/proc/{where}/root",
                                   tensor_layout=self.opts.tensor_layout, buffer=self.opts.buffer,
                                   counters=self.opts.counters, **extra)

    def _find_running(self) -> None:
        """attach: the engine in the process (or a descendant), and the levels' runtimes
        beside it; their collectors made, not attached yet."""
        try:
            pack, self.engine_pid, files = engine_process(self.packs or self.level_packs, self.pid)
        except ProfinferError:
            if not self.level_packs or not self.packs:
                raise
            pack, self.engine_pid, files = engine_process(self.level_packs, self.pid)  # a plain CUDA program
        self.pack = pack
        if self.engine_pid != self.pid:
            self.note(f"PID {self.pid} runs no engine; its descendant PID {self.engine_pid} runs {pack.engine}")
        if self.level_packs:
            self.follower = _watch_tree(self.pid, self.opts.buffer, self.warn)
        self.coll = CollectorGroup(self._make(pack, self.engine_pid, files))
        for lp in self.level_packs:
            if lp is pack:
                continue
            found = find_engine([lp], self.engine_pid, True, self.executables_seen)
            if found:
                self.coll.add(self._make(lp, self.engine_pid, found[1]))
            else:
                self.note(f"PID {self.engine_pid} maps no {lp.engine} runtime ({', '.join(lp.libraries)}) "
                          f"yet: the {lp.level} level starts when it loads one")

    def _attached(self, c: Collector, where: int) -> None:
        for w in c.warnings:
            self.warn(w)
        levels = self.opts.levels
        what = f"levels {','.join(sorted(levels))}" if not c.pack.level else f"{c.pack.level} level"
        self.note(f"attached {c.n_probes} probes to PID {where} in {c.attach_s:.2f} s ({what})")
        c.refresh_process_info()

    def _engine_appeared(self, tgid: int, found_pack: Pack, libs: list[tuple[str, str]]) -> None:
        """A followed process maps an engine's or a level's files: probed before it runs on."""
        coll = self.coll
        present = coll.member(found_pack) if coll is not None else None
        engine_present = coll is not None and not coll.engine.pack.level
        if present is not None:
            for why in present.attach_files(libs, tgid) if found_pack.level else present.attach_files(libs):
                self.warn(f"PID {tgid}: {why}: not profiled")
        elif not found_pack.level and engine_present:
            self.warn(f"PID {tgid}: {found_pack.engine} too: only {self.pack.engine} "
                      f"in PID {self.engine_pid} is profiled")
        else:
            new = self._make(found_pack, tgid, libs)
            new.attach()
            if coll is None:
                self.coll = CollectorGroup(new)
            else:
                coll.add(new, engine=not found_pack.level)
            if not found_pack.level or not engine_present:
                self.engine_pid, self.pack = tgid, found_pack
            self._attached(new, tgid)

    def _attach_running(self) -> None:
        """attach: the collectors' probes in; with a level, the rest of the tree (vLLM's
        workers): the level's probes sit on files and run for the followed processes; each
        one's runtime code and names are read."""
        for m in self.coll.members:
            m.attach()
        for m in self.coll.members:
            self._attached(m, self.engine_pid)
        if self.follower is None:
            return
        for child in sorted(self.follower.processes - {self.engine_pid}):
            try:
                for found in find_packs(self.level_packs, child, True, self.executables_seen):
                    self._engine_appeared(child, *found)
            except (OSError, ProfinferError) as e:
                if process.process_exists(child):
                    self.warn(f"PID {child}: {e}")

    def _start_following(self) -> None:
        self.follower = Follower(self.pid, kernel.event_buffer_kind(self.opts.buffer), self.warn)
        self.note(f"following PID {self.pid} and what it starts (exec, fork, dlopen)"
                  + ("" if self.follower.forks_followed else
                     "; forked processes are not followed: this kernel has no BTF"))

    # ---- collecting ----

    def _wait(self, wait_ms: int) -> None:
        """Drain the collectors (waiting up to wait_ms for their buffers), and attach to what
        the followed processes changed into."""
        if self.follower is None and self.exit_fd < 0:
            self.coll.poll(wait_ms)
            return
        # a stopped process waits for the follower's records: wait on both buffers, and the exit
        fds = ([self.follower.fileno()] if self.follower else []) + (self.coll.filenos() if self.coll else [])
        select.select(fds + ([self.exit_fd] if self.exit_fd >= 0 else []), [], [], wait_ms / 1000)
        if self.follower is not None:
            for change in self.follower.changes():
                if change.what in ("exec", "mapped"):
                    self._on_change(change)
        if self.coll is not None:
            self.coll.poll(0)

    def _on_change(self, change: Change) -> None:
        """A followed process stopped at an exec or at its loader's hook: what it maps now
        is probed, then it is resumed (whatever happens here)."""
        tgid = change.tgid
        try:
            if change.what == "exec":
                self.follower.loaders.watch(tgid)
            elif not self.follower.loaders.settled(tgid):
                return              # its loader stops it again when done
            if not self.opts.follow:        # attach: only a level's runtime can appear
                engines = []
            elif self.coll is not None and not self.coll.engine.pack.level:
                engines = [self.pack]
            else:
                engines = self.packs
            for found in find_packs(engines + self.level_packs, tgid, change.what == "exec",
                                    self.executables_seen):
                self._engine_appeared(tgid, *found)
        except ProfinferError as e:
            if self.coll is None:
                raise
            self.warn(f"PID {tgid}: {e}")
        finally:
            self.follower.resume(tgid)

    def _count_cpu(self) -> None:
        cpu, coll = self.cpu, self.coll
        if coll is not None and not cpu.from_work and coll.started:
            cpu.work_began(self.engine_pid)
        if self.opts.follow and self.engine_pid != self.pid:       # its CPU time, before it is reaped
            cpu.target_last = cpu_s(self.engine_pid) or cpu.target_last
        if cpu.from_work:
            cpu.others.sample(coll.other_target_processes())
            if time.monotonic() - cpu.threads_at >= THREADS_SAMPLE_S:
                self._sample_threads()

    def _sample_threads(self) -> None:
        self.cpu.threads.sample([self.engine_pid, *self.coll.other_target_processes()])
        self.cpu.threads_at = time.monotonic()

    def _collect(self) -> None:
        """Drain until --duration, a signal or the target's exit."""
        duration = self.opts.duration
        deadline = time.monotonic() + duration if duration else None
        last_refresh = 0.0
        while not self.stop_reason:
            wait_ms = POLL_MS if self.cpu.from_work else POLL_BEFORE_DECODING_MS
            if deadline:
                wait_ms = max(0, min(wait_ms, int((deadline - time.monotonic()) * 1000) + 1))
            self._wait(wait_ms)
            self._count_cpu()
            now = time.monotonic()
            if self.coll is not None and now - last_refresh > REFRESH_S:
                self.coll.refresh_process_info()
                last_refresh = now
            if self.coll is not None:
                self.line.update(self.coll)
            if deadline and now >= deadline:
                self.stop_reason.append("duration")
            elif not _alive(self.pid, self.child_status, self.cpu.child_cpu):
                self.stop_reason.append("target exited"
                                        + (f" ({self.child_status[0]})" if self.child_status else ""))

    # ---- the end ----

    def _nothing_found(self) -> ProfinferError:
        return ProfinferError(f"no known engine in process {self.pid} or the processes it started "
                              f"({len(self.follower.processes)} followed; none mapped "
                              + "; ".join(f"{p.engine}: {', '.join(p.libraries)}"
                                          + (f" or defined {p.marker}" if p.marker else "")
                                          for p in self.packs or self.level_packs) + ")"
                              + stripped_note(self.executables_seen))

    def _finish(self) -> Profile:
        coll = self.coll
        if coll is None:
            raise self._nothing_found()
        self.line.update(coll, force=True)
        coll.refresh_process_info()
        collecting_rss_kb = rss_kb()
        own_cpu = own_cpu_s()
        target_cpu = self.cpu.target(self.engine_pid, coll.other_target_processes)
        if self.cpu.from_work:
            self._sample_threads()
        warned = len(coll.warnings)
        profile = coll.finish()
        for w in coll.warnings[warned:]:        # what only the end of collection shows
            self.warn(w)
        meta = profile.meta
        if self.follower is not None:
            meta["processes_followed"] = str(len(self.follower.processes))
        meta["stopped_by"] = self.stop_reason[0] if self.stop_reason else ""
        meta["events"] = str(coll.n_events)
        meta["wall_s"] = f"{time.monotonic() - self.line.t0:.3f}"
        # The collector's own memory, not the target's: the peak (ru_maxrss, KiB, includes
        # BCC's compile) and the resident size while collecting ended.
        meta["collector_max_rss_kb"] = str(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
        meta["collector_rss_kb"] = str(collecting_rss_kb)
        # CPU the collector itself used while the target ran (on a small machine it is taken
        # from the inference threads): the part of the overhead that is ours, not the probes'.
        meta["collector_cpu_s"] = f"{own_cpu - self.cpu.own_at_attach:.3f}"
        meta["collector_cpu_decoding_s"] = f"{own_cpu - self.cpu.own_from:.3f}"
        if target_cpu is not None:
            meta["target_cpu_s"] = f"{target_cpu:.3f}"
        others = self.cpu.others_cpus(own_cpu, target_cpu)
        if others is not None:
            meta["others_cpus"] = f"{others:.2f}"
        threads = self.cpu.threads.used_s(THREAD_CPU_MIN_S)
        if threads:
            # the probes' cost is judged against the time of the threads that took them
            meta["threads_cpu_s"] = " ".join(f"{t}:{v:.2f}" for t, v in sorted(threads.items()))
            waited = self.cpu.threads.waited_s(threads)
            meta["threads_waited_s"] = " ".join(f"{t}:{v:.3f}" for t, v in sorted(waited.items()))
        return profile

    def _release(self) -> None:
        """The follower and the shared open-span map, closed."""
        if self.follower is not None:
            self.follower.close()
        if self.open_spans_fd is not None:
            os.close(self.open_spans_fd)
        if self.exit_fd >= 0:
            os.close(self.exit_fd)
            self.exit_fd = -1

    def run(self) -> Profile:
        kernel.require_root()
        if self.child_status is None and not process.process_exists(self.pid):
            raise ProfinferError(f"no process with PID {self.pid}")
        self._load_packs()
        st = procfs.process_stat(self.pid)      # None: gone already, seen at the first turn
        self.exit_fd = procfs.exit_fd(self.pid, st[0]) if st else -1
        self.open_spans_fd = shared_open_spans() if self.level_packs else None
        if not self.opts.follow:
            try:
                self._find_running()
            except BaseException:
                self._release()
                raise

        def on_signal(signum, _frame):
            self.stop_reason.append(signal.Signals(signum).name)

        # only the main thread may set handlers (the daemon captures in its HTTP threads, where
        # --duration ends the session)
        in_main = threading.current_thread() is threading.main_thread()
        old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)} if in_main else {}
        status = self.opts.status
        self.line = StatusLine(sys.stderr.isatty() if status is None else status)
        try:
            if not self.opts.follow:
                self._attach_running()
            else:
                self._start_following()
            self.cpu = CpuShares(self.pid)
            if self.on_attached:
                self.on_attached()
            self._collect()
            return self._finish()
        finally:
            self.line.close()
            if self.coll is not None:
                self.coll.detach()
            self._release()
            for s, h in old.items():
                signal.signal(s, h)


def profile_process(pid: int, levels: set[str], duration: float | None = None,
                    child_status: list[int] | None = None,
                    on_attached: Callable[[], None] | None = None,
                    tensor_layout: str | None = None, buffer: str = "auto",
                    counters: list[str] | None = None, status: bool | None = None,
                    follow: bool = False, extra_packs: tuple[str, ...] = (),
                    timeline: bool = True,
                    warn: Callable[[str], None] = lambda m: None,
                    note: Callable[[str], None] = lambda m: None) -> Profile:
    """Profile `pid` until stopped. With child_status (a list), pid is our child: its exit
    code is appended there when it ends.

    With follow, pid is our child, stopped before it runs its command (on_attached lets it
    go): the images it exec's, the processes it forks and the libraries their loaders map
    are followed (profinfer.core.follow), and the engine is probed in whichever of them maps it,
    before its first call.

    A runtime level asked for (cuda) is probed beside the engine, in the engine's process
    (and, followed, in every process that maps its runtime); a process that runs no known
    engine but that runtime is profiled at that level alone. extra_packs: pack files tried
    before the bundled ones. timeline: False lets a level count calls in BPF instead of
    sending each, and an engine that can count its ops per type and phase.

    The Profile holds no calibration: the caller stamps it (recorded_calibration.stamp)."""
    options = SessionOptions(levels, duration, tensor_layout, buffer, counters, status, follow,
                             tuple(extra_packs), timeline)
    return Session(pid, options, child_status, on_attached, warn, note).run()
