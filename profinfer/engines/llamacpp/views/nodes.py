"""Graph nodes as computed, across threads (pure logic).

Every worker thread records its own slice of a node; a node run is one node of one graph
compute: all slices with the same tensor inside the same innermost graph call. Its time is
its longest thread's slice (start to end): what the node costs the graph when its threads
start it together. Threads start a node at different times when one arrives late at the
graph (preempted or slow to wake: stats.arrivals) or leaves the previous barrier late (its
barrier time); "first start to last end" would charge either delay to the node.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from profinfer.core.profile.model import Profile
from profinfer.core.profile.opcolumns import NodeDesc, OpColumns, as_columns
from profinfer.core.profile.stats import innermost_graphs


@dataclass(slots=True)
class NodeRun:
    """One node of one graph compute. Its descriptor's fields (op, name, ne, dtype, tensor,
    srcs, src_views, fused_tensor, src_ne, src_dtypes) read as its own."""
    graph: int               # index into innermost_graphs(profile.graphs), -1 outside any
    desc: NodeDesc           # shared with every other run of the node
    start_ns: int
    end_ns: int
    threads: int
    thread_ns: int           # summed slice durations (CPU time spent on the node)
    # counter deltas summed over its slices (Profile.counter_names order); None unless every
    # slice was counted
    counters: list[float] | None = None
    # MUL_MAT_ID: the expert ids its slices read (every thread reads the same ids)
    experts: tuple | None = None
    longest_ns: int | None = None   # its longest thread's slice; None: one slice, start to end

    @property
    def dur_ns(self) -> int:
        """The node's time: its longest thread's slice (see the module docstring)."""
        return self.end_ns - self.start_ns if self.longest_ns is None else self.longest_ns


for _field in NodeDesc._fields:
    setattr(NodeRun, _field, property(lambda run, _f=_field: getattr(run.desc, _f)))


def node_runs(profile: Profile) -> tuple[list[NodeRun], list]:
    """(node runs sorted by start, the innermost graphs they index); computed once per
    profile (the report's views all start from them)."""
    return profile.derived("node_runs", (len(profile.ops), len(profile.graphs)), lambda: _node_runs(profile))


def _node_runs(profile: Profile) -> tuple[list[NodeRun], list]:
    graphs = innermost_graphs(profile.graphs)
    ops = as_columns(profile.ops)
    n = len(ops)
    if not n:
        return [], graphs
    starts = ops.start
    if graphs:
        g_start = np.array([g.start_ns for g in graphs], np.int64)
        g_end = np.array([g.end_ns for g in graphs], np.int64)
        gi = np.searchsorted(g_start, starts, side="right") - 1
        safe = np.maximum(gi, 0)
        gi = np.where((gi >= 0) & (starts <= g_end[safe]), gi, -1)
    else:
        gi = np.full(n, -1, np.int64)
    tensor = np.fromiter((d.tensor for d in ops.descs), np.int64, len(ops.descs))[ops.desc]
    # Without a tensor address (traces of old versions) a slice is its own node.
    key = np.where(tensor != 0, tensor, -1 - np.arange(n))
    # group by (graph, tensor); within a group by start, and ops are sorted by start, so the
    # index breaks ties as the ops' order does
    order = np.lexsort((np.arange(n), starts, key, gi))
    k_g, k_t = gi[order], key[order]
    first = np.ones(n, bool)
    first[1:] = (k_g[1:] != k_g[:-1]) | (k_t[1:] != k_t[:-1])
    bounds = np.flatnonzero(first)
    lead = order[bounds]                       # each group's earliest slice
    run_start = starts[lead]
    run_end = np.maximum.reduceat(ops.end[order], bounds)
    threads = np.diff(np.append(bounds, n))
    slice_ns = (ops.end - starts)[order]
    thread_ns = np.add.reduceat(slice_ns, bounds)
    longest = np.maximum.reduceat(slice_ns, bounds)
    counters = None
    if ops.counters is not None:
        # NaN (an uncounted slice) makes the node's sum NaN: not counted
        counters = np.add.reduceat(ops.counters[order], bounds)
    experts: dict[int, tuple] = {}
    if ops.experts:
        # the first slice (by start) of each group that read expert ids
        tid_o, start_o = ops.tid[order].tolist(), starts[order].tolist()
        group = np.cumsum(first) - 1
        for j in np.flatnonzero(np.isin(ops.desc[order], _moe_descs(ops))).tolist():
            g = int(group[j])
            if g not in experts:
                ex = ops.experts.get((tid_o[j], start_o[j]))
                if ex:
                    experts[g] = ex
    descs = ops.descs
    ctrs = None
    if counters is not None:
        ok = ~np.isnan(counters).any(axis=1)
        ctrs = [c if k else None for c, k in zip(counters.tolist(), ok.tolist())]
    cols = [x.tolist() for x in (gi[lead], ops.desc[lead], run_start, run_end, threads, thread_ns,
                                 longest)]
    runs = []
    # by start; equal starts in the order of their first slice
    for g in np.lexsort((lead, run_start)).tolist():
        graph, d, s, e, th, tns, lng = (c[g] for c in cols)
        runs.append(NodeRun(graph, descs[d], s, e, th, tns,
                            ctrs[g] if ctrs is not None else None, experts.get(g), lng))
    return runs, graphs


def _moe_descs(ops: OpColumns) -> np.ndarray:
    return np.array([i for i, d in enumerate(ops.descs) if d.op.startswith("MUL_MAT_ID")], np.int32)


def phase_of(runs: list[NodeRun], tokens) -> list[str]:
    """The phase ("prefill", "decode", "mixed" or "other") per run: that of the llama_decode
    call containing its start."""
    toks = sorted(tokens, key=lambda t: t.start_ns)
    if not toks:
        return ["other"] * len(runs)
    t_start = np.array([t.start_ns for t in toks], np.int64)
    t_end = np.array([t.end_ns for t in toks], np.int64)
    starts = np.array([r.start_ns for r in runs], np.int64)
    idx = np.searchsorted(t_start, starts, side="right") - 1
    out = []
    for i, s in zip(idx.tolist(), starts.tolist()):
        if i >= 0 and s <= t_end[i]:
            out.append(toks[i].phase)
        else:
            out.append("other")
    return out
