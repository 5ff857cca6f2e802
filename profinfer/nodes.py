"""Graph nodes as computed, across threads (pure logic).

Every worker thread records its own slice of a node; a node run is one node of one graph
compute: all slices with the same tensor inside the same innermost graph call. Its time is
the first start to the last end across threads, which is what a node costs the graph.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .model import Profile
from .stats import innermost_graphs


@dataclass(slots=True)
class NodeRun:
    graph: int               # index into innermost_graphs(profile.graphs), -1 outside any
    tensor: int
    op: str
    name: str
    ne: tuple[int, ...]
    dtype: str
    srcs: tuple[int, ...]
    src_views: tuple[int, ...]
    fused_tensor: int
    src_ne: tuple[tuple[int, ...], ...]
    src_dtypes: tuple[str, ...]
    start_ns: int
    end_ns: int
    threads: int
    thread_ns: int           # summed slice durations (CPU time spent on the node)
    # counter deltas summed over its slices (Profile.counter_names order); None unless every
    # slice was counted
    counters: list[float] | None = None
    # MUL_MAT_ID: the expert ids its slices read (every thread reads the same ids)
    experts: tuple | None = None

    @property
    def dur_ns(self) -> int:
        return self.end_ns - self.start_ns


def node_runs(profile: Profile) -> tuple[list[NodeRun], list]:
    """(node runs sorted by start, the innermost graphs they index); computed once per
    profile (the report's views all start from them)."""
    cached = profile.__dict__.get("_node_runs")
    if cached is not None and cached[0] == (len(profile.ops), len(profile.graphs)):
        return cached[1]
    result = _node_runs(profile)
    profile.__dict__["_node_runs"] = ((len(profile.ops), len(profile.graphs)), result)
    return result


def _node_runs(profile: Profile) -> tuple[list[NodeRun], list]:
    graphs = innermost_graphs(profile.graphs)
    ops = profile.ops
    if not ops:
        return [], graphs
    starts = np.fromiter((o.start_ns for o in ops), np.int64, len(ops))
    if graphs:
        g_start = np.array([g.start_ns for g in graphs], np.int64)
        g_end = np.array([g.end_ns for g in graphs], np.int64)
        gi = np.searchsorted(g_start, starts, side="right") - 1
        safe = np.maximum(gi, 0)
        gi = np.where((gi >= 0) & (starts <= g_end[safe]), gi, -1)
    else:
        gi = np.full(len(ops), -1, np.int64)
    runs: dict[tuple[int, int], NodeRun] = {}
    order: list[tuple[int, int]] = []
    for g, o in zip(gi.tolist(), ops):
        # Without a tensor address (traces of old versions) a slice is its own node.
        key = (g, o.tensor) if o.tensor else (g, -len(order) - 1)
        r = runs.get(key)
        if r is None:
            runs[key] = NodeRun(g, o.tensor, o.op, o.name, o.ne, o.dtype, o.srcs, o.src_views,
                                o.fused_tensor, o.src_ne, o.src_dtypes, o.start_ns, o.end_ns, 1,
                                o.dur_ns, list(o.counters) if o.counters is not None else None,
                                o.experts)
            order.append(key)
        else:
            if r.experts is None:
                r.experts = o.experts
            r.start_ns = min(r.start_ns, o.start_ns)
            r.end_ns = max(r.end_ns, o.end_ns)
            r.threads += 1
            r.thread_ns += o.dur_ns
            if r.counters is not None:
                if o.counters is None:
                    r.counters = None
                else:
                    r.counters = [a + b for a, b in zip(r.counters, o.counters)]
    out = [runs[k] for k in order]
    out.sort(key=lambda r: r.start_ns)
    return out, graphs



def phase_of(runs: list[NodeRun], tokens) -> list[str]:
    """"prefill", "decode" or "other" per run: the llama_decode call containing its start."""
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
            out.append("prefill" if toks[i].prefill else "decode")
        else:
            out.append("other")
    return out
