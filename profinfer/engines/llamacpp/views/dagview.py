"""Terminal summary of a DAG: its size, then its nodes in graph order with time share and verdict."""
from __future__ import annotations

from rich.console import Console
from rich.table import Table

from profinfer.engines.llamacpp.views.dag import ARRIVAL_LABEL, Dag


def render(dag: Dag, console: Console, top: int = 40) -> None:
    total = dag.total_ns or 1
    console.print(f"{dag.phase} graph: {dag.nodes_per_graph} nodes, {dag.edges_per_graph} edges; "
                  f"{dag.graphs} computes merged"
                  + (f"; {dag.layers} layers collapsed into {sum(n.layers > 1 for n in dag.nodes)} "
                     f"nodes" if dag.layers else ""))
    if dag.span_ns:
        span = dag.span_ns
        rest = max(span - dag.total_ns, 0)
        console.print(f"per compute {span / dag.graphs / 1e3:,.1f} µs from the first node's start to "
                      f"the last one's end: nodes {100 * dag.node_ns / span:.0f}%, thread arrival "
                      f"{100 * dag.arrival_ns / span:.0f}%, between nodes (barrier release, threads "
                      f"starting a node late) {100 * rest / span:.0f}%")
    t = Table(title_justify="left")
    t.add_column("#", justify="right")
    t.add_column("node")
    t.add_column("op")
    t.add_column("layers", justify="right")
    t.add_column("share %", justify="right")
    t.add_column("µs / compute", justify="right")
    t.add_column("inputs", justify="right")
    t.add_column("from")
    t.add_column("verdict")
    preds: dict[int, list[int]] = {}
    for a, b in dag.edges:
        preds.setdefault(b, []).append(a)
    if dag.arrival_ns:     # not a node: the wait for threads that reach the graph late
        t.add_row("-", ARRIVAL_LABEL, "-", "-", f"{100 * dag.arrival_ns / total:.1f}",
                  f"{dag.arrival_ns / dag.graphs / 1e3:,.1f}", "-", "-", "-")
    shown = sorted(range(len(dag.nodes)), key=lambda i: -dag.nodes[i].time_ns)[:top]
    for i in sorted(shown):
        n = dag.nodes[i]
        t.add_row(str(i), n.key, n.op, str(n.layers), f"{100 * n.time_ns / total:.1f}",
                  f"{n.time_ns / dag.graphs / 1e3:,.1f}", str(n.inputs),
                  ",".join(str(p) for p in sorted(preds.get(i, []))) or "-", n.verdict or "-")
    console.print(t)
