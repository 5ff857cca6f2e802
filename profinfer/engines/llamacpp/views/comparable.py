"""llama.cpp's quantities for `diff` (core.compare.Series) and what two runs must share to
be compared (pure logic).

Per graph compute, divided by the tokens of the decode call it ran in:
- "<phase> layer N" (or "outside layers": embedding, output head): its nodes' time;
- "<phase> <OP> <node>": one kind of node of every layer ("decode MUL_MAT ffn_up"), so a
  change in the FFN's matmuls is told apart from one in attention's: the finest parts of a
  token's work, which a run's common change of speed is estimated from.
A node's time is its longest thread's slice (engines/llamacpp/views/nodes.py), as the layer table's.

Two runs are comparable when their models have the same structure: the same layers and the
same kinds of node in their graphs. Shapes may differ (a wider FFN); `shapes` says which.
"""
from __future__ import annotations

from collections import defaultdict

import numpy as np

from profinfer.core.diff.comparable import PER_TOKEN, call_of, calls
from profinfer.core.diff.compare import Series
from profinfer.core.profile.model import Profile
from profinfer.engines.llamacpp.views.dag import GraphDag, generic_name, graph_dags, node_layers


def _graph_tokens(profile: Profile, graphs: list[GraphDag]) -> np.ndarray:
    """Tokens of the decode call each graph ran in (1 outside every call)."""
    _, starts, ends, tokens, _ = calls(profile)
    first = np.fromiter((g.nodes[0].start_ns for g in graphs), np.int64, len(graphs))
    i = call_of(starts, ends, first)
    return np.where(i >= 0, tokens[np.maximum(i, 0)] if len(tokens) else 1.0, 1.0)


def series(profile: Profile) -> list[Series]:
    graphs = [g for g in graph_dags(profile) if g.nodes and g.phase != "other"]
    if not graphs:
        return []
    per = _graph_tokens(profile, graphs)
    rows: dict[tuple[str, str, str], list[tuple[int, float, int]]] = defaultdict(list)
    for gi, g in enumerate(graphs):
        unit = PER_TOKEN.format(phase=g.phase)
        acc: dict[tuple[str, str, str], list] = defaultdict(lambda: [0, 0])
        for n, layer in zip(g.nodes, node_layers(g.nodes)):
            name = f"layer {layer}" if layer is not None else "outside layers"
            for key in (("layer", f"{g.phase} {name}", unit),
                        ("node", f"{g.phase} {n.op} {generic_name(n.name)}", unit)):
                acc[key][0] += n.dur_ns
                acc[key][1] += 1
        for key, (ns, count) in acc.items():
            rows[key].append((gi, ns / per[gi], count))
    in_phase: dict[str, list[int]] = defaultdict(list)
    for gi, g in enumerate(graphs):
        in_phase[g.phase].append(gi)
    out = []
    for (section, name, unit), vals in rows.items():
        samples = dict((gi, v) for gi, v, _ in vals)
        out.append(Series(section, name, unit,
                          np.array([samples.get(gi, 0.0) for gi in in_phase[name.split(" ", 1)[0]]]),
                          sum(c for _, _, c in vals), finest=section == "node"))
    # layers in their order, then the kinds of node by time, each phase together
    out.sort(key=lambda s: (s.section, s.name.split(" ", 1)[0], -float(s.samples.mean()) if s.section == "node" else 0))
    return out


def identity(profile: Profile) -> dict[str, object]:
    """The model's structure as the graphs show it: layers, and the kinds of node."""
    graphs = [g for g in graph_dags(profile) if g.nodes]
    if not graphs:
        return {}
    layers = {l for g in graphs for l in node_layers(g.nodes) if l is not None}
    return {"layers": str(len(layers)),
            "graph nodes": frozenset(f"{n.op} {generic_name(n.name)}" for g in graphs for n in g.nodes)}


def shapes(profile: Profile) -> dict[str, str]:
    """Each kind of node's result shape in the first decode graph (prompts of other lengths
    give other prefill shapes), for saying what differs."""
    out: dict[str, str] = {}
    if not profile.ops:
        return out
    for g in graph_dags(profile):
        if g.phase != "decode":
            continue
        for n in g.nodes:
            out.setdefault(f"shape of {n.op} {generic_name(n.name)}", "x".join(str(d) for d in n.ne))
        break
    return out
