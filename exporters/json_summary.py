"""Machine-readable run summary: one JSON object of plain ints, floats, strings (null when unknown).

Times are nanoseconds. Required keys: decode_calls, tokens, time_ns, lost_events, threads, ops;
the rest (latency, per-phase ops, percentiles, meta) are extras.
"""
from __future__ import annotations

import json
from pathlib import Path

from profinfer.model import Profile
from profinfer.stats import OpStats, compute


def _int(x: float | None) -> int | None:
    return None if x is None else int(round(x))


def _op_row(o: OpStats) -> dict:
    return {"op": o.op, "count": o.count, "total_ns": o.total_ns, "mean_ns": float(o.mean_ns),
            "p50_ns": float(o.p50_ns), "p99_ns": float(o.p99_ns), "share": float(o.share)}


def summary(profile: Profile) -> dict:
    st = compute(profile)
    pre, dec = st.phases["prefill"], st.phases["decode"]
    return {
        "pid": profile.pid,
        "process_name": profile.process_name,
        "decode_calls": st.decode_calls,
        "graphs": st.graphs,
        "tokens": {"prefill": pre.tokens, "decode": dec.tokens},
        "time_ns": {"prefill": pre.time_ns, "decode": dec.time_ns},
        "lost_events": st.lost_events,
        "sequences": len(st.sequences),
        "ttft_ns": st.ttft_ns,
        "tpot_ns": _int(st.tpot_ns),
        "tokens_per_s": st.tokens_per_s,
        "prefill_tokens_per_s": pre.tokens_per_s,
        "op_total_ns": st.op_total_ns,
        "barrier_total_ns": st.barrier_total_ns,
        "threads": [{"tid": t.tid, "name": t.name, "graph_ns": t.graph_ns, "op_ns": t.op_ns,
                     "barrier_ns": t.barrier_ns} for t in st.threads],
        "ops": [_op_row(o) for o in st.ops],
        "phases": {name: {"calls": ph.calls, "tokens": ph.tokens, "time_ns": ph.time_ns,
                          "op_ns": ph.op_ns, "barrier_ns": ph.barrier_ns,
                          "ops": [{"op": o.op, "count": o.count, "total_ns": o.total_ns} for o in ph.ops]}
                   for name, ph in st.phases.items()},
        "meta": {str(k): str(v) for k, v in profile.meta.items()},
    }


def write_json(profile: Profile, path: str | Path) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(summary(profile), f, indent=2)
        f.write("\n")
