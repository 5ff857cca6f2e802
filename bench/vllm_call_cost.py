"""What one vLLM native op call costs under profinfer's op level, by time.

A process in vLLM's venv (CPU torch) calls `torch.ops._C.rotary_embedding` on small tensors
(the engine's own call, through torch's dispatcher as vLLM's Python makes it) N times per
round and prints each round's start and end. profinfer attaches (`attach --pid`, op level) in
alternating windows; the rounds inside a probed window are set against the unprobed windows'
rounds on either side (the drift of a shared machine cancels), and the difference per call is
what a probed call adds. The attach's own recording says how many calls it saw (entry hits)
and what its probes cost by the accounting.

    .venv/bin/python bench/vllm_call_cost.py --pairs 6 --window 4 [--label what]

(run from another checkout's root, it measures that checkout's profinfer.)
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
from profinfer.core.calibration import insitu
from profinfer.engines.vllm import workload

PROFINFER = [sys.executable, "-m", "profinfer.cli"]

# The target (vLLM's python): the library vLLM itself would import on this CPU, then rounds.
TARGET = r"""
import sys, time, torch
from vllm.platforms.cpu import CpuPlatform
CpuPlatform.import_kernels()
n, seconds = int(sys.argv[1]), float(sys.argv[2])
torch.set_num_threads(1)
tokens, heads, head_size = 4, 4, 64
positions = torch.arange(tokens, dtype=torch.long)
query = torch.randn(tokens, heads * head_size, dtype=torch.bfloat16)
key = torch.randn(tokens, heads * head_size, dtype=torch.bfloat16)
cos_sin = torch.randn(512, head_size, dtype=torch.bfloat16)
op = torch.ops._C.rotary_embedding
for _ in range(2000):
    op(positions, query, key, head_size, cos_sin, True)
print("READY", flush=True)
end = time.monotonic() + seconds
while time.monotonic() < end:
    t0, c0 = time.monotonic_ns(), time.thread_time_ns()
    for _ in range(n):
        op(positions, query, key, head_size, cos_sin, True)
    print(f"ROUND {t0} {time.monotonic_ns()} {n} {time.thread_time_ns() - c0}", flush=True)
"""


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=6)
    ap.add_argument("--window", type=float, default=4.0)
    ap.add_argument("--calls", type=int, default=2000, help="calls per round")
    ap.add_argument("--out", default=str(Path(__file__).with_name("vllm_call_cost.jsonl")))
    ap.add_argument("--label", default="", help="kept in each row (which profinfer was measured)")
    ap.add_argument("--settle", type=float, default=2 * insitu.WINDOWS * insitu.WINDOW_S + 0.5,
                    help="seconds of each probed window left out: the trap's measure in the "
                         "target puts one more probe in every call meanwhile")
    args = ap.parse_args()
    seconds = (2 * args.pairs + 2) * (args.window + 3) + 30
    target, rounds = timed_target.start([str(workload.ensure_vllm()), "-c", TARGET, str(args.calls),
                                         str(seconds)], "ROUND")
    windows = []        # (probed, start_ns, end_ns, summary or None)
    tmp = Path(tempfile.mkdtemp())
    try:
        for i in range(2 * args.pairs + 1):
            t0 = time.monotonic_ns()
            if i % 2:
                out = tmp / f"w{i}.json"
                attach = subprocess.Popen([*PROFINFER, "attach", "--pid", str(target.pid), "--levels", "op",
                                           "--duration", str(args.window), "--json", str(out), "--quiet"],
                                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                attached = 0            # its note "attached N probes": the recording begins
                for line in attach.stderr:
                    if "attached" in line and not attached:
                        attached = time.monotonic_ns()
                if attach.wait() or not attached:
                    raise SystemExit(f"profinfer attach failed (exit {attach.returncode})")
                windows.append((True, attached + int(args.settle * 1e9), attached + int(args.window * 1e9),
                                json.loads(out.read_text())))
            else:
                time.sleep(args.window)
                windows.append((False, t0, time.monotonic_ns(), None))
    finally:
        target.kill()
        target.wait()

    def per_call_us(lo: int, hi: int, cpu: bool = False) -> list[float]:
        """Each round's time per call, wall-clock or the calling thread's CPU time (the probes'
        traps and handlers run on it; a loaded machine's waits for a CPU do not count)."""
        return [(c if cpu else b - a) / n / 1e3 for a, b, n, c in rounds if a >= lo and b <= hi]

    rows = []
    for k, (probed, lo, hi, summary) in enumerate(windows):
        if not probed:
            continue
        calls = sum(o["count"] for o in summary["ops"])
        mine = per_call_us(lo, hi)
        around = per_call_us(windows[k - 1][1], windows[k - 1][2]) + per_call_us(windows[k + 1][1], windows[k + 1][2])
        if not mine or not around:
            continue
        cost = summary.get("profiler_cost") or {}
        cpu_mine = per_call_us(lo, hi, cpu=True)
        cpu_around = per_call_us(windows[k - 1][1], windows[k - 1][2], True) + \
            per_call_us(windows[k + 1][1], windows[k + 1][2], True)
        rows.append({"cpu_us_per_call_unprobed": statistics.median(cpu_around),
                     "cpu_us_per_call_probed": statistics.median(cpu_mine),
                     "cpu_added_us": statistics.median(cpu_mine) - statistics.median(cpu_around),
                     "us_per_call_unprobed": statistics.median(around),
                     "us_per_call_probed": statistics.median(mine),
                     "added_us": statistics.median(mine) - statistics.median(around),
                     "rounds_probed": len(mine), "calls_recorded": calls,
                     "probe_hits": cost.get("probe_hits"), "stated_slowdown": cost.get("slowdown"),
                     "probes_stepped": (summary.get("meta") or {}).get("probes_stepped"),
                     "bpf_ns_per_run": {k.split(":")[-1]: int(v) for k, v in (summary.get("meta") or {}).items()
                                        if k.startswith("cost:ns_per_run:")},
                     "trap_in_situ_ns": cost.get("trap_in_situ_ns")})
    with open(args.out, "a") as f:
        for r in rows:
            f.write(json.dumps({"date": time.strftime("%Y-%m-%dT%H:%M"), "label": args.label, **r}) + "\n")
    if not rows:
        print("no probed window had rounds on either side", file=sys.stderr)
        return 1
    def med(key: str) -> float:
        return statistics.median(r[key] for r in rows)

    print(f"rotary_embedding: wall {med('us_per_call_unprobed'):.2f} µs/call unprobed, "
          f"{med('us_per_call_probed'):.2f} probed: {med('added_us'):+.2f} µs per call (windows "
          f"{', '.join(format(r['added_us'], '+.2f') for r in rows)}); the thread's CPU "
          f"{med('cpu_us_per_call_unprobed'):.2f} unprobed, {med('cpu_us_per_call_probed'):.2f} probed: "
          f"{med('cpu_added_us'):+.2f} µs per call (windows "
          f"{', '.join(format(r['cpu_added_us'], '+.2f') for r in rows)}); "
          f"calls recorded per window {statistics.median(r['calls_recorded'] or 0 for r in rows):.0f}; "
          f"probe hits {rows[0]['probe_hits']}; probes stepped {rows[0]['probes_stepped']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
