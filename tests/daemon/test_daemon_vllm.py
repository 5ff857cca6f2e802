"""vLLM in the daemon: a real vLLM generation (CPU) found by the daemon and watched at its
step level (the op that begins each step, probed on torch's wrappers for it, shared per build), its steps and
tokens counted as vLLM's own scheduler made them (the generation records its scheduler's
outputs: tests/vllm/offline_truth.py)."""
from __future__ import annotations

import json
import time
from collections import Counter

from conftest import start_vllm_truth
from daemon_helpers import _STARTED, Daemon, _get, kill_started, series


def test_vllm_steps_in_the_daemon_equal_its_scheduler(vllm_python, vllm_model, tmp_path):
    go, truth_path = tmp_path / "go", tmp_path / "truth.json"
    # it generates for 8 s (its prompts again and again, its steps alone recorded): the governor's judgments (one each
    # 2 s, of the CPU since the last) see windows with steps whatever the machine's load
    target = start_vllm_truth(vllm_python, vllm_model, "eager", go, truth_path, seconds=8)
    _STARTED.append(target)
    d = None
    try:
        # the daemon starts after the generation's warm-up, which the truth leaves out
        d = Daemon(tmp_path)
        info = d.watched(target.pid, timeout=30)
        assert info["engine"] == "vLLM" and info["levels"] == ["step"], info
        status = json.loads(_get(d.url + "/status")[1])
        group = next(g for g in status["shared_probes"] if target.pid in g["processes"])
        # entry and return on each of torch's two kernel wrappers for get_scheduler_metadata's
        # signature (the boxed one Python's calls reach, the typed one C++ callers would)
        assert group["engine"] == "vLLM" and group["probes"] == 4, group
        go.touch()
        # while it generates, the governor charges it its share of the shared step probes
        # (its floor: nothing to step down, the level stays)
        charged, deadline = {}, time.monotonic() + 300
        while target.poll() is None and time.monotonic() < deadline:
            found = [p for p in json.loads(_get(d.url + "/status")[1])["processes"] if p["pid"] == target.pid]
            if found and found[0]["cost_by_level"].get("step", 0) > charged.get("cost_by_level", {}).get("step", 0):
                charged = found[0]       # a window with steps (the last ones may have none)
            time.sleep(0.5)
        assert target.wait(timeout=10) == 0
        assert charged and set(charged["cost_by_level"]) == {"step", "daemon"} and charged["levels"] == ["step"], charged
        truth = json.loads(truth_path.read_text())
        # vLLM's rule: a sequence with one new token decodes; more, it prefills
        want_tokens = {"prefill": sum(q for s in truth["steps"] for q in s if q > 1),
                       "decode": sum(1 for s in truth["steps"] for q in s if q == 1)}
        phases = ["decode" if all(q == 1 for q in s) else "prefill" if all(q > 1 for q in s) else "mixed"
                  for s in truth["steps"]]
        want_calls = {p: float(phases.count(p)) for p in set(phases)}
        deadline, got = time.monotonic() + 15, {}
        while time.monotonic() < deadline:
            text = _get(d.url + "/metrics")[1].decode()
            got = {k: int(v) for k, v in series(text, "profinfer_tokens_total", target.pid, "phase").items()}
            if got == want_tokens:
                break
            time.sleep(0.3)
        assert got == want_tokens, d.text()
        assert series(text, "profinfer_decode_calls_total", target.pid, "phase") == want_calls
        assert want_tokens["decode"] > 0 and want_tokens["prefill"] > 0
    finally:
        if d is not None:
            d.stop()
        kill_started()


def test_vllm_op_level_in_the_daemon_counts_every_native_op_call(vllm_python, vllm_model, tmp_path):
    """At the op level (asked for, in budget), the daemon counts vLLM's native op calls in BPF
    per op (its step op's calls and attention's, which are sent, counted too): by op, as many
    as torch.profiler recorded in the same process."""
    go, truth_path = tmp_path / "go", tmp_path / "truth.json"
    target = start_vllm_truth(vllm_python, vllm_model, "eager", go, truth_path)
    _STARTED.append(target)
    d = None
    try:
        d = Daemon(tmp_path, ("--levels", "token,op", "--budget", "1.0"))
        deadline, info = time.monotonic() + 60, {}
        while time.monotonic() < deadline and "op" not in info.get("levels", ()):
            info = d.watched(target.pid, timeout=30)
            time.sleep(0.2)
        assert info["engine"] == "vLLM" and info["levels"] == ["op", "step"], (info, d.text())
        go.touch()
        assert target.wait(timeout=300) == 0
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if not any(p["pid"] == target.pid for p in json.loads(_get(d.url + "/status")[1])["processes"]):
                break                    # exited and drained
            time.sleep(0.2)
        got = series(_get(d.url + "/metrics")[1].decode(), "profinfer_op_calls_total", target.pid, "op")
        truth = json.loads(truth_path.read_text())
        want = Counter(c["op"] for c in truth["calls"])
        assert got == {op: float(n) for op, n in want.items()}, d.text()
        assert "weight_packed_linear" in got and "get_scheduler_metadata" in got
    finally:
        if d is not None:
            d.stop()
        kill_started()
