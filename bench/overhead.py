"""Overhead benchmark: decode tokens/s without profiling vs each probe level.

Runs are interleaved (every round runs every configuration, in a rotated order) because this
machine is noisy; the report gives medians and the ratio to the unprofiled median. Decode
speed is llama.cpp's own figure (llama_perf_context_print "eval"), so the profiler's attach
and teardown are not counted against it. For profiled runs it also reports attach time,
events/s, lost events and the collector's peak RSS (from profinfer's --json summary).

On a shared 2-core VM one unprofiled run differs from the next by several percent, so the
timed comparison cannot resolve 0.1% or 1%. The cost accounting can: the kernel counts our
BPF programs' runs and run time, `profinfer calibrate` measures what one probe hit's trap
costs here, and both are set against the CPU time the target used (profinfer's
"profiler_cost"); the collector's own CPU time is the other part of the overhead.

    .venv/bin/python bench/overhead.py --models tiny,llama-1.5b --rounds 5
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from profinfer.engines.llamacpp import workload

# profinfer options per configuration (None: no profiler); TRACE: a trace file of the run's own
TRACE = "{trace}"
# The op level records every node when a timeline is written (-o), and counts ops in BPF per
# op type and phase otherwise (issue 23): "token+graph+op" writes one, "op (counted)" not.
CONFIGS = {"none": None, "token": ["--levels", "token"], "token+graph": ["--levels", "token,graph"],
           "token+graph+op": ["--levels", "token,graph,op", "-o", TRACE],
           "op (counted)": ["--levels", "token,graph,op"],
           # issue 3: op level with its structure (sources' shapes) and two counters, and sched
           # (both record every node, with or without -o)
           "op+2 counters": ["--levels", "token,graph,op", "--counters", "task-clock,page-faults"],
           "op+sched": ["--levels", "token,graph,op,sched"],
           # issue 10: the op level's two-probe design (one probe per node is the default)
           "op two-probe": ["--levels", "token,graph,op", "-o", TRACE],
           "op two-probe (counted)": ["--levels", "token,graph,op"]}
CONFIG_ENV = {"op two-probe": {"PROFINFER_OP_DESIGN": "two-probe"},
              "op two-probe (counted)": {"PROFINFER_OP_DESIGN": "two-probe"}}
PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time there was"
EVAL = re.compile(r"(?:llama_perf_context_print|common_perf_print):\s+eval time =\s+([\d.]+) ms /\s+(\d+) runs")


def run_once(cmd: list[str], options: list[str] | None, env: dict, tries: int = 6) -> dict:
    """One run. llama-completion's asynchronous logger is not flushed at exit (upstream
    issue 22142) and loses its last lines under load, profiler or not; such a run is
    repeated rather than guessed."""
    for _ in range(tries - 1):
        try:
            return _run(cmd, options, env)
        except LookupError as e:
            print(f"retrying: {e}", file=sys.stderr)
    try:
        return _run(cmd, options, env)
    except LookupError as e:
        raise SystemExit(str(e)) from None


def _run(cmd: list[str], options: list[str] | None, env: dict) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        js = Path(tmp) / "s.json"
        options = None if options is None else [str(Path(tmp) / "t.pftrace") if o == TRACE else o
                                                for o in options]
        full = cmd if options is None else [sys.executable, "-m", "profinfer.cli", "record", "--quiet",
                                           *options, "--json", str(js), "--", *cmd]
        p = subprocess.run(full, capture_output=True, text=True, env=env, timeout=1800)
        if p.returncode != 0:
            raise SystemExit(f"run failed ({' '.join(full[:6])} ...):\n{p.stderr[-2000:]}")
        m = EVAL.search(p.stderr)
        if m is None:
            stopped = json.loads(js.read_text())["meta"].get("stopped_by") if js.exists() else "?"
            raise LookupError(f"no decode speed in the output of {' '.join(full[:6])} ... "
                              f"(profinfer stopped by: {stopped}):\n{p.stderr[-500:]}")
        ms, runs = float(m.group(1)), int(m.group(2))
        row = {"decode_tok_s": runs / (ms / 1e3)}
        if options is not None:
            s = json.loads(js.read_text())
            meta = s.get("meta", {})
            row.update(attach_s=float(meta.get("attach_s", "nan")), lost=s["lost_events"],
                       events=int(meta.get("events", 0)), wall_s=float(meta.get("wall_s", "nan")),
                       rss_mb=int(meta.get("collector_rss_kb", 0)) / 1024,
                       peak_rss_mb=int(meta.get("collector_max_rss_kb", 0)) / 1024)
            cost = s.get("profiler_cost") or {}
            row.update(in_target=cost.get("in_target_share"), collector=cost.get("collector_share"),
                       slowdown=cost.get("slowdown"), trap_in_situ_ns=cost.get("trap_in_situ_ns"),
                       hits=sum((cost.get("probe_hits") or {}).values()), calls=s["decode_calls"],
                       bpf_ns_per_run=cost.get("bpf_ns", 0) / max(cost.get("bpf_runs", 0), 1))
        return row


def _cost_cells(runs: list[dict]) -> list[str]:
    """Medians of the cost accounting: probe hits per llama_decode call, BPF ns per run, the probes' share of the
    target's CPU time, the collector's, and their sum."""
    shares = [(x["in_target"], x["collector"]) for x in runs
              if x.get("in_target") is not None and x.get("collector") is not None]
    if not shares:
        return ["", "", "n/a (not calibrated)", "", ""]
    med = statistics.median
    return [f"{med(x['hits'] / max(x['calls'], 1) for x in runs):,.0f}",
            f"{med(x['bpf_ns_per_run'] for x in runs):,.0f}",
            f"{100 * med(a for a, _ in shares):.3f}%", f"{100 * med(b for _, b in shares):.3f}%",
            f"{100 * med(a + b for a, b in shares):.3f}%"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="tiny,llama-1.5b")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", default="tiny=256,llama-1.5b=64",
                    help="decode tokens per run, per model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--configs", default=",".join(CONFIGS),
                    help="configurations to run (none is always run)")
    ap.add_argument("--out", default=str(Path(__file__).with_name("results.md")))
    args = ap.parse_args()
    chosen = ["none"] + [c for c in args.configs.split(",") if c in CONFIGS and c != "none"]
    ntok = dict(kv.split("=") for kv in args.tokens.split(","))
    build = workload.ensure_llama_build()
    env = {**os.environ, **workload.llama_env(build)}
    lines = ["# profinfer overhead benchmark", "",
             f"{time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} CPUs, llama.cpp b{workload.LLAMA_VERSION}, "
             f"{args.threads} threads, {args.rounds} interleaved rounds, medians.", ""]
    results = {}
    for model in args.models.split(","):
        gguf = workload.ensure_model(model)
        cmd = workload.completion_command(build, gguf, PROMPT, int(ntok.get(model, 32)), args.threads)
        rows: dict[str, list[dict]] = {c: [] for c in chosen}
        names = chosen
        for r in range(args.rounds):
            order = names[r % len(names):] + names[: r % len(names)]
            for c in order:
                rows[c].append(run_once(cmd, CONFIGS[c], {**env, **CONFIG_ENV.get(c, {})}))
                print(f"{model} round {r + 1} {c}: {rows[c][-1]['decode_tok_s']:.2f} tok/s", file=sys.stderr)
        base = statistics.median(x["decode_tok_s"] for x in rows["none"])
        lines += [f"## {model} ({ntok.get(model, 32)} decode tokens per run)", "",
                  "| levels | decode tok/s (median) | vs none | slowdown | paired slowdown (median, range) "
                  "| time per token, paired (median, range) | attach s | events/s | lost | collector RSS MB (peak) "
                  "| probe hits per llama_decode | BPF ns/run | cost in target | collector CPU | cost total "
                  "| time added, stated (corrected) | stated / timed |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        results[model] = {}
        for c in names:
            med = statistics.median(x["decode_tok_s"] for x in rows[c])
            ratio = med / base
            # Each round ran every configuration back to back: the ratio to that round's
            # unprofiled run cancels slow drifts of the machine.
            paired = [x["decode_tok_s"] / n["decode_tok_s"] for x, n in zip(rows[c], rows["none"])]
            pslow = [100 * (1 - p) for p in paired]
            paired_cell = (f"{statistics.median(pslow):+.2f}% ({min(pslow):+.1f} .. {max(pslow):+.1f})"
                           if c != "none" else "")
            # The cost accounting states added time over the unprofiled time: compared with
            # the time per token, not with the throughput lost.
            ptime = [100 * (1 / p - 1) for p in paired]
            time_cell = (f"{statistics.median(ptime):+.2f}% ({min(ptime):+.1f} .. {max(ptime):+.1f})"
                         if c != "none" else "")
            extra = [""] * 11
            if c != "none":
                med_of = lambda k: statistics.median(x[k] for x in rows[c])
                evs = statistics.median(x["events"] / x["wall_s"] for x in rows[c])
                extra = [f"{med_of('attach_s'):.3f}", f"{evs:,.0f}", f"{max(x['lost'] for x in rows[c])}",
                         f"{max(x['rss_mb'] for x in rows[c]):.0f} ({max(x['peak_rss_mb'] for x in rows[c]):.0f})"]
                extra += _cost_cells(rows[c])
                stated = [x["slowdown"] for x in rows[c] if x.get("slowdown") is not None]
                timed = statistics.median(ptime)
                extra.append(f"{100 * statistics.median(stated):.3f}%" if stated else "")
                extra.append(f"{statistics.median(stated) / (timed / 100):.2f}"
                             if stated and timed > 0 else "")
            lines.append(f"| {c} | {med:.2f} | {ratio:.4f} | {100 * (1 - ratio):+.2f}% | {paired_cell} | "
                         f"{time_cell} | " + " | ".join(extra) + " |")
            results[model][c] = {"median_tok_s": med, "ratio": ratio, "runs": rows[c],
                                 "paired_time_increase": ptime}
        lines.append("")
    Path(args.out).write_text("\n".join(lines) + "\n")
    Path(args.out).with_suffix(".json").write_text(json.dumps(results, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
