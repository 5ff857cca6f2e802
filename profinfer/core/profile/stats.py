"""Derived numbers for a Profile: phases, latency (TTFT/TPOT), per-thread and per-op totals.

Pure logic, no I/O. Ops are turned into numpy arrays once (profiles can hold millions).
All times are nanoseconds.

Definitions:
- tokens, sequences, TTFT and TPOT: see profinfer.core.profile.sequences.
- phase of a decode call (TokenCall.phase): "prefill" (prompt tokens only), "decode"
  (decode tokens only) or "mixed" (a server batching prompts and generations together). An op
  belongs to the phase of the decode call whose [start, end] contains its start; ops
  outside every call fall into phase "other".
- graph_ns of a thread: sum of the durations (entry to return of the innermost graph-compute
  call) of the graphs it ran ops in, so (arrival_ns + op_ns + barrier_ns) / graph_ns is the
  share of its graph time the probes explain; planning and gaps are what is left. The
  thread that issued a graph but ran none of its ops (GPU backend) counts the whole graph.
- thread arrival: in each graph compute, from the first node start of any thread to this
  thread's own first node start (zero for the first thread). A worker that is preempted or
  slow to wake when a graph begins arrives late; that time is its arrival, not any node's.
- ops counted instead of recorded (Profile.op_totals: no timeline asked): the op table and
  each phase's op time come from the counts; what needs single runs (percentiles, barrier
  waits, per-thread op time, arrival) is None.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from statistics import median

import numpy as np

from profinfer.core.profile.model import GraphCall, OpSlice, OpTotal, Profile, Step, TokenCall
from profinfer.core.profile.opcolumns import as_columns
from profinfer.core.profile import sequences as _sequences

# Sequences are their own module (the daemon tracks them too); named here for the importers
# that know them from here.
SequenceStats, SequenceTracker = _sequences.SequenceStats, _sequences.SequenceTracker
sequences = _sequences.sequences

PHASES = ("prefill", "decode", "mixed", "other")
_OTHER = PHASES.index("other")


@dataclass(slots=True)
class OpStats:
    op: str
    count: int
    total_ns: int
    mean_ns: float
    p50_ns: float | None  # None: counted ops (no single run kept)
    p99_ns: float | None
    share: float          # of all op time in the same scope (0..1)


@dataclass(slots=True)
class ThreadStats:
    tid: int
    name: str
    graph_ns: int
    op_ns: int | None             # None: counted ops (not known per thread)
    barrier_ns: int | None
    arrival_ns: int | None = 0    # late starts of graphs, summed (see "thread arrival" above)

    @property
    def coverage(self) -> float | None:
        """Share of graph time explained by arrival, op work and barrier waits (gaps are probe
        loss/overhead)."""
        if not self.graph_ns or self.op_ns is None or self.barrier_ns is None or self.arrival_ns is None:
            return None
        return (self.arrival_ns + self.op_ns + self.barrier_ns) / self.graph_ns


@dataclass(slots=True)
class Arrival:
    """One thread's arrival at one graph compute: from the graph's first node start (any
    thread) to this thread's first node start."""
    graph: int            # index into innermost_graphs(profile.graphs)
    tid: int
    start_ns: int
    end_ns: int

    @property
    def dur_ns(self) -> int:
        return self.end_ns - self.start_ns


@dataclass(slots=True)
class PhaseStats:
    phase: str
    calls: int = 0
    tokens: int = 0
    time_ns: int = 0      # sum of the decode calls' durations
    op_ns: int = 0
    barrier_ns: int | None = 0    # None: counted ops
    ops: list[OpStats] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float | None:
        return self.tokens / (self.time_ns / 1e9) if self.time_ns else None


@dataclass(slots=True)
class ProfileStats:
    decode_calls: int
    graphs: int
    lost_events: int
    phases: dict[str, PhaseStats]       # "prefill", "decode" always; "other" when ops fall outside calls
    sequences: list[SequenceStats]
    threads: list[ThreadStats]
    ops: list[OpStats]                  # sorted by total_ns, descending
    op_total_ns: int
    barrier_total_ns: int | None        # None: counted ops
    prefill_tokens: int = 0             # over all calls, mixed ones included
    decode_tokens: int = 0

    @property
    def ttft_ns(self) -> int | None:
        """Median TTFT over sequences that had a prefill."""
        vals = [s.ttft_ns for s in self.sequences if s.ttft_ns is not None]
        return int(median(vals)) if vals else None

    @property
    def tpot_ns(self) -> float | None:
        """Median TPOT over sequences that decoded."""
        vals = [s.tpot_ns for s in self.sequences if s.tpot_ns is not None]
        return float(median(vals)) if vals else None

    @property
    def tokens_per_s(self) -> float | None:
        """Decode throughput: decode tokens / time spent in decode calls."""
        return self.phases["decode"].tokens_per_s


@dataclass(slots=True)
class OpArrays:
    """Column view of Profile.ops; `code` indexes `names`."""
    tid: np.ndarray
    cpu: np.ndarray
    start: np.ndarray
    end: np.ndarray
    barrier_end: np.ndarray
    code: np.ndarray
    names: list[str]

    def __len__(self) -> int:
        return len(self.start)

    @property
    def dur(self) -> np.ndarray:
        return self.end - self.start

    @property
    def barrier(self) -> np.ndarray:
        return self.barrier_end - self.end


def op_arrays(ops: Sequence[OpSlice]) -> OpArrays:
    cols = as_columns(ops)
    code, names = cols.op_codes()
    return OpArrays(cols.tid, cols.cpu, cols.start, cols.end, cols.barrier_end, code, names)


def op_table(durs: np.ndarray, codes: np.ndarray, names: list[str]) -> list[OpStats]:
    """Per-op-type count/total/mean/p50/p99/share, sorted by total descending."""
    if not len(durs):
        return []
    order = np.lexsort((durs, codes))           # by op type, then duration: groups come out sorted
    sorted_codes, sorted_durs = codes[order], durs[order]
    bounds = np.searchsorted(sorted_codes, np.arange(len(names) + 1))
    grand = int(durs.sum())
    rows = []
    for k, name in enumerate(names):
        seg = sorted_durs[bounds[k]:bounds[k + 1]]
        if not len(seg):
            continue
        total = int(seg.sum())
        p50, p99 = np.percentile(seg, [50, 99])
        rows.append(OpStats(name, len(seg), total, total / len(seg), float(p50), float(p99),
                            total / grand if grand else 0.0))
    rows.sort(key=lambda r: (-r.total_ns, r.op))
    return rows


def totals_table(totals: list[OpTotal]) -> list[OpStats]:
    """Per-op-type count/total/mean/share of counted ops (no percentiles), sorted by total
    descending."""
    by_op: dict[str, list[int]] = {}
    for t in totals:
        acc = by_op.setdefault(t.op, [0, 0])
        acc[0] += t.calls
        acc[1] += t.total_ns
    grand = sum(ns for _, ns in by_op.values())
    rows = [OpStats(op, n, ns, ns / n, None, None, ns / grand if grand else 0.0)
            for op, (n, ns) in by_op.items() if n]
    rows.sort(key=lambda r: (-r.total_ns, r.op))
    return rows


def op_phases(arr: OpArrays, tokens: list[TokenCall]) -> np.ndarray:
    """Phase code (an index of PHASES) per op: the call containing the op's start."""
    phase = np.full(len(arr), _OTHER, np.int8)
    if not tokens or not len(arr):
        return phase
    toks = sorted(tokens, key=lambda t: t.start_ns)
    t_start = np.fromiter((t.start_ns for t in toks), np.int64, len(toks))
    t_end = np.fromiter((t.end_ns for t in toks), np.int64, len(toks))
    t_phase = np.fromiter((PHASES.index(t.phase) for t in toks), np.int8, len(toks))
    idx = np.searchsorted(t_start, arr.start, side="right") - 1
    safe = np.maximum(idx, 0)
    inside = (idx >= 0) & (arr.start <= t_end[safe])
    phase[inside] = t_phase[safe[inside]]
    return phase


def innermost_graphs(graphs: list[GraphCall]) -> list[GraphCall]:
    """Graphs that contain no other graph of their thread, sorted by start.

    The scheduler's compute of a whole graph encloses each backend's compute of its split;
    counting both would count the same time twice.
    """
    by_tid: dict[int, list[GraphCall]] = {}
    for g in sorted(graphs, key=lambda g: (g.start_ns, -g.end_ns)):
        by_tid.setdefault(g.tid, []).append(g)
    out = []
    for gs in by_tid.values():
        out += [g for g, nxt in zip(gs, gs[1:] + [None])
                if nxt is None or nxt.start_ns >= g.end_ns]
    return sorted(out, key=lambda g: g.start_ns)


def graph_of_ops(graphs: list[GraphCall], starts: np.ndarray) -> np.ndarray:
    """Per op start, the index of the graph in `graphs` (sorted by start, not nested) that
    contains it; -1 outside every graph."""
    if not graphs:
        return np.full(len(starts), -1, np.int64)
    g_start = np.fromiter((g.start_ns for g in graphs), np.int64, len(graphs))
    g_end = np.fromiter((g.end_ns for g in graphs), np.int64, len(graphs))
    gi = np.searchsorted(g_start, starts, side="right") - 1
    safe = np.maximum(gi, 0)
    return np.where((gi >= 0) & (starts <= g_end[safe]), gi, -1)


def arrivals(profile: Profile) -> list[Arrival]:
    """Each thread's arrival at each graph compute it ran ops in (zero-length ones included),
    by graph, then thread. Computed once per profile."""
    return profile.derived("arrivals", (len(profile.ops), len(profile.graphs)), lambda: _arrivals(profile))


def _arrivals(profile: Profile) -> list[Arrival]:
    cols = as_columns(profile.ops)
    gi = graph_of_ops(innermost_graphs(profile.graphs), cols.start)
    inside = gi >= 0
    g, tid, start = gi[inside], cols.tid[inside], cols.start[inside]
    out: list[Arrival] = []
    if len(g):
        order = np.lexsort((start, tid, g))
        g, tid, start = g[order], tid[order], start[order]
        first = np.r_[True, (g[1:] != g[:-1]) | (tid[1:] != tid[:-1])]
        g, tid, start = g[first], tid[first], start[first]    # each thread's first node start
        graph_first = np.r_[True, g[1:] != g[:-1]]
        graph_start = np.minimum.reduceat(start, np.flatnonzero(graph_first))[np.cumsum(graph_first) - 1]
        out = [Arrival(*row) for row in zip(g.tolist(), tid.tolist(), graph_start.tolist(),
                                            start.tolist())]
    return out


def graph_arrivals(profile: Profile) -> dict[int, int]:
    """Per graph compute (index into innermost_graphs) its arrival skew: from its first
    thread's first node start to its last thread's."""
    out: dict[int, int] = {}
    for a in arrivals(profile):
        out[a.graph] = max(out.get(a.graph, 0), a.dur_ns)
    return out


def thread_totals(profile: Profile, arr: OpArrays) -> list[ThreadStats]:
    tids = sorted(set(arr.tid.tolist()) | {g.tid for g in profile.graphs}
                  | {t.tid for t in profile.tokens})
    pos = {tid: i for i, tid in enumerate(tids)}
    n = len(tids)
    graph_ns = np.zeros(n, np.int64)
    arrival_ns = np.zeros(n, np.int64)
    for a in arrivals(profile):
        arrival_ns[pos[a.tid]] += a.dur_ns
    op_ns = np.zeros(n, np.int64)
    barrier_ns = np.zeros(n, np.int64)
    if len(arr):
        t_idx = np.searchsorted(np.asarray(tids, np.int64), arr.tid)
        np.add.at(op_ns, t_idx, arr.dur)
        np.add.at(barrier_ns, t_idx, arr.barrier)
    graphs = innermost_graphs(profile.graphs)
    if graphs:
        g_start = np.fromiter((g.start_ns for g in graphs), np.int64, len(graphs))
        g_end = np.fromiter((g.end_ns for g in graphs), np.int64, len(graphs))
        g_owner = np.fromiter((pos[g.tid] for g in graphs), np.int64, len(graphs))
        owner_idle = np.ones(len(graphs), bool)       # graphs in which the issuing thread ran no op
        if len(arr):
            gi = np.searchsorted(g_start, arr.start, side="right") - 1
            safe = np.maximum(gi, 0)
            sel = (gi >= 0) & (arr.start <= g_end[safe])
            key = safe[sel] * n + t_idx[sel]             # one group per (graph, thread)
            starts = arr.start[sel]
            order = np.lexsort((starts, key))
            key, starts = key[order], starts[order]
            first = np.ones(len(key), bool)
            first[1:] = key[1:] != key[:-1]
            g, t = np.divmod(key[first], n)
            np.add.at(graph_ns, t, g_end[g] - g_start[g])
            owner_idle[g[t == g_owner[g]]] = False
        # e.g. a GPU backend: the issuing thread waits in the graph without running ops itself
        np.add.at(graph_ns, g_owner[owner_idle], (g_end - g_start)[owner_idle])
    return [ThreadStats(tid, profile.thread_names.get(tid, ""), int(graph_ns[i]), int(op_ns[i]),
                        int(barrier_ns[i]), int(arrival_ns[i])) for i, tid in enumerate(tids)]


def counted(profile: Profile) -> bool:
    """The profile's ops were counted per type and phase, not recorded one by one."""
    return bool(profile.op_totals) and not len(profile.ops)


def _counted_stats(profile: Profile, phases: dict[str, PhaseStats]) -> ProfileStats:
    for name in PHASES:
        rows = [t for t in profile.op_totals if t.phase == name]
        if name not in phases and not rows:
            continue
        ph = phases.setdefault(name, PhaseStats(name))
        ph.op_ns = sum(t.total_ns for t in rows)
        ph.barrier_ns = None
        ph.ops = totals_table(rows)
    threads = thread_totals(profile, op_arrays([]))
    for th in threads:
        th.op_ns = th.barrier_ns = th.arrival_ns = None
    return ProfileStats(
        decode_calls=len(profile.tokens), graphs=len(profile.graphs), lost_events=profile.lost_events,
        phases=phases, sequences=sequences(profile.tokens), threads=threads,
        ops=totals_table(profile.op_totals), op_total_ns=sum(t.total_ns for t in profile.op_totals),
        barrier_total_ns=None, prefill_tokens=sum(t.prefill_tokens for t in profile.tokens),
        decode_tokens=sum(t.decode_tokens for t in profile.tokens))


def compute(profile: Profile) -> ProfileStats:
    phases = {p: PhaseStats(p) for p in ("prefill", "decode")}
    for t in profile.tokens:
        ph = phases.setdefault(t.phase, PhaseStats(t.phase))
        ph.calls += 1
        ph.tokens += t.n_tokens
        ph.time_ns += t.dur_ns
    if counted(profile):
        return _counted_stats(profile, phases)
    arr = op_arrays(profile.ops)
    durs, barriers = arr.dur, arr.barrier
    op_phase = op_phases(arr, profile.tokens)
    for code, name in enumerate(PHASES):
        mask = op_phase == code
        if name not in phases and not mask.any():
            continue
        ph = phases.setdefault(name, PhaseStats(name))
        ph.op_ns = int(durs[mask].sum())
        ph.barrier_ns = int(barriers[mask].sum())
        ph.ops = op_table(durs[mask], arr.code[mask], arr.names)
    return ProfileStats(
        decode_calls=len(profile.tokens),
        graphs=len(profile.graphs),
        lost_events=profile.lost_events,
        phases=phases,
        sequences=sequences(profile.tokens),
        threads=thread_totals(profile, arr),
        ops=op_table(durs, arr.code, arr.names),
        op_total_ns=int(durs.sum()),
        barrier_total_ns=int(barriers.sum()),
        prefill_tokens=sum(t.prefill_tokens for t in profile.tokens),
        decode_tokens=sum(t.decode_tokens for t in profile.tokens),
    )


def steps_by_number(profile: Profile) -> dict[tuple[int, int, int], Step]:
    """(process, thread, the thread's step number its calls carry) -> the step: each step
    is found by its step op's call, which starts it."""
    starts = {(st.pid, st.tid, st.start_ns): st for st in profile.steps}
    return {(c.pid, c.tid, c.step): starts[(c.pid, c.tid, c.start_ns)]
            for c in profile.calls if (c.pid, c.tid, c.start_ns) in starts}
