"""The flight recorder over minutes: five minutes of steady load make no capture, and a
triggered capture's cost, stated and timed in alternating A/B windows, within the budget.
Its figures go to bench/results.md."""
from __future__ import annotations

import json
import os
import subprocess
import threading
import time
import urllib.request

import pytest

from conftest import PROFINFER, llama_server
from daemon_helpers import Daemon, _get
from test_flight import STEADY_TRIGGERS, SteadyLoad, daemon_rss, kept, made

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
