"""MoE routing (pure logic): which experts each MoE layer chose for each token.

Every thread that computes a MUL_MAT_ID node records the same expert ids, and a layer's
gate, up and down MUL_MAT_IDs read the same ids tensor: so a routing decision is one
(graph compute, ids tensor) pair, counted once. The graph compute is the outermost one
(the scheduler's, per micro-batch): a program with an eval callback (llama-eval-callback,
imatrix) makes the scheduler compute a graph in many pieces, and a layer's MUL_MAT_IDs then
fall in different backend computes.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from profinfer.engines.llamacpp.views.dag import node_layers
from profinfer.core.profile.model import GraphCall, Profile
from profinfer.engines.llamacpp.views.nodes import node_runs, phase_of
from profinfer.core.profile.opcolumns import as_columns
from profinfer.core.profile.stats import graph_of_ops


@dataclass(frozen=True)
class Routing:
    """One routing decision: the experts one MoE layer chose for each token of one graph
    compute, in the router's order (most probable first)."""
    start_ns: int                           # start of the first MUL_MAT_ID that read them
    layer: int                              # -1 where no node name gives it
    phase: str                              # "prefill", "decode" or "other"
    experts: tuple[tuple[int, ...], ...]    # one row per token


@dataclass
class MoeStats:
    n_experts: int                          # highest expert id seen + 1
    n_used: int
    layers: list[int]                       # MoE layers, ascending
    counts: np.ndarray                      # [layer index, expert] activations
    by_phase: dict[str, np.ndarray]         # same, per phase
    tokens: dict[str, int]                  # routed tokens per phase (per layer)

    @property
    def total(self) -> int:
        return int(self.counts.sum())


def _outermost(graphs: list[GraphCall]) -> list[GraphCall]:
    """Graph computes that no other compute of their thread encloses, sorted by start."""
    out: list[GraphCall] = []
    end_by_tid: dict[int, int] = {}
    for g in sorted(graphs, key=lambda g: (g.start_ns, -g.end_ns)):
        if g.start_ns >= end_by_tid.get(g.tid, -1):
            out.append(g)
            end_by_tid[g.tid] = g.end_ns
    return out


def routing(profile: Profile) -> list[Routing]:
    """Every routing decision the MUL_MAT_ID nodes read, in the order they were made."""
    if not any(as_columns(profile.ops).experts.values()):
        return []
    runs, _ = node_runs(profile)
    phases = phase_of(runs, profile.tokens)
    outer = graph_of_ops(_outermost(profile.graphs),
                         np.fromiter((r.start_ns for r in runs), np.int64, len(runs)))
    computes: dict[int, list[int]] = {}
    for i, g in enumerate(outer.tolist()):
        computes.setdefault(g, []).append(i)
    decisions: dict[tuple[int, int], Routing] = {}
    for g, members in computes.items():
        for i, layer in zip(members, node_layers([runs[i] for i in members])):
            r = runs[i]
            if r.experts and len(r.srcs) >= 3 and (g, r.srcs[2]) not in decisions:
                decisions[(g, r.srcs[2])] = Routing(r.start_ns, layer if layer is not None else -1,
                                                    phases[i], r.experts)
    return sorted(decisions.values(), key=lambda d: d.start_ns)


def compute(profile: Profile) -> MoeStats | None:
    decisions = routing(profile)
    if not decisions:
        return None
    layers = sorted({d.layer for d in decisions})
    n_experts = 1 + max(e for d in decisions for row in d.experts for e in row)
    n_used = max(len(row) for d in decisions for row in d.experts)
    index = {l: i for i, l in enumerate(layers)}
    counts = np.zeros((len(layers), n_experts), np.int64)
    by_phase: dict[str, np.ndarray] = {}
    tokens: dict[str, int] = {}
    first_layer = layers[0]
    for d in decisions:
        flat = np.fromiter((e for row in d.experts for e in row if 0 <= e < n_experts), np.int64)
        hist = np.bincount(flat, minlength=n_experts)
        counts[index[d.layer]] += hist
        by_phase.setdefault(d.phase, np.zeros_like(counts))[index[d.layer]] += hist
        if d.layer == first_layer:
            tokens[d.phase] = tokens.get(d.phase, 0) + len(d.experts)
    return MoeStats(n_experts, n_used, layers, counts, by_phase, tokens)
