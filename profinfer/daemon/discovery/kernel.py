"""Node-wide discovery from the kernel (bpf/discover.bpf.c): a process whose loader completes
a library list with a file named like a pack's library, or that execs an executable found to
define a pack's marker, is held (SIGSTOP from BPF) until the agent has attached what it maps.
So a process is watched before its first call however briefly it lives, and a library it
loads late (dlopen) is probed before its first call. Unrelated processes are not stopped:
they cost a map lookup at exec and a look at the names their loader adds. Nor is a process
that a `record` on the node follows (profinfer.core.ebpf.followed): it is seen, not held, as its
record holds it until its own probes are on.

The loader's hook is probed per loader file: the host's and every one a process found so far
uses (at the daemon's start, each scan's new process, each new executable). The first
process to use a loader not seen yet (a container of a new image) is found by the scan.

A process stopped here is always continued: after it has been looked at, whatever that
found, and when the daemon stops. Each held process is also in the node's map of
held processes (core/ebpf/held.py): a daemon killed while it held one (SIGKILL, the kernel's OOM
kill) leaves it there, and any daemon on the node, the one restarted in its place first,
continues it.
"""
from __future__ import annotations

import ctypes
import os
import signal
import threading
import time
from dataclasses import dataclass

import numpy as np

from profinfer.core.ebpf import bpfobj, held, kernel, layout, libbpf, pinned, followed
from profinfer.core.base import waits
from profinfer.core.target import procfs
from profinfer.core.base.errors import ProfinferError
from profinfer.core.follow import LoaderHooks
from profinfer.core.plugin.packs import Pack

PROGRAMS = ("discover_exec", "discover_exit")
LOADER_PROGRAM = "discover_loader"
RING_PAGES = 16
NAME_MAX = 32
MAX_PREFIXES = 16
# A held process is continued after this long whatever the agent is doing (its look then
# comes late, as a scan's would): no tenant's process waits on a busy or stuck agent.
HOLD_MAX_S = 2.0
# One of this daemon's held processes still in the node's map after this long was never read
# from the ring (its loop is behind): the watchdog continues it (it is looked at late)
ORPHAN_S = 3 * HOLD_MAX_S
# Another live daemon's held process still in the node's map after this long: that daemon
# is frozen or deadlocked (its own watchdog would have continued it at ORPHAN_S), and any
# daemon on the node continues it (3 * ORPHAN_S unless set; waits' minimum keeps it past ORPHAN_S)
STUCK_S = waits.HOLD_STUCK_S
# A held process is continued by the kernel itself after this long (hold_deadline.bpf.c):
# whatever its daemon's state, stopped, frozen or stuck (its watchdog continues it at
# HOLD_MAX_S, or ORPHAN_S where its record was never read)
HOLD_DEADLINE_S = waits.HOLD_DEADLINE_S
DEADLINE_PROGRAMS = ("hold_deadline_arm", "hold_deadline_retry")


@dataclass(frozen=True)
class Discovered:
    tgid: int
    what: str       # "exec" (not stopped), "candidate", "loaded" (both stopped), "seen" (either,
                    # where it may not be stopped: traced, or with a controlling terminal)
    file: bytes = b""           # exec: the executable as the kernel names it (a map key)


def name_prefixes(packs: list[Pack]) -> list[str]:
    """Each pack library glob's file name up to its first wildcard ("libllama.so*" ->
    "libllama.so", "*/vllm/_C*.so" -> "_C"): what the kernel compares a mapped file's name with."""
    out: list[str] = []
    for pack in packs:
        for pattern in pack.libraries:
            name = pattern.rsplit("/", 1)[-1]
            cut = min((i for i, c in enumerate(name) if c in "*?["), default=len(name))
            prefix = name[:cut]
            if prefix and prefix not in out:
                out.append(prefix)
    return out


def _same(a, b) -> bool:
    return int(a["tgid"]) == int(b["tgid"]) and int(a["start_ticks"]) == int(b["start_ticks"])


def _alive(process) -> bool:
    """The process (a pi_process_id) still runs: its PID is not free nor another's now."""
    return followed.start_time(int(process["tgid"])) == int(process["start_ticks"])


def available() -> str | None:
    """None where node-wide discovery can run here, else why not."""
    if not os.path.exists("/sys/kernel/btf/vmlinux"):
        return "no kernel BTF (/sys/kernel/btf/vmlinux)"
    if not kernel.release_at_least(5, 17):
        return "Linux before 5.17 (no bpf_loop)"
    # BPF names processes by their pids in the initial PID namespace, which we could not
    # signal from another one
    if not kernel.in_host_pid_namespace():
        return "not in the host's PID namespace (hostPID)"
    return None


class NodeDiscovery:
    def __init__(self, packs: list[Pack], log=lambda msg: None):
        consts, dt = layout.parse(header="transport.h")
        self._names = {consts[f"PI_DISCOVER_{w.upper()}"]: w for w in ("exec", "candidate", "loaded", "seen")}
        self._verdicts = {True: consts["PI_EXEC_ENGINE"], False: consts["PI_EXEC_NONE"]}
        self._dt = dt["pi_discover_event"]
        self._records: list[bytes] = []
        self.log = log
        self.held: dict[int, float] = {}      # stopped here, not yet continued: since (monotonic)
        self._lock = threading.Lock()          # held: the watchdog continues what waits too long
        prefixes = name_prefixes(packs)
        if len(prefixes) > MAX_PREFIXES or any(len(p.encode()) > NAME_MAX for p in prefixes):
            raise ProfinferError(f"the packs' library names do not fit discovery's table: {prefixes}")
        self.obj = libbpf.BpfObject(bpfobj.object_path("discover.bpf.c", "ring"))
        _, no_bpffs = pinned.mount_bpffs()      # before the node's maps, which it holds
        recorded_fd = followed.open_shared(log)
        held_fd = held.open_shared(log)
        # A hold is safe only where its hand-off is shared: the record's followers say which
        # processes they hold (else both would stop one, and either continue it early), and the
        # held map outlives this daemon (else one killed or stopped while it holds leaves the
        # process stopped). Without both, nothing is held: each process is looked at as BPF
        # tells of it.
        self.holds = recorded_fd is not None and held_fd is not None
        if not self.holds:
            log(f"{no_bpffs or 'the node maps of held and recorded processes cannot be shared'}: "
                "discovery holds no process (each is probed once it is seen, so an engine's first "
                "calls may run before its probes are on)")
        try:
            config = np.zeros(1, dt["pi_core_config"])
            config["target_tgid"] = os.getpid()          # never itself
            self.obj.set_rodata(config.tobytes())
            if recorded_fd is not None:
                self.obj.reuse_map(followed.MAP_NAME, recorded_fd)
            if held_fd is not None:
                self.obj.reuse_map(held.MAP_NAME, held_fd)
            self.obj.set_max_entries("events", RING_PAGES * 4096)
            self.obj.load(set(PROGRAMS) | {LOADER_PROGRAM})
            self._held_dt = dt["pi_held"]
            self._me = np.zeros(1, dt["pi_process_id"])[0]
            self._me["tgid"], self._me["start_ticks"] = os.getpid(), followed.start_time(os.getpid())
            if self.holds:          # no holder: BPF tells what it finds, never stops it
                libbpf.map_update(self.obj.map_fd("holder"), (0).to_bytes(4, "little"), self._me.tobytes())
            fd = self.obj.map_fd("name_prefixes")
            for i, prefix in enumerate(prefixes):     # its bytes, then a mask of them
                raw = prefix.encode()
                libbpf.map_update(fd, i.to_bytes(4, "little"), raw.ljust(NAME_MAX, b"\0")
                                  + (b"\xff" * len(raw)).ljust(NAME_MAX, b"\0"))
            self.loaders = LoaderHooks(self.obj, LOADER_PROGRAM, table="hook_sites",
                                       table_size=consts["PI_MAX_HOOK_SITES"])
            self._buf = self.obj.ring_buffer("events", self._on_record)
            # armed before anything is held
            self.deadline = self._deadline(held_fd, dt["pi_hold_deadline_config"]) if self.holds else None
            for prog in PROGRAMS:
                self.obj.attach(prog)
        except ProfinferError:
            if getattr(self, "deadline", None) is not None:
                self.deadline.close()
            self.obj.close()
            raise
        finally:
            for fd in (recorded_fd, held_fd):      # the objects hold their own descriptors
                if fd is not None:
                    os.close(fd)
        self._ended = 0
        self._stop = threading.Event()
        self._watchdog = threading.Thread(target=self._continue_late, name="discovery-watchdog", daemon=True)
        self._watchdog.start()

    def _deadline(self, held_fd: int, config_dt) -> libbpf.BpfObject | None:
        """The kernel's deadline on this daemon's holds (hold_deadline.bpf.c), or None where
        it cannot be had here, said once."""
        why = None if kernel.release_at_least(6, 13) else "Linux before 6.13 (no bpf_send_signal_task)"
        obj = None
        if why is None:
            try:
                obj = libbpf.BpfObject(bpfobj.object_path("hold_deadline.bpf.c", "ring"))
                cfg = np.zeros(1, config_dt)
                cfg["holder"] = self._me
                cfg["deadline_ns"] = int(HOLD_DEADLINE_S * 1e9)
                obj.set_rodata(cfg.tobytes())
                obj.reuse_map(held.MAP_NAME, held_fd)
                obj.load(set(DEADLINE_PROGRAMS))
                for program in DEADLINE_PROGRAMS:
                    obj.attach(program)
                return obj
            except ProfinferError as e:
                why = str(e)
                if obj is not None:
                    obj.close()
        self.log(f"the kernel cannot end discovery's holds by itself ({why}): a process held while "
                 f"this daemon is stopped or stuck waits for another daemon ({STUCK_S:g} s) or for this one")
        return None

    @property
    def deadline_s(self) -> float | None:
        """The kernel's deadline on a hold, None where there is none (or nothing is held)."""
        return HOLD_DEADLINE_S if self.deadline is not None else None

    def deadline_ended(self) -> int:
        """How many holds the kernel's deadline ended (the daemon had not continued them)."""
        if self.deadline is None:
            return 0
        raw = libbpf.map_lookup(self.deadline.map_fd("ended"), (0).to_bytes(4, "little"), 8)
        return int.from_bytes(raw, "little") if raw else 0

    def _on_record(self, data, size):
        self._records.append(ctypes.string_at(data, size))

    def fileno(self) -> int:
        return self._buf.fileno()

    def events(self) -> list[Discovered]:
        self._buf.consume()
        records, self._records = self._records, []
        out = []
        for rec in records:
            ev = np.frombuffer(rec[: self._dt.itemsize], self._dt, count=1)[0]
            what = self._names.get(int(ev["what"]), "?")
            tgid = int(ev["tgid"])
            if what in ("candidate", "loaded"):
                with self._lock:    # held since BPF stopped it (bpf_ktime_get_ns: CLOCK_MONOTONIC)
                    self.held.setdefault(tgid, int(ev["ts_ns"]) / 1e9)
            out.append(Discovered(tgid, what, ev["file"].tobytes() if what == "exec" else b""))
        return out

    def held_now(self) -> list[int]:
        with self._lock:
            return sorted(self.held)

    def hook_loader(self, pid: int) -> None:
        """Its dynamic loader's hook probed (once per loader file)."""
        self.loaders.watch(pid)

    def settled(self, pid: int) -> bool:
        return self.loaders.settled(pid)

    def executable(self, key: bytes, engine: bool) -> None:
        """What an executable is, for its later execs: an engine's are held at exec."""
        libbpf.map_update(self.obj.map_fd("executables"), key, self._verdicts[engine].to_bytes(4, "little"))

    def pending(self, pid: int) -> bool:
        """A candidate whose loader has not finished yet (for at most HOLD_MAX_S: one whose
        record never came is not waited for)."""
        since = libbpf.map_lookup(self.obj.map_fd("candidates"), pid.to_bytes(4, "little"), 8)
        return since is not None and time.monotonic_ns() - int.from_bytes(since, "little") < HOLD_MAX_S * 1e9

    def release(self, pid: int, done: bool) -> None:
        """Continue a held process; done: what it maps is attached (held again only when it
        maps another engine-named file or execs)."""
        if done and self.obj is not None:
            libbpf.map_delete(self.obj.map_fd("candidates"), pid.to_bytes(4, "little"))
        self.loaders.forget(pid)        # it may exec another image before its next stop
        with self._lock:
            was_held = self.held.pop(pid, None) is not None
        if was_held:
            self._continue(pid)

    def _continue(self, pid: int) -> None:
        """Continue the process held as pid: the one the node's map names (its start time),
        through a pidfd, never a later process given its PID; not where its entry is gone
        (the kernel's deadline continued it) or another daemon's now."""
        key = pid.to_bytes(4, "little")
        fd = self.obj.map_fd(held.MAP_NAME)
        value = libbpf.map_lookup(fd, key, self._held_dt.itemsize)
        if value is None:
            return
        entry = np.frombuffer(value, self._held_dt, count=1)[0]
        if not _same(entry["holder"], self._me):
            return
        # out of the node's map first: a stop after this one (not ours) is never taken for ours
        libbpf.map_delete(fd, key)
        try:
            procfs.signal_process(pid, int(entry["process"]["start_ticks"]), signal.SIGCONT)
        except OSError as e:            # never the loop's end: said, and the others go on
            self.log(f"PID {pid}: cannot continue it after discovery held it: {e.strerror}")

    def _continue_orphans(self) -> list[int]:
        """Continue the node's held processes whose holder is gone (a daemon killed while it
        held them), this daemon's own held longer than ORPHAN_S (their records unread), and
        another live daemon's held longer than STUCK_S (it is stuck), from the node's map and
        from other versions' that it replaced (held.replaced_maps; unpinned when spent). An
        entry whose process is gone, another process now, or running, is dropped. The PIDs
        continued."""
        out = self._continue_orphans_in(self.obj.map_fd(held.MAP_NAME), self._held_dt.itemsize)
        for pin, fd, size in held.replaced_maps():
            out += self._continue_orphans_in(fd, size)
            held.unpin_if_spent(pin, fd, size)
        return out

    def _continue_orphans_in(self, fd: int, entry_size: int) -> list[int]:
        now, out = time.monotonic_ns(), []
        for key, value in list(libbpf.map_items(fd, 4, entry_size)):
            entry = np.frombuffer(value[:self._held_dt.itemsize], self._held_dt, count=1)[0]
            mine = _same(entry["holder"], self._me)
            if mine and now - int(entry["since_ns"]) < ORPHAN_S * 1e9:
                continue
            if not mine and now - int(entry["since_ns"]) < STUCK_S * 1e9 and _alive(entry["holder"]):
                continue
            if libbpf.map_lookup(fd, key, len(value)) != value:     # continued, or held anew, meanwhile
                continue
            pid = int(entry["process"]["tgid"])
            fields = procfs.stat_fields(pid)
            stopped = fields is not None and fields[0] == "T" and _alive(entry["process"])
            libbpf.map_delete(fd, key)
            if stopped:
                with self._lock:
                    self.held.pop(pid, None)
                try:
                    if procfs.signal_process(pid, int(entry["process"]["start_ticks"]), signal.SIGCONT):
                        out.append(pid)
                except OSError:
                    pass
        return out

    def _continue_late(self) -> None:
        said: set[str] = set()
        while not self._stop.wait(HOLD_MAX_S / 4):
            try:
                for pid in self._continue_orphans():
                    self.log(f"PID {pid}: held by a daemon gone or stuck ({STUCK_S:g} s), or unread here "
                             f"for {ORPHAN_S:g} s: continued (it is looked at late)")
            except Exception as e:      # the watchdog outlives whatever went wrong here; said once
                what = f"{type(e).__name__}: {e}"
                if what not in said and len(said) < 20:
                    said.add(what)
                    self.log(f"discovery's watchdog: looking for orphaned held processes: {what}")
            try:
                ended = self.deadline_ended()
            except Exception:           # the watchdog outlives a map read that fails
                ended = self._ended
            if ended != self._ended:
                try:
                    self.log(f"{ended - self._ended} held process(es) continued by the kernel's deadline "
                             f"({HOLD_DEADLINE_S:g} s): this daemon had not continued them (stopped or stuck)")
                except Exception:
                    pass
                self._ended = ended
            now = time.monotonic()
            with self._lock:
                late = [pid for pid, since in self.held.items() if now - since > HOLD_MAX_S]
                for pid in late:
                    del self.held[pid]
            for pid in late:            # continued before it is said (a log may block)
                self._continue(pid)
            for pid in late:
                try:
                    self.log(f"PID {pid}: held {HOLD_MAX_S:g} s by discovery while the agent was busy: "
                             "continued (it is looked at late)")
                except Exception:       # the watchdog outlives a log that fails
                    pass

    def close(self) -> None:
        """Detach (no process is stopped from then on), read what was told meanwhile, then
        continue every process still held."""
        if self.obj is None:
            return
        self.obj.detach()
        try:
            self.events()
        except Exception:           # whatever it was, the held processes are continued below
            pass
        self._stop.set()
        self._watchdog.join()
        with self._lock:
            still_held, self.held = list(self.held), {}
        for pid in still_held:
            self._continue(pid)
        obj, self.obj = self.obj, None
        obj.close()
        if self.deadline is not None:       # after every hold is ended above: its timers go with it
            self.deadline.close()
            self.deadline = None

