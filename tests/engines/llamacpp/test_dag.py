"""The DAG view, checked against ggml's own account of the graph:
with GGML_SCHED_DEBUG=2 llama.cpp prints every node it schedules, whether it is computed,
and its sources by name. The decode graph rebuilt from a trace must have exactly its computed
nodes (a fused pair is one node), and an edge for every source that is a computed node."""
from __future__ import annotations

import re
import shutil

import pytest

from conftest import completion_cmd, run_profinfer, with_llama_log
from profinfer.engines.llamacpp.views import dag
from profinfer.exporters.trace_reader import read_trace

_NODE = re.compile(r"node #\s*(\d+) \(\s*(.{0,10}?)\):\s*(.{1,20}?) \(\s*\d+[KMG]?\) \[[^\]]*\] "
                   r"use=(\d+),c=(\d):(.*)")
_SRC = re.compile(r" D\s+(.{1,20}?) \(\s*\d+[KMG]?\) \[")


def printed_graphs(log: str) -> list[list[tuple[str, list[str]]]]:
    """Per printed graph: its computed nodes in order, as (name, source names)."""
    graphs: list[list[tuple[str, list[str]]]] = []
    for line in log.splitlines():
        if "## SPLIT #0" in line:
            graphs.append([])
            continue
        m = _NODE.search(line)
        if m and graphs and m.group(5) == "1":
            graphs[-1].append((m.group(3).strip(), [s.strip() for s in _SRC.findall(m.group(6))]))
    return graphs


def align(printed: list[tuple[str, list[str]]], ours: dag.GraphDag) -> list[int] | None:
    """For each printed node, the index of our node that computed it; None if they differ.
    A fused pair's second node is the printed node right after its first."""
    out, j, fused_pending = [], 0, False
    for name, _ in printed:
        if j < len(ours.nodes) and name == ours.nodes[j].name[:20]:
            out.append(j)
            fused_pending = bool(ours.nodes[j].fused_tensor)
            j += 1
        elif fused_pending:
            out.append(j - 1)
            fused_pending = False
        else:
            return None
    return out if j == len(ours.nodes) and not fused_pending else None


@pytest.mark.parametrize("design", ["one-probe", "two-probe"])
def test_dag_matches_ggml_graph(llama_build, tiny_model, llama_env, tmp_path, design):
    """Both op-level designs (docs/how-it-works.md): the one-probe design finds each
    node by walking the graph as ggml's loop does, the two-probe design from its argument."""
    trace = tmp_path / "g.pftrace"
    env = {**llama_env, "GGML_SCHED_DEBUG": "2", "PROFINFER_OP_DESIGN": design}
    r = with_llama_log(lambda: run_profinfer(
        ["record", "--quiet", "-o", str(trace), "--",
         *completion_cmd(llama_build, tiny_model, n=6, extra=("-v",))], env=env, tmp_path=tmp_path))
    assert r.rc == 0, r.stderr[-2000:]
    printed = printed_graphs(r.stderr)
    assert printed, "llama.cpp printed no graph (GGML_SCHED_DEBUG)"
    prof = read_trace(trace)
    decode = [g for g in dag.graph_dags(prof) if g.phase == "decode"]
    assert decode
    ours = decode[0]
    matches = [(p, a) for p in printed if (a := align(p, ours)) is not None]
    assert matches, f"no printed graph has our {len(ours.nodes)} nodes in order"
    p, a = matches[0]
    fused = sum(1 for n in ours.nodes if n.fused_tensor)
    assert fused > 0                                   # the CPU backend fuses RMS_NORM+MUL here
    assert len(p) == len(ours.nodes) + fused          # node counts: fused pairs are one node
    # every source that is a computed node is an edge (the latest node of that name before it)
    expected = set()
    for i, (name, srcs) in enumerate(p):
        for s in srcs:
            k = next((k for k in range(i - 1, -1, -1) if p[k][0] == s), None)
            if k is not None and a[k] != a[i]:
                expected.add((a[k], a[i]))
    assert len(expected) > len(ours.nodes) // 2
    assert expected <= ours.edges, sorted(expected - ours.edges)[:5]
    assert all(u < v for u, v in ours.edges)           # producers come before consumers


def test_graph_command_renders(llama_build, tiny_model, llama_env, tmp_path):
    trace = tmp_path / "g.pftrace"
    r = with_llama_log(lambda: run_profinfer(
        ["record", "--quiet", "-o", str(trace), "--", *completion_cmd(llama_build, tiny_model, n=6)],
        env=llama_env, tmp_path=tmp_path))
    assert r.rc == 0, r.stderr[-2000:]
    out = tmp_path / "g.dot"
    g = run_profinfer(["graph", str(trace), "-o", str(out)], json_summary=False)
    assert g.rc == 0, g.stderr
    text = out.read_text()
    assert text.startswith("digraph") and "MUL_MAT" in text and "layers" in text
    assert "layers collapsed" in g.stdout
    assert shutil.which("dot"), "Graphviz's dot is installed by setup.sh"
    svg = tmp_path / "g.svg"
    assert run_profinfer(["graph", str(trace), "-o", str(svg)], json_summary=False).rc == 0
    assert svg.read_text().lstrip().startswith(("<?xml", "<svg"))
