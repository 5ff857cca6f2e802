"""The op level counted in BPF per op type and phase: what `record` and `attach` do
without a timeline (-o). No op event is sent; the counts must be llama.cpp's own: with
GGML_SCHED_DEBUG=2 it prints every graph it schedules and which nodes it computes, and every
thread of its CPU backend runs every computed node once per compute. So each phase's count of
an op type is that type's computed nodes in the graph x the phase's decode calls (llama.cpp's
own count of its eval runs) x the threads. Times are checked only against what cannot be
exceeded (a phase's op time within its calls' time on every thread): how they compare with a
recording's is a measurement (bench/cost_check.py), not a test."""
from __future__ import annotations

from collections import Counter

import pytest

from conftest import completion_cmd, llama_perf, run_profinfer, with_llama_log
from test_dag import _NODE

THREADS = 2


def printed_compositions(log: str) -> list[Counter]:
    """Per graph llama.cpp printed, its computed nodes by op (ggml_op_desc, 10 characters)."""
    graphs: list[Counter] = []
    for line in log.splitlines():
        if "## SPLIT #0" in line:
            graphs.append(Counter())
            continue
        m = _NODE.search(line)
        if m and graphs and m.group(5) == "1":
            graphs[-1][m.group(2).strip()] += 1
    return graphs


def as_printed(ops: list[dict]) -> Counter:
    """Counted ops as llama.cpp prints nodes: a fused pair ("RMS_NORM+MUL") is its two nodes,
    a GLU is named by its kind (SWIGLU, GEGLU, ...: ggml_op_desc), names cut to 10."""
    out: Counter = Counter()
    for o in ops:
        for op in o["op"].split("+"):
            out["*GLU" if op == "GLU" else op[:10]] += o["count"]
    return out


@pytest.mark.parametrize("design", ["one-probe", "two-probe"])
def test_counted_ops_are_llama_cpps_nodes_per_phase(llama_build, tiny_model, llama_env, tmp_path, design):
    env = {**llama_env, "GGML_SCHED_DEBUG": "2", "PROFINFER_OP_DESIGN": design}
    r = with_llama_log(lambda: run_profinfer(
        ["record", "--quiet", "--", *completion_cmd(llama_build, tiny_model, n=6, threads=THREADS,
                                                    extra=("-v",))], env=env, tmp_path=tmp_path))
    assert r.rc == 0, r.stderr[-2000:]
    s = r.summary
    meta = s["meta"]
    assert meta["op_level"] == "counted" and s["lost_events"] == 0
    # no node was described or sent: the events are the decode calls and graph computes
    assert "node_descriptions" not in meta
    assert int(meta["events"]) <= 4 * s["decode_calls"]
    # llama.cpp's graph: the same computed nodes in every graph it printed (this model's
    # prompt and decode graphs differ in shapes only)
    printed = printed_compositions(r.stderr)
    assert printed and all(g == printed[0] for g in printed), printed
    graph = Counter({("*GLU" if op.endswith("GLU") else op): n for op, n in printed[0].items()})
    perf = llama_perf(r.stderr)
    prompt_tokens, eval_runs = perf["prompt eval"][1], perf["eval"][1]
    assert prompt_tokens < 2048        # one prompt batch (llama-completion's -b 2048)
    for phase, calls in (("prefill", 1), ("decode", eval_runs)):
        ops = s["phases"][phase]["ops"]
        assert as_printed(ops) == Counter({op: n * calls * THREADS for op, n in graph.items()}), phase
        # a fused pair is counted as one op, as the op level's events name it
        assert any("+" in o["op"] for o in ops)
        # times: every op counted some, and a phase's ops fit in its calls on every thread
        assert all(o["total_ns"] > 0 for o in ops)
        assert 0 < s["phases"][phase]["op_ns"] <= THREADS * s["time_ns"][phase]
    assert set(s["phases"]) == {"prefill", "decode"}       # no op outside a call ("other")
    assert all(o["p50_ns"] is None for o in s["ops"])     # no single run was kept
    if design == "one-probe":     # a trap as the target meets it, from the fused ops BPF kept
        assert 0 < int(meta["trap_in_situ_ns"]) < 20_000
    assert "op level counted in BPF per op type and phase" not in r.stdout   # --quiet


def test_a_timeline_records_every_node_and_counts_the_same(llama_build, tiny_model, llama_env, tmp_path):
    """-o records every node (percentiles, threads' op time); its ops per type and phase are
    those counted without it. The report says which views are counted and how to get the
    others."""
    cmd = completion_cmd(llama_build, tiny_model, n=8, threads=THREADS)
    counted = run_profinfer(["record", "--", *cmd], env=llama_env, tmp_path=tmp_path)
    assert counted.rc == 0, counted.stderr[-2000:]
    assert "op level counted in BPF per op type and phase (no timeline asked)" in counted.stdout
    assert "-o trace.pftrace records every node" in counted.stdout
    trace = tmp_path / "t.pftrace"
    nodes = run_profinfer(["record", "-o", str(trace), "--", *cmd], env=llama_env, tmp_path=tmp_path)
    assert nodes.rc == 0, nodes.stderr[-2000:]
    assert "op_level" not in nodes.summary["meta"] and "counted in BPF" not in nodes.stdout
    assert all(o["p50_ns"] is not None for o in nodes.summary["ops"])
    assert any(t["op_ns"] for t in nodes.summary["threads"])
    by_phase = lambda s: {p: {o["op"]: o["count"] for o in v["ops"]} for p, v in s["phases"].items()}
    assert by_phase(counted.summary) == by_phase(nodes.summary)
    assert all(t["op_ns"] is None for t in counted.summary["threads"])


@pytest.mark.parametrize("why, args", [("--counters are read per node", ["--counters", "task-clock"]),
                                       ("the sched level's time per op needs every node",
                                        ["--levels", "token,graph,op,sched"])])
def test_views_that_need_every_node_record_them(llama_build, tiny_model, llama_env, tmp_path, why, args):
    r = run_profinfer(["record", "--quiet", *args, "--", *completion_cmd(llama_build, tiny_model, n=4)],
                      env=llama_env, tmp_path=tmp_path)
    assert r.rc == 0, r.stderr[-2000:]
    assert r.summary["meta"]["op_level"] == f"nodes ({why})"
    assert int(r.summary["meta"]["node_descriptions"]) > 0
