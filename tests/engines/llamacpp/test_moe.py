"""MoE expert statistics on a random-weight MoE model: 8 experts per
layer, 2 used per token, 4 layers; the routing itself against llama.cpp's own printout."""
from __future__ import annotations

import re

import numpy as np
import pytest

from conftest import completion_cmd, llama_perf, run_profinfer, with_llama_log
from profinfer.exporters.trace_reader import read_trace
from profinfer.engines.llamacpp.views.moe import compute, routing
from profinfer.engines.llamacpp.workload import llama_bin


@pytest.mark.parametrize("buffer", ["ring", "perf"])
def test_expert_activations_are_exact(llama_build, moe_model, llama_env, tmp_path, buffer):
    trace = tmp_path / "moe.pftrace"
    r = with_llama_log(lambda: run_profinfer(
        ["record", "--quiet", "--buffer", buffer, "-o", str(trace), "--",
         *completion_cmd(llama_build, moe_model, n=12)], env=llama_env, tmp_path=tmp_path))
    assert r.rc == 0, r.stderr[-2000:]
    perf = llama_perf(r.stderr)
    prompt_tokens, decode_tokens = perf["prompt eval"][1], perf["eval"][1]
    m = r.summary["moe"]
    assert (m["n_experts"], m["n_used"], m["layers"]) == (8, 2, [0, 1, 2, 3])
    per_layer = {p: [sum(row) for row in c] for p, c in m["by_phase"].items()}
    # decode: every token is routed in every layer
    assert per_layer["decode"] == [decode_tokens * 2] * 4
    # prefill: llama.cpp computes the last layer only for the tokens whose logits it needs
    # (one here), the others for every prompt token
    assert per_layer["prefill"] == [prompt_tokens * 2] * 3 + [1 * 2]
    assert m["activations"] == (decode_tokens + prompt_tokens) * 2 * 3 + (decode_tokens + 1) * 2
    # each token's two experts are distinct ids of this model: real routing, not garbage
    prof = read_trace(trace)
    rows = [row for o in prof.ops if o.experts for row in o.experts]
    assert rows and all(len(set(row)) == 2 and all(0 <= e < 8 for e in row) for row in rows)
    assert compute(prof).total == m["activations"]      # the same from the saved trace


_TOPK = re.compile(r"ffn_moe_topk-(\d+) = \(i32\)[^\n]*= \{(\d+), (\d+), 1, 1\}\n(.*?)\n\s*sum =", re.S)
_ROW = re.compile(r"^\[\s*(-?\d+\.\d+(?:,\s*-?\d+\.\d+)*)\s*\],$")


def printed_routing(text: str) -> dict[int, tuple[int, dict[int, tuple[int, ...]]]]:
    """llama.cpp's own top-k expert ids, as llama-eval-callback prints the `ffn_moe_topk-L`
    tensors: {layer: (tokens, {token: experts})}. Of more than 6 tokens it prints the first
    and last 3."""
    out = {}
    for m in _TOPK.finditer(text):
        layer, n_tokens = int(m.group(1)), int(m.group(3))
        head, tail, gap = [], [], False
        for line in m.group(4).splitlines():
            line = line.strip()
            if line.startswith("...,"):
                gap = True
            elif (row := _ROW.match(line)):
                (tail if gap else head).append(tuple(int(float(v)) for v in row.group(1).split(",")))
        rows = dict(enumerate(head)) | {n_tokens - len(tail) + i: r for i, r in enumerate(tail)}
        out[layer] = (n_tokens, rows)
    return out


def test_routing_equals_llama_cpp_own_tensors(llama_build, moe_model, llama_env, tmp_path):
    """Which experts each token went to, per layer, equals what llama.cpp itself printed in
    the same run (llama-eval-callback prints every named tensor, the router's top-k too)."""
    trace = tmp_path / "moe.pftrace"
    cmd = [str(llama_bin("llama-eval-callback", llama_build)), "-m", str(moe_model),
           "-p", "Once upon a time", "-t", "2", "--temp", "0", "--seed", "1", "-c", "256"]
    r = run_profinfer(["record", "--quiet", "-o", str(trace), "--", *cmd], env=llama_env,
                      tmp_path=tmp_path)
    assert r.rc == 0, r.stderr[-2000:]
    truth = printed_routing(r.stdout)
    assert sorted(truth) == [0, 1, 2, 3], r.stdout[-2000:]
    n_tokens = truth[0][0]
    # the prompt is short enough to be printed whole, and the last layer routes only the
    # token whose logits are asked for
    assert all(len(rows) == n for n, rows in truth.values())
    assert [n for n, _ in truth.values()] == [n_tokens] * 3 + [1]
    # a truth that tells a wrong row or a wrong layer apart (random weights could route
    # every token alike)
    assert len(set(truth[0][1].values())) > 1
    assert len({tuple(rows.values()) for _, rows in truth.values()}) == 4

    decisions = routing(read_trace(trace))
    assert sorted(d.layer for d in decisions) == [0, 1, 2, 3]     # one decode: one each
    for d in decisions:
        n, rows = truth[d.layer]
        assert d.phase == "prefill"
        assert d.experts == tuple(rows[t] for t in range(n)), (d.layer, d.experts, rows)
    # the --json summary counts the same routing, each decision once (the eval callback
    # splits the graph compute: a layer's three MUL_MAT_IDs run in separate backend computes)
    m = r.summary["moe"]
    want = np.zeros((4, 1 + max(e for _, rows in truth.values() for ex in rows.values() for e in ex)),
                    np.int64)
    for layer, (_, rows) in truth.items():
        for ex in rows.values():
            want[layer, list(ex)] += 1
    assert m["counts"] == want.tolist()
    assert m["routed_tokens"] == {"prefill": n_tokens}
