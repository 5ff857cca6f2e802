"""What the sched level adds, by the capture's own accounting, per record and per context
switch of a loaded llama-server's threads: the price the governor puts on an unattended
capture's sched level (governor.SCHED_EVENT_NS).

A llama-server (the tiny model, 2 slots) under 2 clients; `profinfer attach` at `token`
and at `token,sched` in turn, 8 s each, ROUNDS rounds; each attach's stated added time
(its summary's slowdown times the server's CPU time), the sched records it holds, and the
server's threads' context switches meanwhile (/proc/PID/task/*/status).

    .venv/bin/python bench/sched_price.py [ROUNDS]
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "daemon")]

from conftest import llama_server  # noqa: E402
from test_flight import SteadyLoad  # noqa: E402

from profinfer.daemon.governor import context_switches  # noqa: E402
from profinfer.engines.llamacpp import workload  # noqa: E402

SECONDS = 8


def switches(pid: int) -> int:
    return sum(v + o for v, o in (context_switches(pid) or {}).values())


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    build, model = workload.ensure_llama_build(), workload.ensure_model("tiny")
    env = {**os.environ, **workload.llama_env(build)}
    out = Path(tempfile.mkdtemp(prefix="sched-price-"))
    rows: dict[str, list[tuple[float, float, float]]] = {"token": [], "token,sched": []}
    with llama_server(build, model, env, 2) as (server, url), SteadyLoad(url):
        time.sleep(3)
        for i in range(rounds):
            for levels in rows:
                before = switches(server.pid)
                subprocess.run([str(ROOT / ".venv" / "bin" / "profinfer"), "attach", "--pid", str(server.pid),
                                "--levels", levels, "--duration", str(SECONDS), "--quiet",
                                "-o", str(out / "t.pftrace"), "--json", str(out / "s.json")], check=True)
                made = switches(server.pid) - before
                summary = json.loads((out / "s.json").read_text())
                cost = summary["profiler_cost"]
                sched = summary.get("sched") or {}
                added = cost["slowdown"] * cost["target_cpu_ns"] / SECONDS
                records = ((sched.get("switches") or 0) + (sched.get("wakeups") or 0)) / SECONDS
                rows[levels].append((added, records, made / SECONDS))
                print(f"{levels:<12} round {i}: added {added / 1e6:.2f} ms/s, {records:,.0f} records/s, "
                      f"{made / SECONDS:,.0f} switches/s", flush=True)
    extra = statistics.median(r[0] for r in rows["token,sched"]) - statistics.median(r[0] for r in rows["token"])
    records = statistics.median(r[1] for r in rows["token,sched"])
    made = statistics.median(r[2] for r in rows["token,sched"])
    print(f"the sched level adds {extra / 1e6:.2f} ms/s for {records:,.0f} records/s ({made:,.0f} switches/s): "
          f"{extra / records:,.0f} ns a record, {extra / made:,.0f} ns a switch")


if __name__ == "__main__":
    main()
