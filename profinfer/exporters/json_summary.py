"""Machine-readable run summary: one JSON object of plain ints, floats, strings (null when unknown).

Times are nanoseconds. Required keys: decode_calls, tokens, time_ns, lost_events, threads, ops;
the rest (latency, per-phase ops, percentiles, meta) are extras. A flight recorder's capture
has "flight" first (viewers/flight.py); then the main view's keys (the neutral one below, or
that of the engine that holds the profile), then each plugin's sections in their order
(core.sections).
"decode_call_list" is the decode-call timeline (the HTML report's): per llama_decode-like call
{start_ns, end_ns, dur_ns, calls, tokens, phase}, in start order. It holds at most
MAX_TIMELINE_POINTS entries (core/plugin/timeline_groups.py): a run of more calls is merged into
consecutive groups of k = ceil(calls / MAX_TIMELINE_POINTS) calls each (start of the first, end
of the last, dur_ns the sum of the calls' own durations, tokens summed, phase the calls' common
phase or "mixed"), and "decode_call_group" says k (1: one entry per call).
"step_list" (an engine's steps, vLLM's main view) is the step timeline: per step {pid, tid,
start_ns, end_ns, dur_ns, steps (1), tokens, query_lens, phase, prefill_seqs, decode_seqs, calls
(its native op calls)}, in start order, bound alike: more than MAX_TIMELINE_POINTS steps are
merged into consecutive groups of k steps each (start of the first, end of the last, dur_ns the
steps' own durations summed, steps k (the last group fewer), tokens, calls, prefill_seqs and
decode_seqs summed, phase common or "mixed"; without pid, tid and query_lens), and
"step_group" says k.
Ops counted in BPF per op type and phase (no timeline asked; meta "op_level": "counted"):
the ops' percentiles, barrier times and per-thread op times are null.
"""
from __future__ import annotations

import json
from pathlib import Path

from profinfer.core.calibration import stamped, selfcost
from profinfer.core.plugin import sections, timeline_groups
from profinfer.core.profile.model import Profile, TokenCall
from profinfer.core.plugin.sections import SummarySection, View
from profinfer.core.profile.stats import OpStats, compute
from profinfer.viewers import flight


def _int(x: float | None) -> int | None:
    return None if x is None else int(round(x))


def _float(x: float | None) -> float | None:
    return None if x is None else float(x)


def _op_row(o: OpStats) -> dict:
    return {"op": o.op, "count": o.count, "total_ns": o.total_ns, "mean_ns": float(o.mean_ns),
            "p50_ns": _float(o.p50_ns), "p99_ns": _float(o.p99_ns), "share": float(o.share)}


def _call_group(calls: list[TokenCall]) -> dict:
    return {"start_ns": calls[0].start_ns, "end_ns": calls[-1].end_ns,
            "dur_ns": sum(c.dur_ns for c in calls), "calls": len(calls),
            "tokens": sum(c.n_tokens for c in calls), "phase": timeline_groups.merged_phase(c.phase for c in calls)}


def decode_call_timeline(profile: Profile) -> dict:
    k, grouped = timeline_groups.groups(sorted(profile.tokens, key=lambda c: (c.start_ns, c.tid)))
    return {"decode_call_group": k, "decode_call_list": [_call_group(g) for g in grouped]}


def summary(profile: Profile) -> dict:
    out: dict = {}
    for section in sections.summary_sections(profile, NEUTRAL, COMMON):
        out.update(section.keys(profile))
    return out


def _main(profile: Profile) -> dict:
    """The neutral main view: tokens, graphs and ops."""
    st = compute(profile)
    pre, dec = st.phases["prefill"], st.phases["decode"]
    return {
        "pid": profile.pid,
        "process_name": profile.process_name,
        "decode_calls": st.decode_calls,
        "graphs": st.graphs,
        "tokens": {"prefill": st.prefill_tokens, "decode": st.decode_tokens},
        "time_ns": {"prefill": pre.time_ns, "decode": dec.time_ns},
        "lost_events": st.lost_events,
        "sequences": len(st.sequences),
        "sequence_latency": [{"seq": q.seq, "start_ns": q.start_ns, "prefill_tokens": q.prefill_tokens,
                              "prefill_end_ns": q.prefill_end_ns, "decode_tokens": q.decode_tokens,
                              "end_ns": q.end_ns, "ttft_ns": q.ttft_ns, "tpot_ns": _int(q.tpot_ns)}
                             for q in st.sequences],
        "ttft_ns": st.ttft_ns,
        "tpot_ns": _int(st.tpot_ns),
        "tokens_per_s": st.tokens_per_s,
        "prefill_tokens_per_s": pre.tokens_per_s,
        "op_total_ns": st.op_total_ns,
        "barrier_total_ns": st.barrier_total_ns,
        "threads": [{"tid": t.tid, "name": t.name, "graph_ns": t.graph_ns, "arrival_ns": t.arrival_ns,
                     "op_ns": t.op_ns, "barrier_ns": t.barrier_ns} for t in st.threads],
        "ops": [_op_row(o) for o in st.ops],
        **decode_call_timeline(profile),
        "phases": {name: {"calls": ph.calls, "tokens": ph.tokens, "time_ns": ph.time_ns,
                          "op_ns": ph.op_ns, "barrier_ns": ph.barrier_ns,
                          "ops": [{"op": o.op, "count": o.count, "total_ns": o.total_ns} for o in ph.ops]}
                   for name, ph in st.phases.items()},
        "meta": {str(k): str(v) for k, v in profile.meta.items()},
    }


def _profiler_cost(profile: Profile) -> dict:
    trap = stamped.trap_costs(profile)
    c = selfcost.compute(profile, trap.value)
    if c is None:
        return {}
    return {"profiler_cost": {
        "bpf_ns": c.bpf_ns, "bpf_runs": c.bpf_runs, "probe_hits": c.hits,
        "hit_costs_ns": c.hit_costs_ns, "hit_costs": trap.as_json(), "trap_ns": _int(c.trap_ns),
        "collector_cpu_ns": c.collector_cpu_ns, "target_cpu_ns": c.target_cpu_ns,
        "in_target_share": c.in_target_share, "collector_share": c.collector_share,
        "trap_in_situ_ns": _int(c.trap_in_situ_ns), "collector_on_critical_path": c.collector_critical,
        # where the emulated hits' price was measured, when not in the recording itself
        **({"trap_priced": c.trap_priced} if c.trap_priced else {}),
        "collector_factor": c.collector_factor,
        "slowdown": c.slowdown,
        # where the recording knows the threads that took the hits, each was charged its share
        **({"charged_threads": c.bearer_threads} if c.bearer_threads is not None else {})}}


# The view of a profile of tokens, graphs and ops that no engine's own view stands for.
NEUTRAL = View(summary=(SummarySection(0, _main),))
# In every summary.
COMMON = (SummarySection(-20, flight.keys), SummarySection(50, _profiler_cost))


def write_json(profile: Profile, path: str | Path) -> None:
    write_summary(summary(profile), path)


def write_summary(data: dict, path: str | Path) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
