"""The agent's drain: what the probes sent since the last loop, handed on. A build's shared
probes give each process its decode calls or steps, the cuda level its counts by process,
a process's own op level its ops counted in BPF; losses are counted on each process a
shared ring serves. Also the kernel's run-time counts of each watch's programs."""
from __future__ import annotations

from dataclasses import replace

from profinfer.core.profile.model import TokenCall
from profinfer.daemon.export.metrics import level_metrics
from profinfer.daemon.node import Node
from profinfer.daemon.shared import SharedProbes, SharedRuntime
from profinfer.daemon.watch import Watch, step_call


class Drain:
    def __init__(self, node: Node):
        self.node = node

    def process(self, w: Watch) -> None:
        """The process's own probes: its op level."""
        coll = w.collector
        if coll is None:
            return
        try:
            coll.poll(0)
            totals = coll.take_op_totals()
            if totals:
                self.node.metrics.op_totals(w.identity, totals)
            lost = coll.lost()
            if lost > w.lost_seen:
                self.node.metrics.lost(w.identity, lost - w.lost_seen)
                w.lost_seen = lost
        except Exception as e:             # this watch's trouble, not the loop's
            w.errors += 1
            if w.errors <= 3:
                self.node.error(f"PID {w.identity.pid}: {type(e).__name__}: {e}")

    def group(self, group: SharedProbes) -> None:
        """A build's shared probes: each decode call goes to the process that made it."""
        coll = group.collector
        try:
            coll.poll(0)
            steps = "steps_by_process" in group.capabilities
            taken = coll.take_steps_by_process() if steps else coll.take_tokens_by_process()
            handed: dict[int, list] = {}
            for tgid, calls in taken.items():
                w = self.node.watches.get(tgid)
                if w is None or (w.group is not group and tgid not in group.count_until):
                    continue            # a process that left the map while its call was queued
                if tgid in group.count_from:      # moved here: what began before, the old object counts
                    calls = [t for t in calls if t.start_ns >= group.count_from[tgid]]
                if tgid in group.count_until:     # moving away: what began since, the new object counts
                    calls = [t for t in calls if t.start_ns < group.count_until[tgid]]
                handed[tgid] = calls
                group.token_calls[tgid] = group.token_calls.get(tgid, 0) + len(calls)
                w.callers.update(t.tid for t in calls)
                for t in calls:
                    if steps:
                        # a step is known by its first op's call alone: its time at the next
                        # step, and no sequence ids to follow (time to first token, per output token)
                        step = step_call(t)
                        self.node.metrics.decode_call(w.identity, step, [], [], timed=False)
                        self._step_time(w, step)
                    else:
                        ttfts, tpots = w.tracker.feed(t)
                        self.node.metrics.decode_call(w.identity, t, ttfts, tpots)
                        if self.node.recorder is not None:
                            self.node.recorder.observe(w.identity, t, ttfts, tpots)
            if "records_by_process" in group.capabilities:
                self._records(group, coll.take_records_by_process(), handed)
            self._shared_lost(group, coll.lost())
        except Exception as e:
            group.errors += 1
            if group.errors <= 3:
                self.node.error(f"{group.key[0]} shared probes: {type(e).__name__}: {e}")

    def _records(self, group: SharedProbes, records: dict[int, list], calls: dict[int, list]) -> None:
        """The engine's own records (llama-server's request marks) and the decode calls, by
        process, to the engine's daemon_metrics; every process the group serves each drain,
        those with none too (what has been quiet ends)."""
        engine = group.plugin
        if engine not in level_metrics():
            return
        for pid in set(group.pids) | set(records):
            w = self.node.watches.get(pid)
            if w is None or (w.group is not group and pid not in group.count_until):
                continue
            mine = records.get(pid, [])
            if pid in group.count_from:       # moving between objects: each counts its side (as calls)
                mine = [r for r in mine if r.start_ns >= group.count_from[pid]]
            if pid in group.count_until:
                mine = [r for r in mine if r.start_ns < group.count_until[pid]]
            self.node.metrics.level_records(w.identity, engine, [], mine + calls.get(pid, []))

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
        self.node.metrics.call_time(w.identity, timed)
        if self.node.recorder is not None:
            self.node.recorder.observe(w.identity, timed, [], [])

    def runtime(self) -> None:
        """The cuda level: BPF's counts (cumulative) and the calls sent since, by process."""
        rt = self.node.runtime
        if rt is None:
            return
        try:
            groups, calls = rt.collector.take()
        except Exception as e:
            rt.errors += 1
            if rt.errors <= 3:
                self.node.error(f"cuda level: {type(e).__name__}: {e}")
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
            w = self.node.watches.get(pid)
            if w is not None and w.cuda:
                quantities = self.node.metrics.level_records(w.identity, "cuda", g, c)
                if self.node.recorder is not None and groups:
                    for quantity, (n, ns) in quantities.items():
                        self.node.recorder.observe_cumulative(w.identity, quantity, n, ns)
        self._shared_lost(rt, rt.collector.lost())

    def _shared_lost(self, shared: SharedProbes | SharedRuntime, lost: int) -> None:
        """A shared ring's losses cannot be told apart: each process it serves counts them."""
        if lost <= shared.lost_seen:
            return
        for pid in shared.pids:
            if pid in self.node.watches:
                self.node.metrics.lost(self.node.watches[pid].identity, lost - shared.lost_seen)
        shared.lost_seen = lost

    def graph_totals(self, group: SharedProbes) -> None:
        """The graph level, counted in BPF: its cumulative counts, by process and backend."""
        if "graph_totals" not in group.capabilities:
            return
        try:
            totals = group.collector.take_graph_totals()
        except Exception as e:
            group.errors += 1
            if group.errors <= 3:
                self.node.error(f"{group.key[0]} shared probes: graph totals: {type(e).__name__}: {e}")
            return
        for tgid, backends in totals.items():
            w = self.node.watches.get(tgid)
            if w is None or (w.group is not group and tgid not in group.count_until):
                continue
            group.graph_calls[tgid] = sum(v[0] for v in backends.values())
            self.node.metrics.graphs(w.identity, backends)

    def programs_of(self, w: Watch) -> None:
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

    def sample_all(self) -> None:
        """Once a scan: each shared object's graph totals, and every object's programs'
        kernel counts."""
        node = self.node
        for g in list(node.groups.values()) + ([node.runtime] if node.runtime else []):
            if isinstance(g, SharedProbes):
                self.graph_totals(g)
            try:
                g.programs = dict(g.collector.obj.program_stats())
            except Exception:
                pass
        for w in list(node.watches.values()):
            self.programs_of(w)
