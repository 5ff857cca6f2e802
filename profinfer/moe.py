"""MoE routing statistics (pure logic): which experts each MoE layer activated.

Every thread that computes a MUL_MAT_ID node records the same expert ids, and a layer's
gate, up and down MUL_MAT_IDs read the same ids tensor: so a routing decision is one
(graph compute, ids tensor) pair, counted once.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .dag import node_layers
from .model import Profile
from .opcolumns import as_columns
from .nodes import node_runs, phase_of


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


def compute(profile: Profile) -> MoeStats | None:
    if not any(as_columns(profile.ops).experts.values()):
        return None
    runs, _ = node_runs(profile)
    phases = phase_of(runs, profile.tokens)
    graphs: dict[int, list] = {}
    for r, ph in zip(runs, phases):
        graphs.setdefault(r.graph, []).append((r, ph))
    decisions: dict[tuple[int, int], tuple[int, str, tuple]] = {}   # (graph, ids) -> (layer, phase, experts)
    for g, members in graphs.items():
        nodes = [r for r, _ in members]
        for (r, ph), layer in zip(members, node_layers(nodes)):
            if r.experts and len(r.srcs) >= 3:
                decisions.setdefault((g, r.srcs[2]), (layer if layer is not None else -1, ph, r.experts))
    layers = sorted({d[0] for d in decisions.values()})
    n_experts = 1 + max(e for _, _, ex in decisions.values() for row in ex for e in row)
    n_used = max(len(row) for _, _, ex in decisions.values() for row in ex)
    index = {l: i for i, l in enumerate(layers)}
    counts = np.zeros((len(layers), n_experts), np.int64)
    by_phase: dict[str, np.ndarray] = {}
    tokens: dict[str, int] = {}
    first_layer = layers[0]
    for layer, ph, ex in decisions.values():
        flat = np.fromiter((e for row in ex for e in row if 0 <= e < n_experts), np.int64)
        hist = np.bincount(flat, minlength=n_experts)
        counts[index[layer]] += hist
        by_phase.setdefault(ph, np.zeros_like(counts))[index[layer]] += hist
        if layer == first_layer:
            tokens[ph] = tokens.get(ph, 0) + len(ex)
    return MoeStats(n_experts, n_used, layers, counts, by_phase, tokens)
