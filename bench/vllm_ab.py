"""Two profinfer checkouts' vLLM op level against each other, in one engine process.

The engine (bench/vllm_workload.py, the bundled tiny Llama) generates the same batch over and
over; windows alternate unprobed, attached from checkout A, unprobed, attached from B, ...;
each attached window's batches are set against the unprobed windows on either side, and A's
and B's windows are paired in order. A difference between two builds smaller than the
machine's drift between separate runs resolves here (bench/results.md).

    .venv/bin/python bench/vllm_ab.py --a /path/to/checkout --b . --pairs 8 [--mode eager]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import timed_target
from profinfer.engines.vllm import workload

WORKLOAD = Path(__file__).with_name("vllm_workload.py")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--a", required=True, help="checkout A's root (profinfer run from there)")
    ap.add_argument("--b", required=True, help="checkout B's root")
    ap.add_argument("--pairs", type=int, default=8)
    ap.add_argument("--window", type=float, default=6.0)
    ap.add_argument("--mode", default="eager", choices=["eager", "compiled"])
    args = ap.parse_args()
    roots = {"A": args.a, "B": args.b}
    seconds = 4 * args.pairs * (args.window + 8) + 120    # an attach and its report take seconds too
    target, batches = timed_target.start([str(workload.ensure_vllm()), str(WORKLOAD),
                                          str(workload.ensure_model()), args.mode, str(seconds)], "BATCH")
    tmp, windows = Path(tempfile.mkdtemp()), []
    try:
        for i in range(4 * args.pairs + 1):
            t0 = time.monotonic_ns()
            if i % 2:
                which = "A" if i // 2 % 2 == 0 else "B"
                out = tmp / f"w{i}.json"
                done = subprocess.run([sys.executable, "-m", "profinfer.cli", "attach", "--pid", str(target.pid),
                                       "--duration", str(args.window), "--json", str(out), "--quiet"],
                                      cwd=roots[which], capture_output=True, text=True)
                if done.returncode:
                    raise SystemExit(f"profinfer attach ({which}) failed: {done.stderr.strip()[-2000:]}")
                windows.append((which, t0, time.monotonic_ns(), json.loads(out.read_text())))
            else:
                time.sleep(args.window)
                windows.append((None, t0, time.monotonic_ns(), None))
    finally:
        target.kill()
        target.wait()

    def batch_times(lo: int, hi: int) -> list[int]:
        return [b - a for a, b in batches if a >= lo and b <= hi]

    timed: dict[str, list[float]] = {"A": [], "B": []}
    stated: dict[str, list[float]] = {"A": [], "B": []}
    for k, (which, lo, hi, summary) in enumerate(windows):
        if which is None:
            continue
        steps = summary.get("step_list")       # the recording's own span, else the window's
        rec_lo, rec_hi = ((steps[0]["start_ns"], steps[-1]["start_ns"] + steps[-1]["dur_ns"]) if steps
                          else (lo + 3_500_000_000, hi - 1_000_000_000))
        mine = batch_times(rec_lo, rec_hi)
        around = batch_times(*windows[k - 1][1:3]) + batch_times(*windows[k + 1][1:3])
        if mine and around:
            timed[which].append(statistics.median(mine) / statistics.median(around) - 1)
            stated[which].append((summary.get("profiler_cost") or {}).get("slowdown") or 0.0)
    for which in "AB":
        t = timed[which]
        print(f"{which} ({roots[which]}): timed median {100 * statistics.median(t):+.1f}% (windows "
              f"{', '.join(format(100 * x, '+.1f') for x in t)}); stated {100 * statistics.median(stated[which]):.1f}%")
    d = [b - a for a, b in zip(timed["A"], timed["B"])]
    print(f"B - A, pair by pair: median {100 * statistics.median(d):+.1f} points "
          f"({', '.join(format(100 * x, '+.1f') for x in d)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
