"""The flight recorder over minutes: five minutes of steady load make no capture; a
triggered capture's cost, stated and timed in alternating A/B windows, within the budget (its
figures go to bench/results.md); two real incidents one after the other, the newest kept
under the byte cap with the daemon's memory flat; and a vLLM burst of long prompts against
its steady decodes. (The default tier holds one real slowdown, tests/daemon/test_flight.py,
and the triggers' logic against injected series.)"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from conftest import PROFINFER, llama_server
from daemon_helpers import Daemon, _get
from test_flight import (BASELINE_LOAD_S, BASELINE_S, HOG, SAMPLED, STEADY_TRIGGERS, WINDOW_S, SteadyLoad, daemon_rss,
                         kept, made)

STEADY_S = 300
POLL_S = 10
# The load's windows make one prompt call (~20 tokens) a hundred decode calls: 1% of its
# batches above 4; a burst of prompts, most of them
BURST_TRIGGER = "batch_p98 > 4 for 1s"
# short windows, many: A against an alike B in alternate windows swings by ~5% from one pair
# to the next on this VM; 60 pairs resolved the cost to 2-2.5%, 200 to 1.0-1.2%
# (bench/results.md): 150 resolve it to about the 1.5% the timed assertion asks
PAIRS, WINDOW_TOKENS = int(os.environ.get("PROFINFER_CAPTURE_COST_PAIRS", 150)), 150   # more: a bench run
CAPTURE_S = max(60, round(0.75 * PAIRS))     # outlasts the windows it holds (~0.5 s a pair here)


def test_five_minutes_of_steady_load_make_no_capture(tmp_path, llama_build, tiny_model, llama_env):
    """A llama-server under steady concurrent load for 5 minutes, watched with the triggers an
    operator would set: nothing fires. Each
    trigger judged the whole run: from its first baseline on, every status poll shows
    it armed (its statistic against a limit), so a trigger that never judged cannot pass. The
    daemon's memory stays flat, and `profinfer status` prints each trigger's state."""
    store = tmp_path / "captures"
    with llama_server(llama_build, tiny_model, llama_env, 2) as (server, url):
        d = Daemon(tmp_path, ("--levels", "token,graph", "--budget", "0.25",
                              *(x for t in STEADY_TRIGGERS for x in ("--trigger", t)),
                              "--trigger-baseline", "60s", "--record-for", "2s", "--captures-dir", str(store)))
        polls, rss = [], []
        try:
            d.watched(server.pid)
            # each prompt read whole: a time to first token each (a prompt the server has
            # cached is read from its last token on, and follows on from the slot's last
            # sequence: no new sequence is seen)
            with SteadyLoad(url, cache_prompt=False) as load:
                started = time.monotonic()
                while time.monotonic() - started < STEADY_S:
                    time.sleep(POLL_S)
                    flight = json.loads(_get(d.url + "/status")[1])["flight_recorder"]
                    polls.append(next(p["triggers"] for p in flight["processes"] if p["pid"] == server.pid))
                    if len(polls) in (6, STEADY_S // POLL_S - 1):
                        rss.append(daemon_rss(d))
                caps, fired = kept(d), made(d)
                printed = subprocess.run([*PROFINFER, "status", "--url", d.url], capture_output=True, text=True,
                                         timeout=60)
        finally:
            d.stop()
    assert load.done > 100, load.done
    # no capture, or only of an incident the client saw too (this VM stalls a process for
    # seconds at times: a trigger that fires then is right). Its token gaps add HTTP's jitter to
    # the server's times: 0.8 of the limit.
    assert fired == len(caps), (fired, caps)
    for c in caps:
        saw = load.saw(c["fired"])
        print(f"captured: {c['fired']['trigger']} at {c['fired']['value']:.4g} (limit {c['fired']['limit']:.4g}); "
              f"the client saw {saw:.2f} of its limit")
        assert saw >= 0.8, (c, (tmp_path / "daemon.log").read_text())
    judged = polls[7:]          # from 80 s on: the baseline's whole window, its 10 s window, a recompute
    armed = {text: [p[i] for p in judged if p[i]["value"] is not None and p[i]["limit"] is not None]
             for i, text in enumerate(STEADY_TRIGGERS)}
    # the closest each came to its limit (value / limit; limit / value for a rate's '<')
    print("completions", load.done, "closest:", {text: max((p["limit"] / p["value"] if "<" in text else p["value"] / p["limit"])
                                                         for p in polls) if polls else None for text, polls in armed.items()})
    for i, text in enumerate(STEADY_TRIGGERS):
        assert len(armed[text]) == len(judged), (text, [p[i] for p in judged])
    assert rss[1] - rss[0] < 8 << 20, rss
    # each trigger's state: its statistic against its limit, or, after an incident the client
    # saw (above), its firing until it re-arms (a trigger that fires during the incident's
    # capture joins it: no capture of its own)
    for text in STEADY_TRIGGERS:
        states = ("now ", "fired ") if caps else ("now ",)
        assert any(f"{text}: {state}" in printed.stdout for state in states), (text, printed)
    assert printed.returncode == 0, printed


def test_a_triggered_capture_costs_within_the_budget(tmp_path, llama_build, tiny_model, llama_env):
    """The capture's cost, stated and timed, within the budget. Two servers alike, A watched
    and B not (governed.py); the daemon at token,graph,op under a 4% budget, A loaded until
    the governor steps its op level down (it costs the tiny model ~15%: now priced on A).
    Then a burst of short prompts makes A's batches large and BURST_TRIGGER fires; the
    capture asks A's levels and op,sched: op is left out (over the budget at its price on A),
    sched is priced. The capture's stated cost (its own accounting) within the budget; once
    its probes are in, A/B windows against A/B before the daemon: the timed cost of
    everything watching A (the daemon's levels and the capture) within the budget, where the
    windows resolve it (3 standard errors) and ended before the capture did."""
    from governed import TIMED_NOISE_MAX, alternate, cost_against_before, loaded_until_settled, server_window, twin_servers
    from daemon_helpers import _STARTED, kill_started
    store = tmp_path / "captures"
    d = None
    try:
        a, b, url_a, url_b, _ = twin_servers(llama_build, tiny_model, llama_env, tmp_path, _STARTED)
        before = alternate(server_window(url_a), server_window(url_b), PAIRS, WINDOW_TOKENS)
        # A alone: another llama.cpp process on the machine would be watched, and could fire
        d = Daemon(tmp_path, ("--levels", "token,graph,op", "--budget", "0.04", "--trigger", BURST_TRIGGER,
                              "--record-for", f"{CAPTURE_S}s", "--captures-dir", str(store), "--max-processes", "1"))
        assert sorted(d.watched(a.pid)["levels"]) == ["graph", "op", "token"], d.text()
        stepped, info = loaded_until_settled(d, a.pid, url_a, f"PID {a.pid}: levels graph,op,token -> graph,token (")
        assert stepped is not None, d.text()
        share = info["cost_share"]
        programs = attached_programs()
        burst = threading.Event()
        burst.set()
        short = json.dumps({"prompt": "Once upon a time there was a quick brown fox that", "n_predict": 1, "cache_prompt": False}).encode()

        def ask():
            req = urllib.request.Request(url_a + "/completion", data=short, method="POST",
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=60) as r:
                r.read()
        bursting = threading.Thread(target=lambda: [ask() for _ in iter(burst.is_set, False)])
        bursting.start()
        said = f"PID {a.pid}: {BURST_TRIGGER} fired"
        try:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and "capturing" not in d.text().split(said, 1)[-1]:
                time.sleep(0.2)
        finally:
            burst.clear()
            bursting.join()
        assert said in d.text(), d.text()
        deadline = time.monotonic() + 30     # the capture's probes in (its token level's programs)
        while time.monotonic() < deadline and attached_programs() <= programs:
            time.sleep(0.2)
        assert attached_programs() > programs, d.text()
        during = alternate(server_window(url_a), server_window(url_b), PAIRS, WINDOW_TOKENS)
        outlasted = kept(d) != []            # the capture ended before the windows did
        caps, deadline = [], time.monotonic() + CAPTURE_S + 60
        while time.monotonic() < deadline and not caps:
            caps = kept(d)
            time.sleep(1)
        capture_log = d.text()
    finally:
        kill_started()
        if d is not None:
            d.stop()
    assert len(caps) == 1, capture_log
    cap = json.loads((store / f"{caps[0]['id']}.json").read_text())
    assert "op" in cap["left_out"] and "budget 4.00%" in cap["left_out"]["op"], cap["left_out"]
    assert "op" not in cap["levels"] and "token" in cap["levels"], cap
    # sched: priced (its threads' switches), then kept or, dearer than what fits, left out for it
    assert "sched" in cap["levels"] or "budget 4.00%" in cap["left_out"].get("sched", ""), cap["left_out"]
    stated = (cap["cost"] or {}).get("slowdown")
    assert stated is not None, cap["cost"]
    cost, se = cost_against_before(before, during)
    said = (f"stated: A {share:.2%} (settled) + the capture {stated:.2%}; timed {cost:+.1%} +- {se:.1%} in {PAIRS} pairs of "
            f"{WINDOW_TOKENS} tokens (A/B before the daemon: {[round(x / y, 3) for x, y in before]}; during the "
            f"capture: {[round(x / y, 3) for x, y in during]})")
    print(said)
    # stated: the capture's own accounting of what it added, within the budget (the
    # governor fitted the capture's levels by their prices on A beside A's cost then)
    assert stated <= 0.04, said
    if outlasted:
        pytest.skip(f"{said}: the windows outlasted the capture (a slow machine): not timed")
    assert cost <= 0.04 + 3 * se, said        # however noisy
    if se >= TIMED_NOISE_MAX:
        pytest.skip(f"{said}: within the budget only as far as windows this noisy tell: 4% not resolved")


def attached_programs() -> int:
    """The machine's BPF programs of llama.cpp's token level (each set of its probes loads one)."""
    out = subprocess.run(["bpftool", "-j", "prog", "show"], capture_output=True, text=True, timeout=30, check=True)
    return sum(1 for p in json.loads(out.stdout) if p.get("name") == "token_return")


def test_two_incidents_keep_the_newest_under_the_byte_cap(tmp_path, llama_build, tiny_model, llama_env):
    """Two real slowdowns, the first cleared before the second: one capture each (the trigger
    re-arms once its condition is clear for its hold time and its cooldown has passed), the
    newest kept on disk and listed, under the byte cap; the daemon's memory stays flat."""
    store, cap_bytes = tmp_path / "captures", 1 << 20
    with llama_server(llama_build, tiny_model, llama_env, 2) as (server, url):
        d = Daemon(tmp_path, ("--levels", "token,graph", "--budget", "0.25", "--trigger", "tpot_p99 > 20ms for 1s",
                              "--trigger-window", "2s", "--record-for", "2s", "--keep", "1", "--captures-max-bytes", str(cap_bytes),
                              "--trigger-cooldown", "1s", "--captures-dir", str(store), "--capture-levels", "token"))
        rss, made_at = [], []
        try:
            d.watched(server.pid)
            cpus = sorted(os.sched_getaffinity(server.pid))
            with SteadyLoad(url):
                time.sleep(3)
                for incident in range(2):
                    hogs = [subprocess.Popen([sys.executable, "-c", HOG],
                                             preexec_fn=lambda c=c: os.sched_setaffinity(0, {c}))
                            for c in cpus for _ in range(2)]
                    try:
                        deadline = time.monotonic() + 60
                        while time.monotonic() < deadline and made(d) < incident + 1:
                            time.sleep(0.5)
                    finally:
                        for h in hogs:
                            h.kill()
                            h.wait()
                    assert made(d) == incident + 1, (incident, d.text())
                    made_at.append(kept(d)[-1]["id"])
                    time.sleep(4)          # clear (its 2 s window) for its hold time, cooled down
                    rss.append(daemon_rss(d))
            caps = kept(d)
            on_disk = sorted(p.name for p in store.iterdir())
        finally:
            d.stop()
    assert [c["id"] for c in caps] == made_at[-1:] and caps[0]["bytes"] <= cap_bytes, (caps, made_at)
    assert on_disk == sorted(f"{c['id']}{ext}" for c in caps for ext in (".json", ".pftrace")), on_disk
    assert rss[1] - rss[0] < 8 << 20, rss       # a capture more, one dropped: no more memory kept


def _step_p90(truth: dict, lo: float, hi: float) -> float:
    """The p90 of the engine's own step intervals between monotonic times lo and hi (its
    scheduler's calls, one a step: offline_truth.py's steady truth); nan with under 10 of them."""
    starts = [t for t, _ in truth["steps"]]
    gaps = [b - a for a, b in zip(starts, starts[1:]) if lo <= a and b <= hi]
    return statistics.quantiles(gaps, n=10)[-1] if len(gaps) >= 10 else float("nan")


def test_a_vllm_burst_of_long_prompts_fires_and_shows_the_phase_change(tmp_path, vllm_engine, bpf_watch):
    """A vLLM engine decoding steadily (the session's, conftest.vllm_engine: offline_truth.py's
    steady load), watched at its step level with a trigger on its step time (a decode step ~2 ms
    here, a mixed one ~4.5: 1.8x its baseline's p90, held 3 s: a second of a loaded machine's
    stall does not fire it); then long prompts arrive for 15 s, and its steps mix prefill with
    the decodes (the engine's own scheduler says so). One capture is made within the burst,
    and its report sets the incident's steps (from when the condition began to hold to the
    firing) against the baseline's: mixed steps from a small share to most, decode steps from
    most to a small share. The daemon, stopped, leaves nothing attached in the engine."""
    store = tmp_path / "captures"
    target = vllm_engine("eager")
    d = None
    try:
        d = Daemon(tmp_path, ("--levels", "token", "--budget", "0.25", "--trigger", "call_p90 > 1.8x baseline for 3s",
                              "--trigger-baseline", f"{BASELINE_S}s", "--trigger-window", f"{WINDOW_S}s",
                              "--record-for", "3s", "--keep", "3",
                              "--captures-dir", str(store), "--capture-levels", "step"), env=SAMPLED)
        assert d.watched(target.pid, timeout=60)["levels"] == ["step"], d.text()
        target.steady(tmp_path / "steps.json")
        time.sleep(BASELINE_LOAD_S)         # the baseline: steady decodes
        early = kept(d)
        if early:                           # fired before any burst: did the engine slow?
            truth = target.stop_steady()
            at = early[0]["fired"]["fired_monotonic_s"]
            held, before = _step_p90(truth, at - 3, at), _step_p90(truth, at - 15, at - 3)
            # the engine's own steps slowed as the trigger says (the machine's doing, for
            # its hold): fired rightly, and its cooldown leaves no burst to test
            if held > 1.5 * before:
                pytest.skip(f"the engine's own steps slowed before the burst (p90 {held * 1e3:.1f} ms over "
                            f"the 3 s before the firing, {before * 1e3:.1f} ms the 12 s before): fired rightly")
            assert early == [], (held, before, d.text())
        started = time.monotonic()
        target.burst(15)
        deadline = time.monotonic() + 45
        while time.monotonic() < deadline and not kept(d):
            time.sleep(0.5)
        caps = kept(d)
        truth = target.stop_steady()
        got = _get(d.url + f"/captures/{caps[0]['id']}", d.token) if caps else None
    finally:
        if d is not None:
            d.stop()
    left = bpf_watch.leftovers({target.pid})
    assert not left, left
    assert len(caps) == 1, (caps, (tmp_path / "daemon.log").read_text())
    fired = caps[0]["fired"]
    assert fired["reason"] == "call_p90" and started < fired["fired_monotonic_s"] < started + 15, (fired, started)
    # the engine's own steps: decodes alone before the burst, mostly mixed in it up to the firing
    def mixed_share(lo: float, hi: float) -> float:
        picked = [lens for t, lens in truth["steps"] if lo <= t <= hi]
        return sum(1 for lens in picked if any(q > 1 for q in lens) and any(q == 1 for q in lens)) / len(picked)
    assert mixed_share(started - 12, started) < 0.1 and mixed_share(started + 1, fired["fired_monotonic_s"]) > 0.5
    trace = tmp_path / "burst.pftrace"
    trace.write_bytes(got[1])
    r = subprocess.run([*PROFINFER, "report", str(trace), "--json", str(tmp_path / "s.json")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    rows = {x["item"]: x for x in json.loads((tmp_path / "s.json").read_text())["flight"]["changes"] if x["family"] == "call"}
    mixed, decode = rows["mixed"], rows["decode"]
    assert mixed["incident"]["share"] > 0.5 and (mixed["verdict"] == "new" or "share" in mixed["verdict"]), rows
    # decode steps: from most of the baseline's to few of the incident's, or none ("gone")
    assert (decode["incident"] or {"share": 0.0})["share"] < 0.5 < decode["baseline"]["share"], rows
    assert decode["verdict"] == "gone" or "share" in decode["verdict"], rows
