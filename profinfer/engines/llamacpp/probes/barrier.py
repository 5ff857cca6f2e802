"""llama.cpp's barrier, read for what one probe hit's trap costs inside the engine: the
two-probe design from a recording's ops (`trap_in_situ_ns`, this plugin's `accounting`), the
one-probe design from the gaps its BPF samples (`trap_at_fused_entries`)."""
from __future__ import annotations

import numpy as np

from profinfer.core.profile.model import Profile
from profinfer.core.profile.opcolumns import OpColumns, as_columns
from profinfer.core.profile.stats import innermost_graphs

IN_SITU_GRAPHS = 200        # graph computes sampled for the in-situ trap cost


def trap_in_situ_ns(profile: Profile, barrier_handler_ns: int = 0,
                    cols: OpColumns | None = None) -> float | None:
    """What one probe hit's trap costs inside the target, from the recording itself.

    After each node, a graph's threads meet at a barrier, and the last to arrive goes on at
    once: from its barrier probe's clock read to its next node's probe's clock read there is
    no waiting, only the rest of the barrier handler (counter reads: BPF time, counted
    apart, so barrier_handler_ns, its mean run time, is taken off), the first trap's way
    back, the engine's few instructions through the barrier, and the second trap's way in:
    one trap, as it costs in the engine (its caches cold after the node), not in a loop. The
    median over node boundaries of the smallest such gap across threads; None without
    op-level data. (The one-probe design's recording holds it in meta trap_in_situ_ns:
    trap_at_fused_entries.)"""
    cols = as_columns(profile.ops) if cols is None else cols
    if len(cols) < 2 or not profile.graphs:
        return None
    graphs = innermost_graphs(profile.graphs)
    if len(graphs) > IN_SITU_GRAPHS:
        graphs = [graphs[i] for i in np.linspace(0, len(graphs) - 1, IN_SITU_GRAPHS).astype(int)]
    by_tid = {}
    for t in cols.thread_ids():
        idx = np.flatnonzero(cols.tid == t)
        idx = idx[np.argsort(cols.start[idx])]
        by_tid[t] = (cols.start[idx], cols.end[idx], cols.desc[idx])
    gaps = []
    for g in graphs:
        parts = []
        for start, end, desc in by_tid.values():
            lo, hi = np.searchsorted(start, [g.start_ns, g.end_ns], side="left")
            if hi - lo > 1:
                parts.append((start[lo:hi], end[lo:hi], desc[lo:hi]))
        if not parts or len({len(p[0]) for p in parts}) != 1 or any(
                not np.array_equal(p[2], parts[0][2]) for p in parts):
            continue          # threads that did not all run the same nodes: nothing to align
        between = np.stack([p[0][1:] - p[1][:-1] for p in parts]).min(axis=0)
        gaps.append(between[between > 0])
    if not gaps:
        return None
    gaps = np.concatenate(gaps)
    return max(0.0, float(np.median(gaps)) - barrier_handler_ns) if len(gaps) else None


def trap_at_fused_entries(release: np.ndarray, gap: np.ndarray) -> int:
    """The one-probe design's measure of the same (llamacpp.bpf.c, op_node_end): there is no
    probe at a node's start but a fused op's. A barrier releases its threads as its last
    arriver leaves the probe, and that thread traps again at the fused op's entry, so the
    smallest gap of the threads that share a release is one trap's way out and in, and the
    loop's instructions up to the fused op (its fusion check included). The median over
    releases; `release` and `gap` (ns) are per fused op and thread."""
    order = np.lexsort((gap, release))
    first = np.r_[True, release[order][1:] != release[order][:-1]]
    return int(np.median(gap[order][first]))
