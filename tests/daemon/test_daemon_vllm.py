"""vLLM in the daemon: a real vLLM generation (CPU) found by the daemon and watched at its
step level (the op that begins each step, probed on torch's wrappers for it, shared per build), its steps and
tokens counted as vLLM's own scheduler made them (the generation records its scheduler's
outputs: tests/vllm/offline_truth.py)."""
from __future__ import annotations

import json
import threading
import time
from collections import Counter

import pytest
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
        # an entry and an end probe on torch's boxed kernel wrapper for get_scheduler_metadata's
        # signature, which Python's calls reach (the typed one, which C++ callers would, shows
        # no place where a call has ended, and is not probed: wrappers.py)
        assert group["engine"] == "vLLM" and group["probes"] == 2, group
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
        # the linear layers' op (the CPU's: SGL's packed kernel, or oneDNN's with AVX-512 bf16)
        assert {"weight_packed_linear", "onednn_mm"} & set(got) and "get_scheduler_metadata" in got
    finally:
        if d is not None:
            d.stop()
        kill_started()


def test_governor_keeps_vllms_budget_against_time(vllm_python, vllm_model, tmp_path):
    """A vLLM engine under `--levels token,op --budget 0.04`: loaded, its op level (a trap on
    every native op call, charged against the thread that makes them) goes within 10 s;
    settled, the engine's batch rate, against an identical unwatched engine's in alternating
    windows (governed.py), is at most 4% lower than their ratio before the daemon started,
    where the windows resolve it; idle, the op level comes back after its wait."""
    from governed import (TIMED_NOISE_MAX, VllmOnDemand, alternate, copied_vllm, cost_against_before,
                          stepped_then_settled)
    a = VllmOnDemand(vllm_python, vllm_model)       # first: the lower PID, which the daemon's scan finds first
    _STARTED.append(a.proc)
    b = VllmOnDemand(vllm_python, vllm_model, pythonpath=copied_vllm(vllm_python, tmp_path / "twin"))
    _STARTED.append(b.proc)
    d = None
    try:
        a.ready()
        b.ready()
        a.window(3)
        n = max(5, min(100, int(b.window(5) * 2.5)))    # windows of ~2.5 s at B's rate now
        before = alternate(a.window, b.window, PAIRS, n)
        d = Daemon(tmp_path, ("--levels", "token,op", "--budget", "0.04", "--max-processes", "1"))
        deadline, info = time.monotonic() + 60, {}
        while time.monotonic() < deadline and "op" not in info.get("levels", ()):
            info = d.watched(a.pid, timeout=30)
            time.sleep(0.2)
        assert info["engine"] == "vLLM" and info["levels"] == ["op", "step"], (info, d.text())
        status = json.loads(_get(d.url + "/status")[1])
        assert b.pid not in {p["pid"] for p in status["processes"]}, status

        load, failed = threading.Event(), []
        load.set()

        def loading():
            try:
                for _ in iter(load.is_set, False):
                    a.window(n)
            except Exception as e:          # said by the test's thread, not lost with this one
                failed.append(e)

        loader = threading.Thread(target=loading)
        loader.start()
        try:
            stepped, info = stepped_then_settled(d, a.pid, f"PID {a.pid}: levels op,step -> step (")
            assert stepped is not None and stepped <= 10, (stepped, d.text())
        finally:
            load.clear()
            loader.join()
        assert not failed, failed
        # the floor's cost is stated, whatever it is (it stays: nothing is stepped below it)
        assert info["levels"] == ["step"] and info["cost_share"] is not None, info
        assert info["cost_by_level"]["step"] > 0, info        # the floor's own cost, stated

        rates = alternate(a.window, b.window, PAIRS, n)
        cost, se = cost_against_before(before, rates)
        timed = (f"timed cost {cost:+.1%} +- {se:.1%} in {PAIRS} pairs of {n} batches at {info['levels']} "
                 f"(A, B before the daemon: {before}; governed: {rates})")
        print(timed)

        # the op level comes back after its wait (if the governor gave it back meanwhile, with
        # room at the floor's cost, loaded until it goes again); said as "(idle)" or, where the
        # wait ran out under the last load before the daemon saw it idle, "(costs .., room ..)"
        if _levels(d, a.pid) == ["op", "step"]:
            count, deadline = d.text().count(f"PID {a.pid}: levels"), time.monotonic() + 30
            while time.monotonic() < deadline and d.text().count(f"PID {a.pid}: levels") == count:
                a.window(n)
        assert _levels(d, a.pid) == ["step"], d.text()
        came_back = f"PID {a.pid}: levels step -> op,step ("
        before = d.text().count(came_back)
        wait = d.watched(a.pid)["step_up_wait_s"] + 3 * 2.0 + 2 * 2.0 + 5
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and _levels(d, a.pid) == ["step"]:
            time.sleep(0.5)
        assert _levels(d, a.pid) == ["op", "step"], (wait, d.text())
        deadline = time.monotonic() + 5        # logged once its levels have changed
        while time.monotonic() < deadline and d.text().count(came_back) == before:
            time.sleep(0.2)
        assert d.text().count(came_back) == before + 1, d.text()
    finally:
        if d is not None:
            d.stop()
        kill_started()
    assert cost <= 0.04 + 3 * se, timed       # however noisy (see the llama.cpp test)
    if se >= TIMED_NOISE_MAX:
        pytest.skip(f"{timed}: within the budget only as far as windows this noisy tell: 4% not resolved")


# vLLM's batches vary more from one window to the next than llama-server's tokens: more pairs
PAIRS = 12


def _levels(d: Daemon, pid: int) -> list[str]:
    return d.watched(pid)["levels"]
