"""The agent's attach stage: a found process watched (its build's shared probes at the
always-on levels, its own op level where the budget allows, the one cuda object where it has
a runtime), its levels changed at the governor's word, and everything let go when it exits.

A process is moved between shared objects without losing or double-counting a decode call
(regroup, let_go); what detached programs ran stays in the totals (Node.retire); an attach
that fails is tried again, backing off, and said once a process."""
from __future__ import annotations

import os
import time

from profinfer.core.base.waits import SERIES_TTL_S, STEP_UP_S
from profinfer.core.plugin.packs import Pack
from profinfer.core.profile.stats import SequenceTracker
from profinfer.core.target.parsing import NotReady
from profinfer.core.target.procfs import exit_fd, process_stat
from profinfer.daemon.discovery.identity import identify
from profinfer.daemon.drain import Drain
from profinfer.daemon.governor import level_rank
from profinfer.daemon.node import SCAN_S, Node, set_up
from profinfer.daemon.plugins import capabilities, process_caches
from profinfer.daemon.shared import SharedProbes, SharedRuntime, group_key
from profinfer.daemon.watch import Watch

RETRY_FIRST_S, RETRY_MAX_S = 2.0, 60.0    # a failed attach is tried again, backing off
SHARED_LEVELS = ("token", "graph")    # shared per build; the op level is per process
# a process's own op-level object sends next to nothing (its ops are counted in BPF; its
# graph events bound them): 64 KiB (a ring of 4 MiB, attach's default, would be 4 MiB of
# locked memory a process)
RING_PAGES = 16


class Attach:
    def __init__(self, node: Node, drain: Drain):
        self.node = node
        self.drain = drain

    @set_up
    def watch(self, pid: int, start: int, pack: Pack, files: list[tuple[str, str]]) -> None:
        caps = capabilities(pack)
        if not caps & {"tokens_by_process", "steps_by_process"}:
            # an engine with no always-on level: found and listed, not probed
            ident = identify(pid, start, pack.engine)
            with self.node.lock:
                self.node.unwatched[(pid, start)] = ident
            self.node.log(f"PID {pid} ({ident.comm}) runs {pack.engine}: found, not watched (no "
                     "always-on level for this engine yet)")
            return
        if "steps_by_process" in caps:
            shared = {"step"}             # the token level of an engine that works in steps
        else:
            shared = {lv for lv in SHARED_LEVELS if lv in self.node.levels} or {"token"}
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
        if "op" in self.node.levels and "op_totals" in caps:
            w.op_pending = not self.op(w)
        w.pidfd = exit_fd(pid, start)
        with self.node.lock:
            self.node.watches[pid] = w
        self.node.seen.failed.pop((pid, start), None)
        self.node.metrics.watched(ident)
        self.node.metrics.level(ident, level_rank(w.levels))
        self.node.log(f"watching PID {pid} ({ident.comm}, {pack.engine}"
                 + (f", model {os.path.basename(ident.model)}" if ident.model else "")
                 + (f", container {ident.container}" if ident.container else "")
                 + (f", pod {ident.namespace}/{ident.pod}" if ident.pod_uid else "")
                 + f") at {','.join(sorted(w.levels))}"
                 + (f", {w.collector.n_probes} op-level probes of its own" if w.collector else ""))

    def _join_group(self, pack: Pack, pid: int, files: list[tuple[str, str]], shared: set[str]) -> SharedProbes:
        """The process added to its build's shared probes at these levels (opened if none yet)."""
        key = group_key(pack, files) + (frozenset(shared),)
        group = self.node.groups.get(key)
        if group is None:
            group = SharedProbes.open(key, pack, pid, files, shared)
            self.node.groups[key] = group
            self.node.log(f"{pack.engine}: {group.collector.n_probes} probes on "
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
        if any(p == pid for _, p, _ in self.node.leaving):
            return False                        # still leaving the last one: at a later judgment
        try:
            new = self._join_group(w.pack, pid, w.files, shared)
        except Exception as e:
            self.node.error(f"PID {pid}: moving to the shared probes at {','.join(sorted(shared))}: "
                        f"{type(e).__name__}: {e}")
            return False
        moved_at = time.monotonic_ns()          # BPF's clock (CLOCK_MONOTONIC)
        new.count_from[pid] = moved_at
        old.count_until[pid] = moved_at
        if "graph" in new.key[-1]:              # its graph counts begin again there
            self.drain.graph_totals(old)
            self.node.metrics.carry_graphs(w.identity)
        w.group = new
        self.node.leaving.append((old, pid, time.monotonic() + SCAN_S))
        w.levels = (w.levels - set(SHARED_LEVELS)) | shared
        return True

    def let_go(self, now: float, pid_now: int | None = None) -> None:
        """The shared objects processes moved away from (a scan ago, or pid_now's at once):
        drained, their graph counts kept, then they let the processes go."""
        keep = []
        for group, pid, when in self.node.leaving:
            if now < when and pid != pid_now:
                keep.append((group, pid, when))
                continue
            self.drain.group(group)
            w = self.node.watches.get(pid)
            if "graph" in group.key[-1] and w is not None:    # the graph level was taken: its last counts
                self.drain.graph_totals(group)
                self.node.metrics.carry_graphs(w.identity)
            try:
                group.remove(pid)
            except Exception as e:
                self.node.error(f"PID {pid}: leaving its shared probes: {type(e).__name__}: {e}")
            if not group.pids and group.key in self.node.groups:
                self._close_group(group)
        self.node.leaving = keep

    @set_up
    def op(self, w: Watch) -> bool:
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
                self.node.error(f"PID {pid}: the op level not attached: {e}")
                w.op_pending = False
            return False
        w.collector = coll
        w.levels = w.levels | {"op"}
        return True

    @set_up
    def _detach_op(self, w: Watch) -> None:
        """Its op level drained, its programs' counts kept, then detached."""
        if w.collector is not None:
            self.drain.process(w)
            self.drain.programs_of(w)
        coll, w.collector = w.collector, None
        w.levels = w.levels - {"op"}
        if coll is None:
            return
        self.node.retire(w.programs)
        w.programs = {}
        try:
            coll.detach()
        except Exception as e:
            self.node.error(f"PID {w.identity.pid}: detaching its op level: {type(e).__name__}: {e}")

    @set_up
    def runtime_only(self, pid: int, start: int) -> None:
        """A process that runs no known engine but a CUDA runtime: watched at the cuda level."""
        ident = identify(pid, start, self.node.cuda_pack.engine)
        w = Watch(ident, None, set(), time.time(), model_checked=time.monotonic(), pidfd=exit_fd(pid, start),
                  step_up_wait_s=STEP_UP_S)
        with self.node.lock:
            self.node.watches[pid] = w
        self.node.metrics.watched(ident)

    @set_up
    def cuda(self, w: Watch, files: list[tuple[str, str]]) -> None:
        """The cuda level beside the process's engine: counted in BPF (no timeline), by the
        one object that serves every process with a runtime."""
        pid = w.identity.pid
        try:
            if self.node.runtime is None:
                self.node.runtime = SharedRuntime.open(self.node.cuda_pack, pid, files)
            else:
                self.node.runtime.add(pid, files)
        except Exception as e:
            if self.node.runtime is not None and not self.node.runtime.pids:
                self._close_runtime()
            if w.collector is None and w.group is None:     # nothing else watches it: forget it
                with self.node.lock:
                    self.node.watches.pop(pid, None)
                self.node.metrics.forget(w.identity)
                if w.pidfd >= 0:
                    os.close(w.pidfd)
                    w.pidfd = -1
            if isinstance(e, NotReady):     # a file still being read: looked at again later
                self.node.seen.cuda_checked.pop((pid, w.identity.start), None)
                return
            self._attach_failed(pid, w.identity.start, self.node.cuda_pack, e)
            return
        w.cuda = True
        w.levels = w.levels | {"cuda", "cuda-detail"}
        self.node.log(f"PID {pid} ({w.identity.comm}): cuda level, {self.node.runtime.collector.n_probes} probes "
                 f"on {', '.join(self.node.runtime.files())}, shared by {len(self.node.runtime.pids)} process(es)")

    def _close_runtime(self) -> None:
        rt, self.node.runtime = self.node.runtime, None
        try:
            rt.programs = dict(rt.collector.obj.program_stats())
        except Exception:
            pass
        self.node.retire(rt.programs)
        try:
            rt.close()
        except Exception as e:
            self.node.error(f"closing the cuda level: {type(e).__name__}: {e}")

    def _attach_failed(self, pid: int, start: int, pack: Pack, e: Exception) -> None:
        st = process_stat(pid)
        if st is None or st[0] != start:
            return                          # it exited meanwhile: nothing to report
        key = (pid, start)
        first = key not in self.node.seen.failed
        backoff = RETRY_FIRST_S if first else min(self.node.seen.failed[key][1] * 2, RETRY_MAX_S)
        self.node.seen.failed[key] = (time.monotonic() + backoff, backoff)
        if first:                           # counted and said once a process
            self.node.attach_errors += 1
            self.node.metrics.attach_errors.labels(engine=pack.engine).inc()
            self.node.log(f"PID {pid} ({pack.engine}): not watched: {e} (tried again, backing off)")

    @set_up
    def gone(self, w: Watch, why: str = "exited") -> None:
        """Detach at once (it exited, or why); the series stay for SERIES_TTL_S."""
        if any(pid == w.identity.pid for _, pid, _ in self.node.leaving):
            self.let_go(time.monotonic(), w.identity.pid)
        group = w.group
        if group is not None:
            self.drain.group(group)
            self.drain.graph_totals(group)
        self.node.metrics.ended(w.identity)      # its plug-ins' open counts (requests in flight)
        self._detach_op(w)
        if w.cuda and self.node.runtime is not None:
            self.drain.runtime()
            try:
                self.node.runtime.remove(w.identity.pid)
            except Exception as e:
                self.node.error(f"PID {w.identity.pid}: leaving the cuda level: {type(e).__name__}: {e}")
            if not self.node.runtime.pids:
                self._close_runtime()
        if group is not None:
            try:
                group.remove(w.identity.pid)
            except Exception as e:
                self.node.error(f"PID {w.identity.pid}: leaving its shared probes: {type(e).__name__}: {e}")
            if not group.pids:
                self._close_group(group)
        w.exited_at = time.monotonic()
        w.group = None     # its buffers go now; the series stay (metrics)
        w.cuda = False
        w.tracker = SequenceTracker(keep=False)    # its sequences: nothing more will come
        if self.node.recorder is not None:
            self.node.recorder.forget(w.identity)
        for caches in process_caches():           # what was read through its /proc/PID/root
            caches.forget_process(w.identity.pid)
        if w.pidfd >= 0:
            os.close(w.pidfd)
            w.pidfd = -1
        with self.node.lock:
            self.node.watches.pop(w.identity.pid, None)
            self.node.exited.append(w)
        # at most max_processes exited ones' series wait for their TTL: the oldest go first
        while len(self.node.exited) > self.node.max_processes:
            self.node.metrics.forget(self.node.exited.pop(0).identity)
            self.node.metrics.series_dropped += 1
        if not self.node.full():
            self.node.seen.cap_said = False
        self.node.log(f"PID {w.identity.pid} ({w.identity.comm}) {why}: detached")

    def _close_group(self, group: SharedProbes) -> None:
        """Its last process has gone: its links, programs and maps go."""
        try:
            group.programs = dict(group.collector.obj.program_stats())
        except Exception:
            pass
        self.node.retire(group.programs)
        self.node.groups.pop(group.key, None)
        try:
            group.close()
        except Exception as e:
            self.node.error(f"closing shared probes: {type(e).__name__}: {e}")

    def expire(self) -> None:
        now = time.monotonic()
        keep = []
        for w in self.node.exited:
            if now - w.exited_at >= SERIES_TTL_S:
                self.node.metrics.forget(w.identity)
            else:
                keep.append(w)
        self.node.exited = keep

    @set_up
    def relevel(self, w: Watch, levels: set[str], why: str) -> bool:
        """Take away or give back one level of the process: its op level (its own probes), the
        cuda level's per-call detail (a flag in the cuda object's map), or the graph level (it
        moves to its build's shared probes without it). The floor (token or step, the cuda
        level's counts by function) stays: it is never left unprofiled."""
        pid, old = w.identity.pid, set(w.levels)
        changed = (levels - w.levels) | (w.levels - levels)
        if changed == {"op"}:
            if "op" in levels and not self.op(w):
                return False
            if "op" not in levels:
                self._detach_op(w)
        elif changed == {"cuda-detail"} and w.cuda and self.node.runtime is not None:
            try:
                self.node.runtime.detail(pid, "cuda-detail" in levels)
            except OSError as e:
                self.node.error(f"PID {pid}: the cuda level's detail: {e}")
                return False
            w.levels = set(levels)
        elif changed == {"graph"} and w.group is not None:
            shared = (w.levels & set(SHARED_LEVELS)) ^ {"graph"}
            if not self._regroup(w, shared):
                return False
        else:
            return False
        w.cost_mark, w.share = None, None       # judged afresh at its new levels (shares: the last judgment's)
        self.node.metrics.level(w.identity, level_rank(w.levels), changed=True)
        self.node.log(f"PID {pid}: levels {','.join(sorted(old))} -> {','.join(sorted(w.levels))} ({why})")
        return True

    def close(self) -> None:
        """Every probe let go: each process's own, the cuda level's, the shared objects'."""
        node = self.node
        with node.lock:
            watches = list(node.watches.values())
            node.watches.clear()
        for w in watches:
            try:
                if w.collector is not None:
                    w.collector.detach()
            except Exception:
                pass
            if w.pidfd >= 0:
                os.close(w.pidfd)
        if node.runtime is not None:
            try:
                node.runtime.close()
            except Exception:
                pass
            node.runtime = None
        for g in list(node.groups.values()):
            try:
                g.close()
            except Exception:
                pass
        node.groups.clear()
