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
from typing import Callable, Protocol

import psutil

from profinfer.core import discovery, kernel, layout, libbpf
from profinfer.core.errors import ProfinferError
from profinfer.core.follow import Follower
from profinfer.core.model import Profile
from profinfer.core.packs import RUNTIME_LEVELS, Pack, is_engine_library, load_pack, pack_names
from profinfer.core.symbols import load_elf

# The collector sleeps this long between drains unless BPF wakes it (the ring buffer past
# its wakeup level; perf buffers every PERF_WAKEUP_EVENTS records) or a signal stops it:
# each drain costs CPU that, on a machine the inference threads fill, is taken from them
# (at 4 drains a second, 0.09% of the target's CPU on the 1.5B model; at 1, ~0.03%).
POLL_MS = 1000
# Until the target decodes (a model still loading), drains are this frequent, so that its
# CPU time is counted from its first llama_decode to within one of them.
POLL_BEFORE_DECODING_MS = 20
REFRESH_S = 5.0     # thread names and mappings are read again this often (and at the end)


class EngineCollector(Protocol):
    """What the session drives, for every engine: an engine's decoder (probes/<engine>.toml
    names its class) attaches to a process, collects, and builds the Profile."""
    pid: int
    warnings: list[str]
    n_probes: int
    attach_s: float
    n_events: int
    n_decode_tokens: int
    decoding: bool          # the engine has started its work (the cost is counted from here)

    def attach(self) -> None: ...
    def attach_files(self, lib_paths: list[tuple[str, str]]) -> list[str]: ...
    def fileno(self) -> int: ...
    def poll(self, timeout_ms: int = 100) -> None: ...
    def refresh_process_info(self) -> None: ...
    def other_target_processes(self) -> list[int]: ...
    def lost(self) -> int: ...
    def finish(self) -> Profile: ...
    def detach(self) -> None: ...


class CollectorGroup:
    """An engine's collector and the runtime levels beside it (cuda), driven as one: each
    has its own event buffer; the engine's programs keep each thread's open spans in a map
    the levels share, so a CUDA call carries the step and op it was made in."""

    def __init__(self, first: EngineCollector):
        self.members: list[EngineCollector] = [first]

    @property
    def engine(self) -> EngineCollector:
        return self.members[0]

    def add(self, member: EngineCollector, engine: bool = False) -> None:
        """A level beside the engine; or the engine, when a level was found first."""
        if engine:
            self.members.insert(0, member)
        else:
            self.members.append(member)

    def member(self, pack: Pack) -> EngineCollector | None:
        return next((m for m in self.members if m.pack is pack), None)

    def __getattr__(self, name):            # pid, attach_s, n_probes, ...: the engine's
        return getattr(self.members[0], name)

    @property
    def warnings(self) -> list[str]:
        return [w for m in self.members for w in m.warnings]

    @property
    def n_events(self) -> int:
        return sum(m.n_events for m in self.members)

    @property
    def decoding(self) -> bool:
        return any(m.decoding for m in self.members)

    @property
    def started(self) -> bool:
        """The engine's work began (the CPU shares count from here): its own first event, not
        a level's (a CUDA runtime registers kernels and allocates while a model loads)."""
        engine = self.members[0]
        if not engine.pack.level:
            return engine.decoding or bool(engine.n_events)
        return self.decoding or bool(self.n_events)

    def fileno(self) -> int:
        return self.members[0].fileno()

    def filenos(self) -> list[int]:
        return [m.fileno() for m in self.members]

    def poll(self, timeout_ms: int = 100) -> None:
        if len(self.members) > 1 and timeout_ms:
            select.select(self.filenos(), [], [], timeout_ms / 1000)
            timeout_ms = 0
        for m in self.members:
            m.poll(timeout_ms)

    def refresh_process_info(self) -> None:
        for m in self.members:
            m.refresh_process_info()

    def other_target_processes(self) -> list[int]:
        return sorted({p for m in self.members for p in m.other_target_processes()}
                      - {self.members[0].pid})

    def lost(self) -> int:
        return sum(m.lost() for m in self.members)

    def finish(self) -> Profile:
        """The engine's profile with the levels' calls in it, each call's op named by the
        engine that opened it."""
        engine = self.members[0]
        levels = self.members[1:]
        if hasattr(engine, "op_name"):
            for m in levels:
                m.op_name = lambda _engine, index, e=engine: e.op_name(index)
        level_profiles = [m.finish() for m in levels]
        prof = engine.finish()
        for lp in level_profiles:
            prof.cuda_calls.extend(lp.cuda_calls)
            prof.lost_events += lp.lost_events
            prof.meta.update((k, v) for k, v in lp.meta.items() if k not in prof.meta)
            for tid, name in lp.thread_names.items():
                prof.thread_names.setdefault(tid, name)
        return prof

    def detach(self) -> None:
        for m in self.members:
            m.detach()


def _watch_tree(pid: int, buffer: str, warn: Callable[[str], None]) -> Follower | None:
    """attach with a runtime level: follow the process and its descendants, so that a
    runtime any of them loads from now on (PyTorch dlopens libcudart, which dlopens libcuda
    at its first call) is probed before its first call, as for record: each loader's hook
    stops the process while its new libraries are probed. None (said) when that cannot be set
    up: the level then covers what is loaded now."""
    try:
        follower = Follower(pid, kernel.event_buffer_kind(buffer))
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
            if discovery.process_exists(p):
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
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def _cpu_s(pid: int) -> float | None:
    """CPU time (user + system, all threads) `pid` has used so far."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


class ProcessesCpu:
    """CPU time a changing set of processes used from when each was first sampled to its
    last sample (one that exited keeps its last)."""

    def __init__(self):
        self.first: dict[int, float] = {}
        self.last: dict[int, float] = {}

    def sample(self, pids) -> None:
        for p in pids:
            v = _cpu_s(p)
            if v is not None:
                self.first.setdefault(p, v)
                self.last[p] = v

    def used(self) -> float:
        return sum(self.last[p] - self.first[p] for p in self.last)


def _own_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _rss_kb() -> int:
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmRSS:"))


def engine_files(pack: Pack, pid: int, files: list, new_image: bool,
                 executables_seen: dict[tuple, bool]) -> list[tuple[str, str]]:
    """The engine's files among those `pid` maps (`files`), as (path to open, path in the
    target): its libraries by name, or, for a new image without them, the executable if it
    defines the marker (a statically linked engine). executables_seen remembers that per file
    and marker, so that a script that runs the same commands again does not have each one's
    symbols read again."""
    libs = [(m.host_path, m.path) for m in files if is_engine_library(pack, m.path)]
    if libs or not new_image or not pack.marker:
        return libs
    try:
        exe = os.readlink(f"/proc/{pid}/exe").removesuffix(" (deleted)")
    except OSError:
        return []
    main = next((m for m in files if m.path == exe), None)
    if main is None:
        return []
    try:
        key = (discovery.file_key(main.host_path), pack.marker)
    except OSError:
        return []
    if key not in executables_seen:
        elf = load_elf(main.host_path, f"/proc/{pid}/root")
        executables_seen[key] = bool(elf.find(pack.marker))
        if not elf.has_symtab:
            executables_seen[("stripped", main.path)] = False
    return [(main.host_path, main.path)] if executables_seen[key] else []


def _stripped_note(executables_seen: dict[tuple, bool]) -> str:
    """What to add to "no engine found" when an executable looked at had no .symtab."""
    paths = sorted(k[1] for k in executables_seen if k[0] == "stripped")
    if not paths:
        return ""
    return (f"; stripped (no .symtab): {', '.join(paths)}: an engine or runtime linked into it "
            "statically has no symbols to find it by")


def find_engine(packs: list[Pack], pid: int, new_image: bool,
                executables_seen: dict[tuple, bool]) -> tuple[Pack, list[tuple[str, str]]] | None:
    """The first pack whose files `pid` maps now, and those files."""
    found = find_packs(packs, pid, new_image, executables_seen)
    return found[0] if found else None


def find_packs(packs: list[Pack], pid: int, new_image: bool,
               executables_seen: dict[tuple, bool]) -> list[tuple[Pack, list[tuple[str, str]]]]:
    """The packs whose files `pid` maps now, with those files (its mappings read once): the
    first engine among them (a process runs one), and every level's."""
    files = discovery.mapped_files(pid)
    out, engine_found = [], False
    for pack in packs:
        if engine_found and not pack.level:
            continue
        libs = engine_files(pack, pid, files, new_image, executables_seen)
        if libs:
            out.append((pack, libs))
            engine_found |= not pack.level
    return out


def engine_process(packs: list[Pack], pid: int) -> tuple[Pack, int, list[tuple[str, str]]]:
    """The engine in `pid`, else in the first of its descendants that runs one (vLLM's API
    server runs the model in a child): (pack, that process, its engine files)."""
    seen: dict[tuple, bool] = {}
    found = find_engine(packs, pid, True, seen)
    if found:
        return found[0], pid, found[1]
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        children = []
    for child in sorted(children, key=lambda c: c.pid):
        try:
            found = find_engine(packs, child.pid, True, seen)
        except (OSError, ProfinferError):
            continue
        if found:
            return found[0], child.pid, found[1]
    raise ProfinferError(
        f"no known engine in process {pid}" + (f" or its {len(children)} descendants" if children else "")
        + " (" + "; ".join(f"{p.engine}: {', '.join(p.libraries)}" + (f" or {p.marker}" if p.marker else "")
                           for p in packs) + ")")


class StatusLine:
    """A live one-line status on stderr (only on a terminal)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.t0 = time.monotonic()
        self.last = 0.0
        self.last_tokens = 0
        self.rate = 0.0

    def update(self, coll: EngineCollector, force: bool = False) -> None:
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
    sending each."""
    kernel.require_root()
    if child_status is None and not discovery.process_exists(pid):
        raise ProfinferError(f"no process with PID {pid}")
    all_packs = [load_pack(name) for name in (*extra_packs, *pack_names())]
    level_packs = [p for p in all_packs if p.level and p.level in levels]
    # engines, unless only runtime levels are asked for (cuda alone: no engine's probes)
    packs = [p for p in all_packs if not p.level] if levels - set(RUNTIME_LEVELS) else []
    pack = (packs or level_packs)[0]
    executables_seen: dict[tuple, bool] = {}   # follow: does it define the marker
    options = dict(tensor_layout=tensor_layout, buffer=buffer, counters=counters)
    follower: Follower | None = None
    coll: CollectorGroup | None = None
    engine_pid = pid
    open_spans_fd = shared_open_spans() if level_packs else None

    def make(p: Pack, where: int, files: list[tuple[str, str]]) -> EngineCollector:
        extra: dict = {}
        if follower is not None and (follow or p.level):   # attach: the engine keeps its own
            extra["followed_map_fd"] = follower.followed_map_fd()
        if open_spans_fd is not None:
            extra["open_spans_fd"] = open_spans_fd
        if p.level:
            extra["timeline"] = timeline
        return p.collector_class()(where, levels, p, files, root=f"/proc/{where}/root",
                                   **options, **extra)

    if not follow:
        try:
            try:
                pack, engine_pid, files = engine_process(packs or level_packs, pid)
            except ProfinferError:
                if not level_packs or not packs:
                    raise
                pack, engine_pid, files = engine_process(level_packs, pid)  # a plain CUDA program
            if engine_pid != pid:
                note(f"PID {pid} runs no engine; its descendant PID {engine_pid} runs {pack.engine}")
            if level_packs:
                follower = _watch_tree(pid, buffer, warn)
            coll = CollectorGroup(make(pack, engine_pid, files))
            for lp in level_packs:
                if lp is pack:
                    continue
                found = find_engine([lp], engine_pid, True, executables_seen)
                if found:
                    coll.add(make(lp, engine_pid, found[1]))
                else:
                    note(f"PID {engine_pid} maps no {lp.engine} runtime ({', '.join(lp.libraries)}) "
                         f"yet: the {lp.level} level starts when it loads one")
        except BaseException:
            if follower is not None:
                follower.close()
            if open_spans_fd is not None:
                os.close(open_spans_fd)
            raise
    stop_reason: list[str] = []

    def on_signal(signum, _frame):
        stop_reason.append(signal.Signals(signum).name)

    # only the main thread may set handlers (the daemon captures in its HTTP threads, where
    # --duration ends the session)
    in_main = threading.current_thread() is threading.main_thread()
    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)} if in_main else {}
    line = StatusLine(sys.stderr.isatty() if status is None else status)

    def attached(c: EngineCollector, where: int) -> None:
        for w in c.warnings:
            warn(w)
        what = f"levels {','.join(sorted(levels))}" if not c.pack.level else f"{c.pack.level} level"
        note(f"attached {c.n_probes} probes to PID {where} in {c.attach_s:.2f} s ({what})")
        c.refresh_process_info()

    def engine_appeared(tgid: int, found_pack: Pack, libs: list[tuple[str, str]]) -> None:
        nonlocal coll, engine_pid, pack
        present = coll.member(found_pack) if coll is not None else None
        engine_present = coll is not None and not coll.engine.pack.level
        if present is not None:
            for why in present.attach_files(libs, tgid) if found_pack.level else present.attach_files(libs):
                warn(f"PID {tgid}: {why}: not profiled")
        elif not found_pack.level and engine_present:
            warn(f"PID {tgid}: {found_pack.engine} too: only {pack.engine} in PID {engine_pid} is profiled")
        else:
            new = make(found_pack, tgid, libs)
            new.attach()
            if coll is None:
                coll = CollectorGroup(new)
            else:
                coll.add(new, engine=not found_pack.level)
            if not found_pack.level or not engine_present:
                engine_pid, pack = tgid, found_pack
            attached(new, tgid)

    try:
        if not follow:
            for m in coll.members:
                m.attach()
            for m in coll.members:
                attached(m, engine_pid)
            if follower is not None:
                # the rest of the tree (vLLM's workers): the level's probes sit on files and
                # run for the followed processes; each one's runtime code and names are read
                for child in sorted(follower.processes - {engine_pid}):
                    try:
                        for found in find_packs(level_packs, child, True, executables_seen):
                            engine_appeared(child, *found)
                    except (OSError, ProfinferError) as e:
                        if discovery.process_exists(child):
                            warn(f"PID {child}: {e}")
        else:
            follower = Follower(pid, kernel.event_buffer_kind(buffer))
            note(f"following PID {pid} and what it starts (exec, fork, dlopen)"
                 + ("" if follower.forks_followed else
                    "; forked processes are not followed: this kernel has no BTF"))
        cpu_at_attach = _own_cpu_s()
        # The target's CPU time, and ours, are counted from its first llama_decode (BPF sends
        # an event at its entry; without the token level, from the first event), so that
        # loading a model does not dilute the shares.
        target_cpu_from, own_cpu_from = _cpu_s(pid), cpu_at_attach
        target_cpu_last = target_cpu_from
        others_cpu = ProcessesCpu()     # the engine's other processes (vLLM's workers)
        counting_from_decode = False
        child_cpu: list[float] = []
        if on_attached:
            on_attached()
        deadline = time.monotonic() + duration if duration else None
        last_refresh = 0.0
        while not stop_reason:
            wait_ms = POLL_MS if counting_from_decode else POLL_BEFORE_DECODING_MS
            if deadline:
                wait_ms = max(0, min(wait_ms, int((deadline - time.monotonic()) * 1000) + 1))
            if follower is None:
                coll.poll(wait_ms)
            else:
                # a stopped process waits for the follower's records: wait on both buffers
                fds = [follower.fileno()] + (coll.filenos() if coll else [])
                select.select(fds, [], [], wait_ms / 1000)
                for change in follower.changes():
                    if change.what not in ("exec", "mapped"):
                        continue
                    try:      # the process is stopped until resumed, whatever happens here
                        if change.what == "exec":
                            follower.loaders.watch(change.tgid)
                        elif not follower.loaders.settled(change.tgid):
                            continue              # its loader stops it again when done
                        if not follow:        # attach: only a level's runtime can appear
                            engines = []
                        elif coll is not None and not coll.engine.pack.level:
                            engines = [pack]
                        else:
                            engines = packs
                        for found in find_packs(engines + level_packs, change.tgid,
                                                change.what == "exec", executables_seen):
                            engine_appeared(change.tgid, *found)
                    except ProfinferError as e:
                        if coll is None:
                            raise
                        warn(f"PID {change.tgid}: {e}")
                    finally:
                        follower.resume(change.tgid)
                if coll is not None:
                    coll.poll(0)
            if coll is not None and not counting_from_decode and coll.started:
                target_cpu_from, own_cpu_from, counting_from_decode = (
                    _cpu_s(engine_pid), _own_cpu_s(), True)
            if follow and engine_pid != pid:       # its CPU time, before it is reaped
                target_cpu_last = _cpu_s(engine_pid) or target_cpu_last
            if counting_from_decode:
                others_cpu.sample(coll.other_target_processes())
            now = time.monotonic()
            if coll is not None and now - last_refresh > REFRESH_S:
                coll.refresh_process_info()
                last_refresh = now
            if coll is not None:
                line.update(coll)
            if deadline and now >= deadline:
                stop_reason.append("duration")
            elif not _alive(pid, child_status, child_cpu):
                stop_reason.append("target exited" + (f" ({child_status[0]})" if child_status else ""))
        if coll is None:
            raise ProfinferError(f"no known engine in process {pid} or the processes it started "
                                 f"({len(follower.processes)} followed; none mapped "
                                 + "; ".join(f"{p.engine}: {', '.join(p.libraries)}"
                                             + (f" or defined {p.marker}" if p.marker else "")
                                             for p in packs or level_packs) + ")"
                                 + _stripped_note(executables_seen))
        line.update(coll, force=True)
        coll.refresh_process_info()
        collecting_rss_kb = _rss_kb()
        own_cpu = _own_cpu_s()
        # the target's CPU time while probed: what the probes' cost is a share of
        if engine_pid == pid:
            target_cpu = child_cpu[0] if child_cpu else _cpu_s(pid)
        else:
            target_cpu = _cpu_s(engine_pid) or target_cpu_last
        if target_cpu is not None and target_cpu_from is not None:
            target_cpu -= target_cpu_from
            others_cpu.sample(coll.other_target_processes())
            target_cpu += others_cpu.used()
        warned = len(coll.warnings)
        profile = coll.finish()
        for w in coll.warnings[warned:]:        # what only the end of collection shows
            warn(w)
        if follower is not None:
            profile.meta["processes_followed"] = str(len(follower.processes))
        profile.meta["stopped_by"] = stop_reason[0] if stop_reason else ""
        profile.meta["events"] = str(coll.n_events)
        profile.meta["wall_s"] = f"{time.monotonic() - line.t0:.3f}"
        # The collector's own memory, not the target's: the peak (ru_maxrss, KiB, includes
        # BCC's compile) and the resident size while collecting ended.
        profile.meta["collector_max_rss_kb"] = str(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
        profile.meta["collector_rss_kb"] = str(collecting_rss_kb)
        # CPU the collector itself used while the target ran (on a small machine it is taken
        # from the inference threads): the part of the overhead that is ours, not the probes'.
        profile.meta["collector_cpu_s"] = f"{own_cpu - cpu_at_attach:.3f}"
        profile.meta["collector_cpu_decoding_s"] = f"{own_cpu - own_cpu_from:.3f}"
        if target_cpu is not None:
            profile.meta["target_cpu_s"] = f"{target_cpu:.3f}"
        from profinfer.core import recorded_calibration
        recorded_calibration.stamp(profile)     # the roofs and trap costs that judge this run
        return profile
    finally:
        line.close()
        if coll is not None:
            coll.detach()
        if follower is not None:
            follower.close()
        if open_spans_fd is not None:
            os.close(open_spans_fd)
        for s, h in old.items():
            signal.signal(s, h)
