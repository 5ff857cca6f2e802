"""vLLM's op level: what profiling costs, by the accounting and by time, in one target.

One vLLM engine process (the bundled tiny Llama) generates the same batch of 4 requests x 32
tokens over and over (bench/vllm_workload.py) and prints each batch's start and end. profinfer
attaches in alternating windows; each probed window's batches are set against the unprobed
windows' on either side (drifts of a shared machine cancel), and against what that attach's
own accounting stated (profiler_cost: probes in the target plus the collector's CPU).

    .venv/bin/python bench/vllm_overhead.py --pairs 8 --window 6 [--mode eager|compiled] [--price-windows 20]

--price-windows N first prices a hit in this engine (`profinfer calibrate --pid`, N windows
with its probes): every attach after it states its cost at that price.
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

PROFINFER = [sys.executable, "-m", "profinfer.cli"]
WORKLOAD = Path(__file__).with_name("vllm_workload.py")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=8)
    ap.add_argument("--window", type=float, default=6.0)
    ap.add_argument("--mode", default="eager", choices=["eager", "compiled"])
    ap.add_argument("--out", default=str(Path(__file__).with_name("vllm_overhead.jsonl")))
    ap.add_argument("--summary", help="write the medians (JSON) here too")
    ap.add_argument("--price-windows", type=int, default=0,
                    help="first price a hit in this engine (profinfer calibrate --pid, this many "
                    "windows of 1.5 s with its probes): the attaches' accounting then uses it")
    args = ap.parse_args()
    seconds = (2 * args.pairs + 2) * (args.window + 8) + 60   # an attach and its report take seconds too
    seconds += 3 * args.price_windows * 1.5 + 30
    target, batches = timed_target.start([str(workload.ensure_vllm()), str(WORKLOAD),
                                          str(workload.ensure_model()), args.mode, str(seconds)], "BATCH")
    windows = []       # (probed, start_ns, end_ns, summary or None)
    tmp = Path(tempfile.mkdtemp())
    try:
        if args.price_windows:
            priced = subprocess.run([*PROFINFER, "calibrate", "--pid", str(target.pid), "--windows",
                                     str(args.price_windows), "--window", "1.5"], capture_output=True, text=True)
            if priced.returncode:
                raise SystemExit(f"profinfer calibrate --pid failed: {priced.stderr.strip()[-2000:]}")
            print(priced.stdout.strip())
        for i in range(2 * args.pairs + 1):
            probed = i % 2 == 1
            t0 = time.monotonic_ns()
            if probed:
                out = tmp / f"w{i}.json"
                done = subprocess.run([*PROFINFER, "attach", "--pid", str(target.pid), "--duration",
                                       str(args.window), "--json", str(out), "--quiet"],
                                      capture_output=True, text=True)
                if done.returncode:
                    raise SystemExit(f"profinfer attach failed: {done.stderr.strip()[-2000:]}")
                windows.append((True, t0, time.monotonic_ns(), json.loads(out.read_text())))
            else:
                time.sleep(args.window)
                windows.append((False, t0, time.monotonic_ns(), None))
    finally:
        target.kill()
        target.wait()

    def batch_times(lo: int, hi: int) -> list[int]:
        return [b - a for a, b in batches if a >= lo and b <= hi]

    rows = []
    for k, (probed, lo, hi, summary) in enumerate(windows):
        if not probed:
            continue
        # the probed batches: those inside the attach's own recording (not its attach/detach)
        cost = summary.get("profiler_cost") or {}
        steps = summary["step_list"]
        # an entry may be a group of steps (the summary's step_group): its end is its last step's
        rec_lo, rec_hi = steps[0]["start_ns"], steps[-1]["end_ns"]
        mine = batch_times(rec_lo, rec_hi)
        around = batch_times(windows[k - 1][1], windows[k - 1][2]) + batch_times(windows[k + 1][1], windows[k + 1][2])
        if not mine or not around:
            continue
        timed = statistics.median(mine) / statistics.median(around) - 1
        rows.append({"mode": args.mode, "batches_probed": len(mine), "batches_around": len(around),
                     "timed": timed, "stated": cost.get("slowdown"),
                     "in_target": cost.get("in_target_share"), "collector": cost.get("collector_share"),
                     "steps_per_s_probed": summary["steps_per_s"],
                     "steps_per_batch": sum(e["steps"] for e in steps) / max(1, len(mine)),
                     "probe_hits": cost.get("probe_hits"), "lost": summary["lost_events"],
                     "batch_ms_unprobed": statistics.median(around) / 1e6,
                     "batch_ms_probed": statistics.median(mine) / 1e6})
    with open(args.out, "a") as f:
        for r in rows:
            f.write(json.dumps({"date": time.strftime("%Y-%m-%dT%H:%M"), **r}) + "\n")
    timed = statistics.median(r["timed"] for r in rows)
    stated = statistics.median(r["stated"] for r in rows if r["stated"] is not None)
    unprobed_ms = statistics.median(r["batch_ms_unprobed"] for r in rows)
    probed_ms = statistics.median(r["batch_ms_probed"] for r in rows)
    steps_per_batch = statistics.median(r["steps_per_batch"] for r in rows)
    if args.summary:
        Path(args.summary).write_text(json.dumps({
            "mode": args.mode, "windows": len(rows), "timed": timed, "stated": stated,
            "timed_range": [min(r["timed"] for r in rows), max(r["timed"] for r in rows)],
            "steps_per_s_unprobed": 1000 * steps_per_batch / unprobed_ms,
            "steps_per_s_probed": 1000 * steps_per_batch / probed_ms}) + "\n")
    print(f"mode {args.mode}: {len(rows)} probed windows; batch {unprobed_ms:.1f} ms unprobed, "
          f"{probed_ms:.1f} ms probed; steps/s {1000 * steps_per_batch / unprobed_ms:.1f} unprobed, "
          f"{1000 * steps_per_batch / probed_ms:.1f} probed; timed +{100 * timed:.1f}% "
          f"(windows {', '.join(format(100 * r['timed'], '+.1f') for r in rows)}); stated {100 * stated:.1f}% "
          f"(probes {100 * statistics.median(r['in_target'] for r in rows):.2f}%, collector "
          f"{100 * statistics.median(r['collector'] for r in rows):.2f}%); lost {sum(r['lost'] for r in rows)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
