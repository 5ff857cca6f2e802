"""The computation graph (DAG) rebuilt from a trace, and its Graphviz rendering.

Nodes are the node runs of one graph compute (profinfer.engines.llamacpp.views.nodes); an edge joins the node that
produced a tensor to each node that reads it: a source is the producer itself, or a view
(reshape, permute, a slice of it) whose view_src is the producer. Sources that no node of
the graph produced (weights, the KV cache, graph inputs) are counted as inputs. The second
node of a fused pair is the same node as its first.

A node's time is its longest thread's slice (profinfer.engines.llamacpp.views.nodes). Each graph compute also has
one item that is no node: thread arrival, from its first thread's first node start to its
last thread's (stats.arrivals): a worker preempted or slow to wake when the graph begins is
charged there, not to the first node.

Graphs of the same phase and shape (same ops and tensor names in the same order) are merged:
their times add up. Repeated transformer layers ("Qcur-0" ... "Qcur-15") collapse into one
layer of nodes, each standing for all layers.
"""
from __future__ import annotations

import re
import shutil
import subprocess
from collections import Counter
from dataclasses import dataclass, field

from profinfer.core.base.errors import ProfinferError
from profinfer.core.profile.model import Profile
from profinfer.engines.llamacpp.views.nodes import NodeRun, node_runs, phase_of
from profinfer.core.calibration.roofline import Roofs
from profinfer.engines.llamacpp.views.cost import judge, reuse_of, run_reads
from profinfer.core.profile.stats import graph_arrivals

_LAYER = re.compile(r"^(.*)-(\d+)$")
ARRIVAL_LABEL = "thread arrival"


@dataclass
class GraphDag:
    """One graph compute: its node runs in order and its edges (indices into nodes)."""
    phase: str
    nodes: list[NodeRun]
    edges: set[tuple[int, int]]
    inputs: list[int]                    # per node: sources no node of this graph produced
    arrival_ns: int = 0                  # thread arrival skew of this compute

    @property
    def span_ns(self) -> int:
        """First node start to last node end."""
        return max(n.end_ns for n in self.nodes) - self.nodes[0].start_ns if self.nodes else 0

    @property
    def signature(self) -> tuple:
        return tuple((n.op, n.name) for n in self.nodes)


def graph_dags(profile: Profile) -> list[GraphDag]:
    """Each graph's nodes as a DAG, once a profile (its layers, its comparison's series and
    identity all read them)."""
    return profile.derived("graph_dags", (len(profile.ops), len(profile.graphs), len(profile.tokens)),
                           lambda: _graph_dags(profile) if profile.ops else [])


def _graph_dags(profile: Profile) -> list[GraphDag]:
    runs, graphs = node_runs(profile)
    phases = phase_of(runs, profile.tokens)
    skew = graph_arrivals(profile)
    by_graph: dict[int, list[tuple[NodeRun, str]]] = {}
    for r, ph in zip(runs, phases):
        if r.graph >= 0:
            by_graph.setdefault(r.graph, []).append((r, ph))
    out = []
    for g in sorted(by_graph):
        members = by_graph[g]
        nodes = [r for r, _ in members]
        index = {}
        for i, n in enumerate(nodes):
            if n.tensor:
                index[n.tensor] = i
            if n.fused_tensor:
                index[n.fused_tensor] = i
        edges, inputs = set(), []
        for i, n in enumerate(nodes):
            outside = 0
            views = n.src_views + (0,) * (len(n.srcs) - len(n.src_views))
            for src, view in zip(n.srcs, views):
                j = index.get(src)
                if j is None and view:
                    j = index.get(view)
                if j is None:
                    outside += 1
                elif j != i:
                    edges.add((j, i))
            inputs.append(outside)
        out.append(GraphDag(Counter(ph for _, ph in members).most_common(1)[0][0], nodes, edges, inputs,
                            skew.get(g, 0)))
    return out


@dataclass
class DagNode:
    key: str                   # display identity: tensor name (layer suffix removed if collapsed)
    op: str
    layers: int                # how many layers it stands for (1 when not collapsed)
    time_ns: int = 0           # summed over its layers and the merged graph computes
    runs: list[NodeRun] = field(default_factory=list)
    inputs: int = 0
    verdict: str = ""


@dataclass
class Dag:
    phase: str
    graphs: int                # graph computes merged
    nodes_per_graph: int
    edges_per_graph: int
    layers: int                # transformer layers collapsed (0: not collapsed)
    nodes: list[DagNode]
    edges: set[tuple[int, int]]
    arrival_ns: int = 0        # thread arrival, summed over the merged graph computes
    span_ns: int = 0           # first node start to last node end, summed likewise

    @property
    def node_ns(self) -> int:
        return sum(n.time_ns for n in self.nodes)

    @property
    def total_ns(self) -> int:
        """Node time and thread arrival: the share each item shows is of this."""
        return self.node_ns + self.arrival_ns


def build(profile: Profile, phase: str = "decode", collapse: bool = True,
          roofs: Roofs | None = None) -> Dag:
    """The DAG of the most frequent graph shape of `phase`, graphs of that shape merged."""
    dags = [d for d in graph_dags(profile) if d.phase == phase]
    if not dags:
        have = sorted({d.phase for d in graph_dags(profile)})
        raise ProfinferError(f"no {phase} graph with op events in this trace"
                             + (f" (it has: {', '.join(have)})" if have else
                                " (record with the op and graph levels)"))
    shape, _ = Counter(d.signature for d in dags).most_common(1)[0]
    same = [d for d in dags if d.signature == shape]
    first = same[0]
    layers = node_layers(first.nodes) if collapse else [None] * len(first.nodes)
    layered = sum(l is not None for l in layers) > len(first.nodes) // 2
    keys, key_index, nodes = [], {}, []
    seen_in_layer: Counter = Counter()
    for n, layer in zip(first.nodes, layers):
        if layered and layer is not None:
            # the k-th node of this name and op within its layer, the same in every layer
            base = generic_name(n.name)
            seen_in_layer[(layer, base, n.op)] += 1
            key = ("layer", base, n.op, seen_in_layer[(layer, base, n.op)])
        else:
            key = ("single", n.name, n.op, len(keys))
        if key not in key_index:
            key_index[key] = len(nodes)
            nodes.append(DagNode(key[1], n.op, 0))
        keys.append(key_index[key])
        nodes[key_index[key]].layers += 1
    for d in same:
        for i, n in enumerate(d.nodes):
            dn = nodes[keys[i]]
            dn.time_ns += n.dur_ns
            dn.runs.append(n)
    for i, k in enumerate(keys):
        nodes[k].inputs = max(nodes[k].inputs, first.inputs[i])
    edges = {(keys[a], keys[b]) for a, b in first.edges if keys[a] != keys[b]}
    if roofs is not None:
        runs, _ = node_runs(profile)
        read_at = {id(r): read for r, read in zip(runs, run_reads(profile))}
        for dn in nodes:
            v = judge(dn.key, dn.runs, roofs, reuse=reuse_of((r, read_at[id(r)]) for r in dn.runs))
            if v is not None:      # the roof named where it is a cache's, not DRAM's or compute's
                of = f" of {v.roof}" if v.roof_gbps is not None and v.roof != "DRAM" else ""
                dn.verdict = f"{v.bound}-bound {100 * v.roof_share:.0f}%{of}" if v.bound != "neither" \
                    else f"neither ({100 * v.roof_share:.0f}% of {v.roof if of else 'roof'})"
    n_layers = len({l for l in layers if l is not None}) if layered else 0
    return Dag(phase, len(same), len(first.nodes), len(first.edges), n_layers, nodes, edges,
               sum(d.arrival_ns for d in same), sum(d.span_ns for d in same))


def generic_name(name: str) -> str:
    """A tensor name without its layer number: "Qcur-3" -> "Qcur", "cache_k_l3 (view)" ->
    "cache_k_l# (view)", "node_41" -> "node_#"."""
    m = _LAYER.match(name)
    return m.group(1) if m else re.sub(r"\d+", "#", name)


def node_layers(nodes: list[NodeRun]) -> list[int | None]:
    """Layer of each node: from its name's "-N" suffix; a node without one (a view's name,
    an unnamed node) inside the span of one layer belongs to that layer."""
    named = [int(m.group(2)) if (m := _LAYER.match(n.name)) else None for n in nodes]
    out = list(named)
    prev = [None] * len(nodes)
    last = None
    for i, l in enumerate(named):
        last = l if l is not None else last
        prev[i] = last
    nxt = None
    for i in range(len(nodes) - 1, -1, -1):
        nxt = named[i] if named[i] is not None else nxt
        if out[i] is None and prev[i] is not None and prev[i] == nxt:
            out[i] = prev[i]
    return out


def _shade(share: float) -> str:
    """White to red by share of graph time."""
    level = max(0, min(255, int(255 * (1 - min(share * 4, 1.0)))))
    return f"#ff{level:02x}{level:02x}"


def to_dot(dag: Dag) -> str:
    total = dag.total_ns or 1
    lines = ["digraph profinfer {", '  rankdir=TB; node [shape=box, style="rounded,filled", '
             'fontname="Helvetica", fontsize=10];',
             f'  label="{dag.phase} graph: {dag.nodes_per_graph} nodes, {dag.edges_per_graph} edges, '
             f'{dag.graphs} computes merged'
             + (f", {dag.layers} layers collapsed" if dag.layers else "") + '"; labelloc=t;']

    def node_line(i: int, n: DagNode) -> str:
        share = n.time_ns / total
        label = f"{n.op}\\n{n.key}" + (f" ×{n.layers}" if n.layers > 1 else "") + f"\\n{100 * share:.1f}%"
        if n.verdict:
            label += f"\\n{n.verdict}"
        if n.inputs:
            label += f"\\n+{n.inputs} input" + ("s" if n.inputs > 1 else "")
        return f'  n{i} [label="{label}", fillcolor="{_shade(share)}"];'

    in_layer = [n.layers > 1 for n in dag.nodes]
    if dag.layers and any(in_layer):
        lines.append(f'  subgraph cluster_layer {{ label="× {dag.layers} layers"; style=dashed;')
        lines += ["  " + node_line(i, n) for i, n in enumerate(dag.nodes) if in_layer[i]]
        lines.append("  }")
    lines += [node_line(i, n) for i, n in enumerate(dag.nodes) if not in_layer[i]]
    lines += [f"  n{a} -> n{b};" for a, b in sorted(dag.edges)]
    if dag.arrival_ns and dag.nodes:
        # not a node of the graph: the wait for late threads before its first node
        share = dag.arrival_ns / total
        lines.append(f'  arrival [label="{ARRIVAL_LABEL}\\n{100 * share:.1f}%", style="dashed,filled", '
                     f'fillcolor="{_shade(share)}"];')
        lines.append("  arrival -> n0 [style=dashed];")
    lines.append("}")
    return "\n".join(lines) + "\n"


def write(dag: Dag, path: str) -> None:
    text = to_dot(dag)
    if path.endswith(".dot") or path.endswith(".gv"):
        try:
            with open(path, "w") as f:
                f.write(text)
        except OSError as e:
            raise ProfinferError(f"cannot write {path}: {e.strerror}") from None
        return
    fmt = path.rsplit(".", 1)[-1].lower()
    if fmt not in ("svg", "png", "pdf"):
        raise ProfinferError(f"unknown graph format .{fmt}: use .svg, .png, .pdf or .dot")
    dot = shutil.which("dot")
    if dot is None:
        raise ProfinferError("rendering needs Graphviz's dot (apt-get install graphviz); "
                             "or write .dot and render it elsewhere")
    done = subprocess.run([dot, f"-T{fmt}", "-o", path], input=text, text=True, capture_output=True)
    if done.returncode != 0:
        raise ProfinferError(f"dot failed: {done.stderr.strip().splitlines()[0] if done.stderr else '?'}")
