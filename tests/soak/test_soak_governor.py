"""The governor against time: a watched engine's rate, in alternating windows against an
identical unwatched one (governed.py), at most the budget lower than their ratio before the
daemon started, where the windows resolve it. A timed cost: its figures go to
bench/results.md (bench/daemon_governor.py measures it at length). And what it charges a
watched process: its own watching thread's CPU alone, measured in windows beside a thread
that burns CPU (was in tests/daemon/test_http.py)."""
from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest

from conftest import Target, endless_cmd
from daemon_helpers import _STARTED, Daemon, _get, kill_started


def test_governor_keeps_the_budget_against_time(tmp_path, llama_build, tiny_model, llama_env):
    """The tiny model under `--levels token,graph,op --budget 0.04` (its op level costs more:
    its ops take microseconds). Loaded, the op level goes within 10 s; settled, the levels kept
    are what the governor's stated cost allows, and the governed server's decode rate, against
    an identical unwatched server's in alternating windows (governed.py), is at most 4% lower
    than their ratio before the daemon started, where the windows resolve it; its op-level
    counts up to the step down are kept; idle, the last level taken comes back after its wait."""
    from governed import (a_level_comes_back_idle, alternate, cost_against_before, loaded_until_settled,
                          server_window, twin_servers)
    d = None
    try:
        a, b, url_a, url_b, n = twin_servers(llama_build, tiny_model, llama_env, tmp_path, _STARTED)
        # before the daemon: what A/B is with nothing watching
        before = alternate(server_window(url_a), server_window(url_b), 8, n)
        d = Daemon(tmp_path, ("--levels", "token,graph,op", "--budget", "0.04"))
        assert sorted(d.watched(a.pid)["levels"]) == ["graph", "op", "token"], d.text()
        status = json.loads(_get(d.url + "/status")[1])
        assert b.pid not in {p["pid"] for p in status["processes"]}, status
        assert status["trap_costs_source"].startswith(("cached calibration", "measured at start")), status

        # loaded (generating without a pause, in a thread): the op level goes within 10 s
        stepped, info = loaded_until_settled(d, a.pid, url_a, f"PID {a.pid}: levels graph,op,token -> graph,token (")
        assert stepped is not None and stepped <= 10, (stepped, d.text())
        assert "op" not in info["levels"] and "budget 4.0%" in d.text()
        # the levels it keeps are what its last judgment allowed: under the budget, or the floor
        settled = info["levels"]
        assert info["cost_share"] is not None and (info["cost_share"] <= 0.04 or settled == ["token"]), info
        assert info["cost_by_level"]["token"] > 0, info         # the floor's own cost, stated

        rates = alternate(server_window(url_a), server_window(url_b), 8, n)
        cost, se = cost_against_before(before, rates)
        timed = (f"timed cost {cost:+.1%} +- {se:.1%} in 8 pairs of {n} tokens at {settled} "
                 f"(A, B before the daemon: {before}; governed: {rates})")
        print(timed)

        text = _get(d.url + "/metrics")[1].decode()
        assert any(l.startswith("profinfer_op_calls_total{") and f'pid="{a.pid}"' in l and 'op="MUL_MAT"' in l
                   for l in text.splitlines())
        assert any(l.startswith("profinfer_overhead_ratio_by_level{") and f'pid="{a.pid}"' in l
                   and 'level="token"' in l for l in text.splitlines())

        a_level_comes_back_idle(d, a.pid, url_a, ["graph", "op", "token"])
    finally:
        kill_started()
        if d is not None:
            d.stop()
    # the cost must be under the budget within 3 standard errors of the windows' median ratio
    # (measured), however noisy; where they are noisier than TIMED_NOISE_MAX (other work on the
    # machine) that does not resolve 4%: said, as a skip
    from governed import TIMED_NOISE_MAX
    assert cost <= 0.04 + 3 * se, timed
    if se >= TIMED_NOISE_MAX:
        pytest.skip(f"{timed}: within the budget only as far as windows this noisy tell: 4% not resolved "
                    "(bench/daemon_governor.py measures it)")


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


def _levels(d: Daemon, pid: int) -> list[str]:
    return d.watched(pid)["levels"]


# vLLM's batches vary more from one window to the next than llama-server's tokens: more pairs
PAIRS = 12


def test_the_governor_charges_only_the_thread_that_watches(llama_build, tiny_model, llama_env):
    """The agent in this process, watching a llama.cpp process that generates without end,
    while another thread of this process burns CPU (as HTTP threads answering a flood do):
    the cost share it reports for the process stays what it was without it. Charging the
    whole process's CPU would add (that thread's CPU / the process's CPU), measured here."""
    from profinfer.daemon.agent import Agent
    target = Target(endless_cmd(llama_build, tiny_model), llama_env)
    pid = target.proc.pid
    agent = Agent({"token", "graph"}, 0.04, discover_processes=False)
    try:
        def run(seconds: float) -> list[float]:
            shares, end = [], time.monotonic() + seconds
            while time.monotonic() < end:
                before = agent.watches[pid].cost_mark if pid in agent.watches else None
                agent.poll(0.2)
                w = agent.watches.get(pid)
                if w is not None and w.share is not None and w.cost_mark is not before:
                    shares.append(w.share)
            return shares

        def cpu(p: int) -> float:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

        run(3)
        assert pid in agent.watches
        quiet = run(6.5)      # a judgment each GOVERN_S (2 s): 3 or 4 a window
        stop, burned = threading.Event(), []

        def burn():
            began = time.thread_time()
            while not stop.is_set():
                sum(range(20000))
            burned.append(time.thread_time() - began)
        t0 = cpu(pid)
        burner = threading.Thread(target=burn)
        burner.start()
        try:
            loud = run(6.5)
        finally:
            stop.set()
            burner.join()
        added = burned[0] / (cpu(pid) - t0)
        print(f"quiet {quiet} loud {loud} added {added:.3f}")
        assert len(quiet) >= 2 and len(loud) >= 2, (quiet, loud)
        assert added > 4 * max(quiet), (added, quiet)     # what charging it would show: plain
        assert max(loud[1:]) < max(quiet) + added / 4, (quiet, loud, added)
    finally:
        agent.close()
        target.stop()
