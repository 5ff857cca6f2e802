"""vLLM in the daemon: a real vLLM engine (CPU; the module's, conftest.vllm_engine) found by
the daemon and watched at its step level (the op that begins each step, probed on torch's
wrappers for it, shared per build), its steps and tokens counted as vLLM's own scheduler made
them (each generation records its scheduler's outputs: tests/engines/vllm/offline_truth.py). The
daemon, stopped, leaves nothing attached in the engine."""
from __future__ import annotations

import json
import time
from collections import Counter

from conftest import VLLM_NATIVE_LINEAR
from daemon_helpers import Daemon, _get, kill_started, series


def test_vllm_steps_in_the_daemon_equal_its_scheduler(vllm_engine, tmp_path, bpf_watch):
    truth_path = tmp_path / "truth.json"
    target = vllm_engine("eager")
    d = None
    try:
        # the daemon starts after the engine's warm-up and its earlier generations, which
        # this generation's truth leaves out
        d = Daemon(tmp_path)
        info = d.watched(target.pid, timeout=30)
        assert info["engine"] == "vLLM" and info["levels"] == ["step"], info
        status = json.loads(_get(d.url + "/status")[1])
        group = next(g for g in status["shared_probes"] if target.pid in g["processes"])
        # an entry and an end probe on torch's boxed kernel wrapper for get_scheduler_metadata's
        # signature, which Python's calls reach (the typed one, which C++ callers would, shows
        # no place where a call has ended, and is not probed: wrappers.py)
        assert group["engine"] == "vLLM" and group["probes"] == 2, group
        # it generates for 8 s (its prompts again and again, its steps alone recorded): the
        # governor's judgments (one each 2 s, of the CPU since the last) see windows with steps
        # whatever the machine's load; meanwhile it charges the engine its share of the shared
        # step probes (its floor: nothing to step down, the level stays)
        target.start(truth_path, seconds=8)
        charged, deadline = {}, time.monotonic() + 300
        while time.monotonic() < deadline and not truth_path.exists():
            found = [p for p in json.loads(_get(d.url + "/status")[1])["processes"] if p["pid"] == target.pid]
            if found and found[0]["cost_by_level"].get("step", 0) > charged.get("cost_by_level", {}).get("step", 0):
                charged = found[0]       # a window with steps (the last ones may have none)
            time.sleep(0.5)
        truth = target.finish()
        assert charged and set(charged["cost_by_level"]) == {"step", "daemon"} and charged["levels"] == ["step"], charged
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
        # a shortfall says whether records were lost (a starved reader) or miscounted
        lost = series(text, "profinfer_events_lost_total", target.pid, None)
        assert got == want_tokens, f"events lost {lost}\n" + d.text()
        assert series(text, "profinfer_decode_calls_total", target.pid, "phase") == want_calls
        assert want_tokens["decode"] > 0 and want_tokens["prefill"] > 0
    finally:
        if d is not None:
            d.stop()
        kill_started()
    left = bpf_watch.leftovers({target.pid})
    assert not left, left


def test_vllm_op_level_in_the_daemon_counts_every_native_op_call(vllm_engine, tmp_path, bpf_watch):
    """At the op level (asked for, in budget), the daemon counts vLLM's native op calls in BPF
    per op (its step op's calls and attention's, which are sent, counted too): by op, as many
    as torch.profiler recorded in the same process."""
    truth_path = tmp_path / "truth.json"
    target = vllm_engine("eager")
    d = None
    try:
        d = Daemon(tmp_path, ("--levels", "token,op", "--budget", "1.0"))
        deadline, info = time.monotonic() + 60, {}
        while time.monotonic() < deadline and "op" not in info.get("levels", ()):
            info = d.watched(target.pid, timeout=30)
            time.sleep(0.2)
        assert info["engine"] == "vLLM" and info["levels"] == ["op", "step"], (info, d.text())
        truth = target.generate(truth_path)
        want = {op: float(n) for op, n in Counter(c["op"] for c in truth["calls"]).items()}
        deadline, got = time.monotonic() + 15, {}
        while time.monotonic() < deadline and got != want:       # drained
            got = series(_get(d.url + "/metrics")[1].decode(), "profinfer_op_calls_total", target.pid, "op")
            time.sleep(0.2)
        assert got == want, d.text()
        # the linear layers' op where the CPU's build has one (SGL's packed kernel, or oneDNN's
        # with AVX-512), and none where it has AVX2 alone
        assert bool({"weight_packed_linear", "onednn_mm"} & set(got)) == VLLM_NATIVE_LINEAR, got
        assert "get_scheduler_metadata" in got
    finally:
        if d is not None:
            d.stop()
        kill_started()
    left = bpf_watch.leftovers({target.pid})
    assert not left, left
