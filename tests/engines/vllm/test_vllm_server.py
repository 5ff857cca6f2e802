"""vLLM's OpenAI server as shipped (the API server, its EngineCore child, the worker child
that runs the model): attach to the API server's PID during a bounded burst of concurrent
requests; the worker's ops are recorded, nothing is lost, the responses are the same as
without profiling, and the steps' tokens are the server's own token counts."""
from __future__ import annotations

import json
import signal
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import psutil

from conftest import start_profinfer, vllm_steps

PROMPTS = ["hello world model token", "the cache of the attention", "query key value",
           "a thread of the server engine", "graph node shape tensor", "the request and the step"]
MAX_TOKENS = 10


def _post(port: int, prompt: str) -> dict:
    body = json.dumps({"model": "m", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                       "ignore_eos": True}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def _burst(port: int) -> list[dict]:
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(lambda p: _post(port, p), PROMPTS))


def test_attach_to_the_api_server_records_its_worker(vllm_api, vllm_model, tmp_path):
    proc, port = vllm_api()         # the session's (conftest.KEPT): perhaps a daemon watched it before
    unprofiled = _burst(port)
    steps_before = vllm_steps(port)
    summary_path = tmp_path / "summary.json"
    prof = start_profinfer(["attach", "--pid", str(proc.pid), "--json", str(summary_path), "--quiet"])
    try:
        profiled = _burst(port)
    finally:
        prof.send_signal(signal.SIGINT)
        _, err = prof.communicate(timeout=120)
    assert prof.returncode == 0, prof.early_stderr + err
    steps = vllm_steps(port) - steps_before           # the server's own count, scraped here
    summary = json.loads(summary_path.read_text())
    assert len(summary["step_list"]) == steps, (len(summary["step_list"]), steps)

    texts = lambda rs: [r["choices"][0]["text"] for r in rs]   # noqa: E731
    assert texts(profiled) == texts(unprofiled)               # greedy: profiling changes nothing
    assert summary["lost_events"] == 0
    # the ops ran in the worker, a descendant of the API server, not in the server itself
    op_pids = {int(p) for p in summary["meta"]["op_processes"].split(",")}
    children = {c.pid for c in psutil.Process(proc.pid).children(recursive=True)}
    assert op_pids and op_pids <= children and proc.pid not in op_pids
    ops = {o["op"]: o["count"] for o in summary["ops"]}
    # one attention call a layer in each of the server's own steps (the model's config)
    layers = json.loads((vllm_model / "config.json").read_text())["num_hidden_layers"]
    assert ops["cpu_attention_with_kv_cache"] == layers * steps
    # the steps' tokens are the server's own counts: every prompt token in a prefill, and one
    # decode token per generated token after the first (which the prefill step samples)
    prompt_tokens = sum(r["usage"]["prompt_tokens"] for r in profiled)
    generated = sum(r["usage"]["completion_tokens"] for r in profiled)
    assert generated == MAX_TOKENS * len(PROMPTS)
    assert summary["tokens"] == {"prefill": prompt_tokens, "decode": generated - len(PROMPTS)}
    assert sum(s["tokens"] for s in summary["step_list"]) == prompt_tokens + generated - len(PROMPTS)
    # the server's /metrics as profinfer scraped them at attach and at the end: the same
    # steps and prompt tokens
    server = {r["what"]: r for r in summary["server_metrics"]}
    assert server["steps"]["server"] == server["steps"]["ours"] == len(summary["step_list"])
    assert server["prompt tokens"]["server"] == server["prompt tokens"]["ours"] == prompt_tokens
    assert server["generated tokens"]["server"] == generated
    assert server["requests finished"]["server"] == len(PROMPTS)
