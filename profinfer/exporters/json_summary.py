"""Machine-readable run summary: one JSON object of plain ints, floats, strings (null when unknown).

Times are nanoseconds. Required keys: decode_calls, tokens, time_ns, lost_events, threads, ops;
the rest (latency, per-phase ops, percentiles, meta) are extras.
"""
from __future__ import annotations

import json
from pathlib import Path

from profinfer.engines.vllm import callstats
from profinfer.levels.counters import stats as counterstats
from profinfer.engines.llamacpp import layers, moe
from profinfer.core import packs as probepack, recorded_calibration, roofline, selfcost
from profinfer.levels.sched import stats as schedstats
from profinfer.levels.counters.stats import CounterRow
from profinfer.core.model import Profile
from profinfer.core.stats import OpStats, compute


def _int(x: float | None) -> int | None:
    return None if x is None else int(round(x))


def _op_row(o: OpStats) -> dict:
    return {"op": o.op, "count": o.count, "total_ns": o.total_ns, "mean_ns": float(o.mean_ns),
            "p50_ns": float(o.p50_ns), "p99_ns": float(o.p99_ns), "share": float(o.share)}


def summary(profile: Profile) -> dict:
    out = _call_summary(profile) if profile.calls or profile.steps else _graph_summary(profile)
    if profile.cuda_calls:
        out["cuda"] = _cuda(profile)
    return out


def _cuda(profile: Profile) -> dict:
    """The cuda level: kernels, copies, syncs, graphs, memory, per op; and what it cost."""
    from profinfer.levels.cuda import stats as cudastats
    from profinfer.viewers import cudatable
    out = cudastats.summary(profile.cuda_calls, len(profile.steps) or len(profile.tokens))
    out["profiler_cost"] = cudatable.cuda_cost(profile)
    return out


def _graph_summary(profile: Profile) -> dict:
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
        "phases": {name: {"calls": ph.calls, "tokens": ph.tokens, "time_ns": ph.time_ns,
                          "op_ns": ph.op_ns, "barrier_ns": ph.barrier_ns,
                          "ops": [{"op": o.op, "count": o.count, "total_ns": o.total_ns} for o in ph.ops]}
                   for name, ph in st.phases.items()},
        "meta": {str(k): str(v) for k, v in profile.meta.items()},
    } | (_counters(profile) | _roofline(profile) | _sched(profile) | _layers(profile) | _moe(profile)
         | _profiler_cost(profile))


def _shape_args(args) -> dict:
    return {name: (None if shape is None else {"dtype": dtype, "shape": list(shape)})
            for name, dtype, shape in args}


def _call_summary(profile: Profile) -> dict:
    """An engine whose ops are calls (vLLM): the same top-level keys, with its steps where
    llama.cpp has decode calls."""
    st = callstats.compute(profile)
    pre, dec = st.phases["prefill"], st.phases["decode"]
    names = profile.thread_names
    return {
        "pid": profile.pid,
        "process_name": profile.process_name,
        "decode_calls": None,
        "steps": len(st.steps),
        "tokens": {"prefill": st.prefill_tokens, "decode": st.decode_tokens},
        "time_ns": {"prefill": pre.time_ns, "decode": dec.time_ns},
        "lost_events": profile.lost_events,
        "steps_per_s": st.steps_per_s,
        "tokens_per_s": dec.tokens_per_s,
        "prefill_tokens_per_s": pre.tokens_per_s,
        "op_total_ns": st.op_total_ns,
        "threads": [{"tid": tid, "name": names.get(tid, ""), "op_ns": ns}
                    for tid, ns in sorted(st.threads.items())],
        "ops": [{"op": o.op, "count": o.count, "total_ns": o.total_ns, "mean_ns": o.mean_ns,
                 "p50_ns": o.p50_ns, "p99_ns": o.p99_ns, "share": o.share} for o in st.ops],
        "op_shapes": [{"op": s.op, "count": s.count, "total_ns": s.total_ns, "args": _shape_args(s.args)}
                      for s in st.shapes],
        "step_list": [{"pid": s.pid, "tid": s.tid, "start_ns": s.start_ns, "dur_ns": s.dur_ns,
                       "tokens": s.n_tokens, "query_lens": list(s.query_lens), "phase": s.phase,
                       "prefill_seqs": s.prefill_seqs, "decode_seqs": s.decode_seqs, "calls": s.n_calls}
                      for s in st.steps],
        "phases": {name: {"steps": ph.steps, "tokens": ph.tokens, "time_ns": ph.time_ns, "op_ns": ph.op_ns}
                   for name, ph in st.phases.items()},
        "server_metrics": [{"what": r.what, "server": r.server, "ours": r.ours, "unit": r.unit}
                           for r in callstats.server_rows(profile, st)],
        "meta": {str(k): str(v) for k, v in profile.meta.items()},
    } | _counters(profile) | _roofline(profile) | _sched(profile) | _profiler_cost(profile)


def _profiler_cost(profile: Profile) -> dict:
    trap = recorded_calibration.trap_costs(profile)
    c = selfcost.compute(profile, trap.value)
    if c is None:
        return {}
    return {"profiler_cost": {
        "bpf_ns": c.bpf_ns, "bpf_runs": c.bpf_runs, "probe_hits": c.hits,
        "hit_costs_ns": c.hit_costs_ns, "hit_costs": trap.as_json(), "trap_ns": _int(c.trap_ns),
        "collector_cpu_ns": c.collector_cpu_ns, "target_cpu_ns": c.target_cpu_ns,
        "in_target_share": c.in_target_share, "collector_share": c.collector_share,
        "trap_in_situ_ns": _int(c.trap_in_situ_ns), "collector_on_critical_path": c.collector_critical,
        "collector_factor": c.collector_factor,
        "slowdown": c.slowdown}}


def _moe(profile: Profile) -> dict:
    ms = moe.compute(profile)
    if ms is None:
        return {}
    return {"moe": {"n_experts": ms.n_experts, "n_used": ms.n_used, "layers": ms.layers,
                    "activations": ms.total, "routed_tokens": ms.tokens,
                    "counts": ms.counts.tolist(),
                    "by_phase": {p: c.tolist() for p, c in ms.by_phase.items()}}}


def _layers(profile: Profile) -> dict:
    if not profile.ops or not profile.graphs:
        return {}
    return {"layers": [{"layer": r.layer, "phase": r.phase, "nodes": r.nodes, "time_ns": r.time_ns}
                       for r in layers.layer_times(profile)],
            "decode_by_context": [{"kv_len": r.kv_len, "calls": r.calls, "mean_call_ns": r.mean_call_ns,
                                   "mean_attention_ns": r.mean_attention_ns}
                                  for r in layers.decode_by_context(profile)]}


def _sched(profile: Profile) -> dict:
    ss = schedstats.compute(profile)
    if ss is None:
        return {}
    return {"sched": {
        "switches": ss.switches, "wakeups": ss.wakeups,
        "threads": [{"tid": t.tid, "name": t.name, "on_cpu_ns": t.on_cpu_ns,
                     "runnable_ns": t.runnable_ns, "preempted_ns": t.preempted_ns,
                     "sleeping_ns": t.sleeping_ns, "preemptions": t.preemptions,
                     "preempted_by": [{"comm": c, "ns": ns} for c, ns in
                                      sorted(t.preempted_by.items(), key=lambda x: -x[1])]}
                    for t in ss.threads],
        "ops": [{"op": o.op, "count": o.count, "op_ns": o.op_ns, "preempted_ns": o.preempted_ns,
                 "runnable_ns": o.runnable_ns, "sleeping_ns": o.sleeping_ns} for o in ss.ops],
    }}


def _roofline(profile: Profile) -> dict:
    rules = probepack.cost_rules(profile.meta.get("pack")) if profile.calls else {}
    if not profile.ops and not rules:
        return {}
    judged = recorded_calibration.roofs(profile)
    roofs = judged.value
    if roofs is None:
        return {"roofline": None}
    found = (roofline.call_verdicts(profile, roofs, rules) if profile.calls
             else roofline.verdicts(profile, roofs))
    return {"roofline": {
        "roofs": {"peak_gflops": roofs.peak_gflops, "peak_gbps": roofs.peak_gbps, "ridge": roofs.ridge,
                  **judged.as_json()},
        "verdicts": [{"scope": v.scope, "nodes": v.nodes, "time_ns": v.time_ns, "flops": v.flops,
                      "bytes": v.bytes, "gflops": v.gflops, "gbps": v.gbps, "intensity": v.intensity,
                      "bound": v.bound, "roof_share": v.roof_share,
                      "measured_gbps": v.measured_gbps}
                     for v in found]}}


def _counters(profile: Profile) -> dict:
    cs = counterstats.compute(profile)
    if cs is None:
        return {}

    def row(r: CounterRow) -> dict:
        return {"counted": r.counted, "dur_ns": r.dur_ns, "totals": r.totals, "derived": r.derived}

    return {"counters": {
        "names": cs.names,
        "dropped_ops": {k: profile.counter_dropped.get(k, 0)
                        for k in ("migrated", "unreadable", "not running", "unfinished")},
        "ops": [{"op": r.scope} | row(r) for r in cs.by_op],
        "phases": {p: row(r) for p, r in cs.by_phase.items()},
        "per_token": cs.per_token,
        "notes": cs.notes,
    }}


def write_json(profile: Profile, path: str | Path) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(summary(profile), f, indent=2)
        f.write("\n")
