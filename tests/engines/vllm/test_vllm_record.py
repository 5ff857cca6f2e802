"""`profinfer record` of a plain vLLM generation: vLLM runs the model in an EngineCore child
it forks and loads its `_C` library there late; the follower probes it before its first op.
The steps and their tokens must be the engine's own counts for every request."""
from __future__ import annotations

import json
import subprocess
from conftest import PROFINFER

from profinfer.engines.vllm import workload

SCRIPT = workload.GENERATE


def test_record_follows_vllm_into_its_engine_process(vllm_python, vllm_model, tmp_path):
    out, summary_path = tmp_path / "generated.json", tmp_path / "summary.json"
    p = subprocess.run([*PROFINFER, "record", "--json", str(summary_path), "--quiet", "--",
                        str(vllm_python), str(SCRIPT), str(vllm_model), "8", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    engine = json.loads(out.read_text())         # the engine's own counts
    requests = engine["requests"]
    summary = json.loads(summary_path.read_text())
    assert summary["lost_events"] == 0
    assert int(summary["meta"]["processes_followed"]) > 1
    # every prompt token in a prefill step; one decode token per generated token after the
    # first, which the prefill step samples: nothing before the engine's first op was missed
    assert summary["tokens"] == {
        "prefill": sum(r["prompt_tokens"] for r in requests),
        "decode": sum(r["generated"] - 1 for r in requests)}
    assert max(len(s["query_lens"]) for s in summary["step_list"]) == len(requests)
    assert summary["steps"] == engine["steps"] > 0
    # one attention call a layer (the model's config) in each of the engine's own steps
    layers = json.loads((vllm_model / "config.json").read_text())["num_hidden_layers"]
    ops = {o["op"]: o["count"] for o in summary["ops"]}
    assert ops["cpu_attention_with_kv_cache"] == layers * engine["steps"]
