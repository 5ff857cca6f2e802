"""The agent's finder: which processes to watch. Once a scan (a second) it reads /proc: a
process qualifies when it maps an engine's libraries (or its executable defines the engine's
marker); one that maps none is looked at again when its address space has changed size
(Python loads llama.cpp with dlopen): one read of /proc/PID/stat a second per process, its
mappings only when they may have changed. Between scans, what the kernel tells of new
processes (kernel.py: new executables, processes held at their loader's hook) is looked at
at once. A process is (pid, start time): a pid reused by a new process is a new process.

The watch cap is kept per tenant and in all; a watched process that made no engine call
gives its place up when the cap is reached; what is left out is counted by tenant. The files
a process maps are its tenant's: they are read in the parse worker, in that tenant's queue
(parsing.on_behalf_of), and one still being read leaves its process to a later scan."""
from __future__ import annotations

import os
import time
from dataclasses import replace

from profinfer.core.base.errors import ProfinferError
from profinfer.core.base.waits import WATCH_GRACE_S
from profinfer.core.follow import interpreter
from profinfer.core.plugin.packfinder import engine_files, find_engine, find_packs
from profinfer.core.target import parsing
from profinfer.core.target.parsing import NotReady
from profinfer.core.target.process import mapped_files
from profinfer.core.target.procfs import process_stat
from profinfer.daemon.attach import Attach
from profinfer.daemon.discovery.identity import model_file
from profinfer.daemon.discovery.kernel import NodeDiscovery
from profinfer.daemon.governor import level_rank
from profinfer.daemon.node import Node, set_up
from profinfer.daemon.watch import Watch

MODEL_RECHECK_S = 10.0   # a watched process with no model file found yet is looked at again


class Finder:
    def __init__(self, node: Node, attach: Attach, discovery: NodeDiscovery | None):
        self.node = node
        self.attach = attach
        self.discovery = discovery      # the kernel's side; None where it cannot be had

    def scan(self) -> None:
        try:
            pids = [int(d) for d in os.listdir("/proc") if d.isdigit()]
        except OSError as e:
            self.node.error(f"reading /proc: {e}")
            return
        alive = set(pids)
        stats: dict[int, tuple[int, int]] = {}     # read once a scan
        for pid, w in list(self.node.watches.items()):
            st = process_stat(pid)
            if st is None or st[0] != w.identity.start:     # exited (its pid maybe reused)
                self.attach.gone(w)
            else:
                stats[pid] = st
        now = time.monotonic()
        self.node.seen.keep_alive(alive)
        if self.discovery is not None:
            for pid in sorted(self.node.seen.loader_pending):     # loaders read since the last scan
                self.node.seen.loader_pending.discard(pid)
                if pid in alive:
                    with self._on_behalf_of(pid):
                        self._hook_loader(pid)
        with self.node.lock:
            self.node.unwatched = {k: v for k, v in self.node.unwatched.items() if k[0] in alive}
        for w in list(self.node.watches.values()):
            attached = False
            if w.op_pending and w.collector is None:        # its files were being read
                with self._on_behalf_of(w.identity.pid, w.identity.start):
                    attached = self.attach.op(w)
            if attached:
                w.op_pending = False
                w.cost_mark = None
                self.node.metrics.level(w.identity, level_rank(w.levels))
                self.node.log(f"PID {w.identity.pid}: op level attached, {w.collector.n_probes} probes of its own")
            if not w.identity.model and now - w.model_checked >= MODEL_RECHECK_S:
                w.model_checked = now          # a model loaded after the process was found
                found = model_file(w.identity.pid)
                if found:
                    w.identity = replace(w.identity, model=found)
                    self.node.metrics.watched(w.identity, keep_counts=True)
        for pid in pids:
            if pid in self.node.watches or pid == self.node.own_pid:
                continue
            st = stats[pid] = process_stat(pid)
            if st is not None:
                self._look(pid, st, now)
        # a watched process that loads a CUDA runtime or driver later (PyTorch dlopens
        # libcudart, which dlopens libcuda): probed at once where discovery holds it at its
        # loader's hook, else within a scan
        if self.node.cuda_pack is not None:
            for pid, w in list(self.node.watches.items()):
                st = stats.get(pid)
                if st is not None and self.node.seen.cuda_checked.get((pid, st[0])) != st[1]:
                    with self._on_behalf_of(pid, st[0]):
                        self._look_runtime(pid, w, st)

    def tenant_of(self, pid: int, start: int | None = None) -> str:
        if start is None:
            st = process_stat(pid)
            start = st[0] if st is not None else -1
        return self.node.seen.tenants.tenant((pid, start))

    def _on_behalf_of(self, pid: int, start: int | None = None):
        """The tenant's turn for the files read while looking at the process (parsing's
        queue per tenant)."""
        return parsing.on_behalf_of(self.tenant_of(pid, start))

    def _look(self, pid: int, st: tuple[int, int], now: float, settled: bool = False) -> None:
        """Watch `pid` if it maps an engine or a runtime now (settled: discovery holds it with
        its library list complete, so look even if its size is the one looked at before)."""
        key, vsize = (pid, st[0]), st[1]
        if not settled and (self.node.seen.not_engines.get(key) == vsize or key in self.node.unwatched):
            return                    # looked at, and nothing mapped since
        if key in self.node.seen.over_cap and not self._room_for(self.node.seen.tenants.of.get(key, "")):
            return                    # left out, and still no room
        with parsing.on_behalf_of(self.node.seen.tenants.tenant(key)):
            self._look_further(pid, st, now, settled)

    def _look_further(self, pid: int, st: tuple[int, int], now: float, settled: bool) -> None:
        key, vsize = (pid, st[0]), st[1]
        if not settled and self.discovery is not None:
            if self.discovery.pending(pid):
                return                # loading: looked at once its loader is done
            if key not in self.node.seen.loader_seen:
                self.node.seen.loader_seen.add(key)
                self._hook_loader(pid)
        retry = self.node.seen.failed.get(key)
        if retry is not None and now < retry[0]:
            return
        try:
            matched = find_packs(self.node.all_packs, pid, True, self.node.seen.executables_seen)
        except NotReady:
            return                    # its executable is being read: looked at again later
        except (OSError, ProfinferError):
            matched = []
        except Exception as e:          # an unreadable file of a vanishing process
            self.node.error(f"PID {pid}: looking for an engine: {type(e).__name__}: {e}")
            matched = []
        found = next((m for m in matched if not m[0].level), None)
        cuda = next((m for m in matched if m[0].level), None)
        if found is None and cuda is None:
            self.node.seen.not_engines[key] = vsize
            return
        tenant = self.node.seen.tenants.tenant(key)
        if self._watched_of(tenant) >= self.node.seen.tenants.limit:
            self._left_out(key, tenant, f"its tenant ({tenant}) has {self.node.seen.tenants.limit} watched (--max-per-tenant)")
            return
        if self.node.full() and not self._make_room():
            self._left_out(key, tenant, f"watching {self.node.max_processes} processes (--max-processes)")
            return
        self.node.seen.over_cap.discard(key)
        if found is not None:
            self.attach.watch(pid, st[0], *found)
        else:
            self.attach.runtime_only(pid, st[0])
        if cuda is not None and pid in self.node.watches:
            self.attach.cuda(self.node.watches[pid], cuda[1])

    def _room_for(self, tenant: str) -> bool:
        return not self.node.full() and self._watched_of(tenant) < self.node.seen.tenants.limit

    def _watched_of(self, tenant: str) -> int:
        keys = [(pid, w.identity.start) for pid, w in self.node.watches.items()] + list(self.node.unwatched)
        return sum(1 for k in keys if self.node.seen.tenants.of.get(k) == tenant)

    def _make_room(self) -> bool:
        """The cap reached: a watched process that made no engine call (no decode call, no
        step) in its first WATCH_GRACE_S gives its place up, from the tenant with the most
        watched (the longest watched of them). False where none may."""
        now = time.time()
        idle = [w for w in self.node.watches.values() if not w.callers and now - w.started_at >= WATCH_GRACE_S]
        if not idle:
            return False
        by_tenant: dict[str, int] = {}
        for w in self.node.watches.values():
            t = self.node.seen.tenants.of.get((w.identity.pid, w.identity.start), "")
            by_tenant[t] = by_tenant.get(t, 0) + 1
        w = min(idle, key=lambda w: (-by_tenant.get(self.node.seen.tenants.of.get((w.identity.pid, w.identity.start), ""), 0),
                                     w.started_at))
        key = (w.identity.pid, w.identity.start)
        self.attach.gone(w, f"gave its place up: no engine call in {now - w.started_at:.0f} s, and the watch cap was reached")
        self._left_out(key, self.node.seen.tenants.of.get(key, ""), "")
        return True

    def _left_out(self, key: tuple[int, int], tenant: str, why: str) -> None:
        """A process found with no room (why): counted once, by tenant, said once a spell."""
        if key in self.node.seen.over_cap:
            return
        self.node.seen.over_cap.add(key)
        self.node.metrics.processes_dropped += 1
        self.node.seen.tenants.count_left_out(tenant)
        if why and not self.node.seen.cap_said:
            self.node.seen.cap_said = True
            self.node.log(f"PID {key[0]} left out: {why}; it and any other left out now are counted in "
                     "profinfer_processes_dropped_total, and by tenant in /status")

    @set_up
    def _look_runtime(self, pid: int, w: Watch, st: tuple[int, int]) -> None:
        """A watched process that may have loaded a CUDA runtime since it was looked at."""
        self.node.seen.cuda_checked[(pid, st[0])] = st[1]
        try:
            cuda = find_engine([self.node.cuda_pack], pid, False, self.node.seen.executables_seen)
        except Exception:
            cuda = None
        if cuda is None:
            return
        if not w.cuda:
            self.attach.cuda(w, cuda[1])
        else:
            try:
                self.node.runtime.add(pid, cuda[1])
            except NotReady:
                self.node.seen.cuda_checked.pop((pid, st[0]), None)     # looked at again at the next scan
            except Exception as e:
                self.node.error(f"PID {pid}: probing a runtime it loaded: {e}")

    def discovered(self) -> None:
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
                self.node.error(f"PID {ev.tgid}: discovery ({ev.what}): {type(e).__name__}: {e}")
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
            engine = any(engine_files(p, pid, main, True, self.node.seen.executables_seen)
                         for p in self.node.all_packs if p.marker)
            if not told_of():
                return              # it ran another image while its file was read
        except (OSError, ProfinferError):    # NotReady included: the scan looks at it later
            return
        self.discovery.executable(file, engine)
        self._hook_loader(pid)
        st = process_stat(pid)
        if engine and st is not None and pid not in self.node.watches:
            self._look(pid, st, time.monotonic(), settled=True)

    def _hook_loader(self, pid: int) -> None:
        """Its loader's hook probed, so that a library it (or another process using the same
        loader) completes a list with later is seen at once. A loader still being read (in
        the parsing worker) is hooked at a later scan (loader_pending)."""
        try:
            self.discovery.hook_loader(pid)
        except NotReady:
            self.node.seen.loader_pending.add(pid)
            return
        except Exception as e:          # a tenant's loader file: whatever reading it raised
            self.node.error(f"PID {pid}: hooking its loader: {type(e).__name__}: {e}")
        self.node.seen.loader_pending.discard(pid)

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
            self.node.seen.loader_pending.add(pid)
            self._libraries_loaded(pid)
        except ProfinferError as e:     # no hook to wait for: look now
            self.node.error(f"PID {pid}: {e}")
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
        if st is not None and pid != self.node.own_pid:
            w = self.node.watches.get(pid)
            if w is None:
                self._look(pid, st, time.monotonic(), settled=True)
            elif self.node.cuda_pack is not None:
                self._look_runtime(pid, w, st)
