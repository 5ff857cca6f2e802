"""vLLM, offline generation: every native op call and every step, against the process's own
truth (torch.profiler with record_shapes, and the engine's scheduler outputs), in eager and
in the default compiled mode."""
from __future__ import annotations

import json
import subprocess
import threading
from collections import Counter
from pathlib import Path

import pytest

from conftest import PROFINFER, start_profinfer

TRUTH_SCRIPT = Path(__file__).with_name("offline_truth.py")
# torch.profiler's dtype names for the ScalarTypes seen (c10's C++ type names)
PROFILER_DTYPES = {"c10::BFloat16": "bfloat16", "float": "float32", "int": "int32",
                   "long int": "int64", "signed char": "int8", "c10::Half": "float16",
                   "double": "float64", "bool": "bool", "unsigned char": "uint8", "short int": "int16"}


def _key(op: str, args: dict) -> tuple:
    return (op, tuple(sorted((name, None if a is None else (a["dtype"], tuple(a["shape"])))
                             for name, a in args.items())))


def _truth_key(call: dict) -> tuple:
    args = {name: None if a is None else {"dtype": PROFILER_DTYPES.get(a["dtype"], a["dtype"]),
                                          "shape": a["shape"]}
            for name, a in call["args"].items()}
    return _key(call["op"], args)


def run_offline(vllm_python, vllm_model, mode: str, tmp_path: Path) -> tuple[dict, dict, str]:
    go, truth_path, summary_path = tmp_path / "go", tmp_path / "truth.json", tmp_path / "summary.json"
    target = subprocess.Popen([str(vllm_python), str(TRUTH_SCRIPT), str(vllm_model), mode, str(go),
                               str(truth_path)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        seen = []
        for line in target.stdout:              # vLLM logs to stdout too
            seen.append(line)
            if line.strip() == "READY":
                break
        assert seen and seen[-1].strip() == "READY", "".join(seen[-20:])
        threading.Thread(target=target.stdout.read, daemon=True).start()
        prof = start_profinfer(["attach", "--pid", str(target.pid), "--json", str(summary_path),
                                "-o", str(tmp_path / "trace.pftrace"), "--quiet"])
        go.touch()
        assert target.wait(timeout=300) == 0
        _, err = prof.communicate(timeout=120)
        assert prof.returncode == 0, prof.early_stderr + err
    finally:
        if target.poll() is None:
            target.kill()
    return (json.loads(truth_path.read_text()), json.loads(summary_path.read_text()),
            prof.early_stderr + err)


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_ops_and_steps_equal_the_process_own_record(vllm_python, vllm_model, mode, tmp_path):
    truth, summary, err = run_offline(vllm_python, vllm_model, mode, tmp_path)
    assert summary["lost_events"] == 0
    assert summary["meta"]["engine"] == "vLLM"
    # every native op call, by op and by each tensor argument's dtype and shape (an empty
    # optional: None), exactly as torch.profiler recorded them in the same process
    want = Counter(_truth_key(c) for c in truth["calls"])
    got = Counter()
    for row in summary["op_shapes"]:
        got[_key(row["op"], row["args"])] += row["count"]
    assert got == want
    assert len(truth["calls"]) >= 300
    ops = {o["op"] for o in summary["ops"]}
    assert {"cpu_attention_with_kv_cache", "cpu_attn_reshape_and_cache"} <= ops
    # eager runs rotary embedding as a native op; compiled makes it a generated kernel
    assert ("rotary_embedding" in ops) == (mode == "eager")
    if mode == "compiled":
        assert "compiled" in summary["meta"]["mode"] and "rotary" in summary["meta"]["unobserved"]
    else:
        assert summary["meta"]["mode"] == "eager"
    # steps: as many as the scheduler made, each with its requests' new tokens
    steps = summary["step_list"]
    assert len(steps) == len(truth["steps"]) == 12
    assert [sorted(s["query_lens"]) for s in steps] == truth["steps"]
    assert [s["tokens"] for s in steps] == [sum(t) for t in truth["steps"]]
    assert [s["phase"] for s in steps] == ["prefill"] + ["decode"] * 11
    assert summary["tokens"] == {"prefill": sum(truth["steps"][0]), "decode": 11 * 4}
    # every call from the first step's start on falls in one step: all but the first
    # step's input preparation (its slot mapping comes before its scheduler metadata)
    assert sum(s["calls"] for s in steps) == len(truth["calls"]) - 1
    # the Perfetto trace holds the same: `report` of it gives the same summary
    reread = tmp_path / "reread.json"
    r = subprocess.run([*PROFINFER, "report", str(tmp_path / "trace.pftrace"), "--json", str(reread)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    again = json.loads(reread.read_text())
    for key in ("ops", "op_shapes", "step_list", "tokens", "phases", "lost_events"):
        assert again[key] == summary[key], key


def test_op_discovery_covers_every_isa_variant(vllm_python):
    """The three CPU builds (AVX-512 with bf16, AVX-512, AVX2) are read the same way: their
    ops come from their own schemas and symbols, none written in profinfer."""
    from profinfer.engines.vllm.ops import native_ops
    from profinfer.symbols import load_elf
    site = next((Path(vllm_python).parent.parent / "lib").glob("python3*/site-packages/vllm"))
    for lib in ("_C.abi3.so", "_C_AVX512.abi3.so", "_C_AVX2.abi3.so"):
        ops, _ = native_ops(load_elf(str(site / lib)))
        names = {o.name: o for o in ops}
        assert {"cpu_attention_with_kv_cache", "cpu_attn_reshape_and_cache", "rotary_embedding",
                "get_scheduler_metadata"} <= set(names), lib
        # a returned tensor takes the hidden pointer: greedy_argmax's logits arrive in rsi
        assert names["greedy_argmax"].slots == (1,)
