"""MoE expert statistics (issue 3, acceptance 4) on a random-weight MoE model: 8 experts per
layer, 2 used per token, 4 layers."""
from __future__ import annotations

import pytest

from conftest import completion_cmd, llama_perf, run_profinfer, with_llama_log
from profinfer.exporters.trace_reader import read_trace
from profinfer.moe import compute


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
