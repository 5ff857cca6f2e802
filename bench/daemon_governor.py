"""The daemon's overhead budget, against time: a llama-server the daemon governs (A) and an
identical one it cannot see (B: a copy of the build, its engine libraries renamed; see
tests/daemon/governed.py), generating in turn, each window's decode rate as llama.cpp
measures it itself.

1. Before the daemon: pairs of A and B windows (ABBA): what A/B is with nothing watching
   (the two servers' own difference and the machine's noise).
2. `profinfer daemon --levels token,graph,op --budget B` started; A loaded without a pause
   until its levels settle (no change for 6 s): when the op level went, and each change.
3. Pairs again, A governed: the timed cost is 1 - (median A/B governed) / (median A/B before),
   with the standard error of each median (1.25 x MAD / sqrt(pairs)).
4. A idle: when the last level taken comes back.

    .venv/bin/python bench/daemon_governor.py [--model tiny] [--pairs 12] [--budget 0.04]

Prints one JSON line per window and a summary; results go in bench/results.md.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "tests" / d) for d in ("daemon", "")]
from governed import (alternate, copied_build, cost_against_before, server_window, start_server,  # noqa: E402
                      timed_cost, wait_healthy, window)

from profinfer.engines.llamacpp import workload  # noqa: E402


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _status(url: str, pid: int) -> dict | None:
    with urllib.request.urlopen(url + "/status", timeout=10) as r:
        return next((p for p in json.loads(r.read())["processes"] if p["pid"] == pid), None)


def _pairs(url_a: str, url_b: str, pairs: int, n: int, phase: str) -> list[tuple[float, float]]:
    return alternate(server_window(url_a), server_window(url_b), pairs, n, lambda i, a, b: print(json.dumps(
        {"phase": phase, "pair": i, "governed_tok_s": round(a, 1), "alone_tok_s": round(b, 1)}), flush=True))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--pairs", type=int, default=12)
    ap.add_argument("--budget", type=float, default=0.04)
    ap.add_argument("--levels", default="token,graph,op")
    args = ap.parse_args()
    build, model = workload.ensure_llama_build(), workload.ensure_model(args.model)
    env = {**os.environ, **workload.llama_env(build)}
    with tempfile.TemporaryDirectory() as tmp:
        pa, pb, pd = _port(), _port(), _port()
        url_a, url_b, url_d = (f"http://127.0.0.1:{p}" for p in (pa, pb, pd))
        a = start_server(build / "bin", model, env, pa)
        b = start_server(copied_build(build, Path(tmp)), model, env, pb)
        daemon = None
        try:
            wait_healthy(url_a, a)
            wait_healthy(url_b, b)
            window(url_a, 100)
            window(url_b, 100)
            n = max(50, min(2000, int(window(url_b, 300) * 1.5)))     # ~1.5 s windows at its rate now
            before = _pairs(url_a, url_b, args.pairs, n, "before")
            log = open(f"{tmp}/daemon.log", "w")
            daemon = subprocess.Popen([sys.executable, "-m", "profinfer.cli", "daemon", "--listen",
                                       f"127.0.0.1:{pd}", "--token-file", f"{tmp}/token", "--levels",
                                       args.levels, "--budget", str(args.budget)], stderr=log)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                try:
                    if _status(url_d, a.pid):
                        break
                except OSError:
                    pass
                time.sleep(0.2)
            load = threading.Event()
            load.set()
            loader = threading.Thread(target=lambda: [window(url_a, 100) for _ in iter(load.is_set, False)])
            began = time.monotonic()
            loader.start()
            levels, changed, op_gone, history = None, began, None, []
            while time.monotonic() - changed < 6 and time.monotonic() - began < 60:
                p = _status(url_d, a.pid)
                if p["levels"] != levels:
                    levels, changed = p["levels"], time.monotonic()
                    history.append((round(changed - began, 2), levels))
                    if op_gone is None and "op" not in levels:
                        op_gone = round(changed - began, 2)
                time.sleep(0.2)
            load.clear()
            loader.join()
            settled = _status(url_d, a.pid)
            governed = _pairs(url_a, url_b, args.pairs, n, "governed")
            during = _status(url_d, a.pid)
            idle_from, back = time.monotonic(), None
            while time.monotonic() - idle_from < 200:
                p = _status(url_d, a.pid)
                if p["levels"] != during["levels"]:
                    back = (round(time.monotonic() - idle_from, 1), p["levels"])
                    break
                time.sleep(0.5)
        finally:
            for p in (a, b):
                p.kill()
                p.wait()
            if daemon is not None:
                daemon.terminate()
                daemon.wait(timeout=30)
        text = open(f"{tmp}/daemon.log").read()
    r0, se0 = timed_cost(before)
    r1, se1 = timed_cost(governed)
    ratio0, ratio1 = 1 - r0, 1 - r1
    cost, cost_se = cost_against_before(before, governed)
    summary = {
        "model": args.model, "budget": args.budget, "levels": args.levels, "pairs": args.pairs, "tokens_per_window": n,
        "alone_tok_s_median": round(sorted(x for _, x in governed)[len(governed) // 2], 1),
        "a_over_b_before": round(ratio0, 4), "before_se": round(se0, 4),
        "a_over_b_governed": round(ratio1, 4), "governed_se": round(se1, 4),
        "timed_cost": round(cost, 4), "timed_cost_se": round(cost_se, 4),
        "op_gone_after_load_s": op_gone, "level_history": history,
        "settled_levels": settled["levels"], "stated_cost_settled": settled["cost_share"],
        "stated_by_level": settled["cost_by_level"], "stated_cost_after_windows": during["cost_share"],
        "given_back_when_idle": back,
        "changes": [l.split("daemon: ", 1)[1] for l in text.splitlines() if f"PID {a.pid}: levels" in l],
        "trap_costs": next((l.split("priced at ", 1)[1] for l in text.splitlines() if "priced at" in l), None),
    }
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
