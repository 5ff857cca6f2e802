"""The cuda level's cost per call: what a probed launch, copy, malloc and sync add to their
caller, aggregated in BPF (no timeline) and with a timeline (each call sent).

Method: bench/cuda_probe_cost.cu (built with nvcc, the CUDA 13 runtime linked statically, as
nvcc does by default) calls one function N times and prints its own mean ns per call. Runs
alternate unprobed / probed (`profinfer record --levels cuda`, with `-o` for the timeline);
the added cost is the median probed minus the median unprobed. Beside it, what the recording's
own accounting states per call (kernel-counted BPF time + probe hits x calibrated trap cost).

    .venv/bin/python bench/cuda_overhead.py [--calls 200000] [--rounds 5]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from profinfer.levels.cuda import workload

PROFINFER = [sys.executable, "-m", "profinfer.cli"]
SOURCE = Path(__file__).with_name("cuda_probe_cost.cu")


def _ns(out: str) -> float:
    return float(next(l for l in out.splitlines() if l.startswith("ns_per_call")).split()[1])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=200_000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--what", action="append", choices=["launch", "copy", "malloc", "sync"],
                    help="the calls to measure (repeat; default all four)")
    ap.add_argument("--summary", help="write the results (JSON) here too")
    args = ap.parse_args()
    program = str(workload.build_program(SOURCE, "static"))
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for what in args.what or ("launch", "copy", "malloc", "sync"):
            runs = {"unprobed": [], "aggregated": [], "timeline": []}
            stated = {"aggregated": [], "timeline": []}
            for _ in range(args.rounds):
                cmd = [program, what, str(args.calls)]
                runs["unprobed"].append(_ns(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout))
                for mode in ("aggregated", "timeline"):
                    js = f"{tmp}/s.json"
                    extra = ["-o", f"{tmp}/t.pftrace"] if mode == "timeline" else []
                    out = subprocess.run(PROFINFER + ["record", "--levels", "cuda", "--quiet", "--json", js,
                                                      *extra, "--", *cmd], capture_output=True, text=True, check=True)
                    runs[mode].append(_ns(out.stdout))
                    cost = json.load(open(js))["cuda"]["profiler_cost"]
                    if cost and cost.get("per_call_ns"):
                        stated[mode].append(cost["per_call_ns"])
            base = statistics.median(runs["unprobed"])
            results[what] = {"unprobed_ns": base}
            for mode in ("aggregated", "timeline"):
                results[what][f"{mode}_added_ns"] = statistics.median(runs[mode]) - base
                results[what][f"{mode}_stated_ns"] = statistics.median(stated[mode]) if stated[mode] else None
            print(what, json.dumps(results[what]), flush=True)
    if args.summary:
        Path(args.summary).write_text(json.dumps(results, indent=2) + "\n")
    if not args.what:
        Path(__file__).with_name("cuda_overhead.json").write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
