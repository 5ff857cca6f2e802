"""vLLM's view of the profiles its collector fills (ops that are calls, engine steps): native
ops, their shapes, steps, the roofline of the ops its pack models, the server's own /metrics
beside profinfer's. It stands for any pack whose ops are calls (its collector records them)."""
from __future__ import annotations

from collections.abc import Sequence

from rich.console import Console
from rich.table import Table

from profinfer.core.profile import loghist
from profinfer.core.plugin import packs, timeline_groups
from profinfer.core.calibration import stamped
from profinfer.core.profile.model import Profile, Step
from profinfer.core.plugin.sections import ReportSection, SeriesSection, SummarySection, View, roofline_keys
from profinfer.core.plugin.tables import ms, op_table, print_cost, print_lost, roofline_origin, roofline_table, us
from profinfer.engines.vllm.views import callstats, comparable, cost
from profinfer.engines.vllm.views.callstats import CallProfileStats

TOP_SHAPES = 15


def holds(profile: Profile) -> bool:
    return bool(profile.calls or profile.steps or profile.call_totals)


def call_stats(profile: Profile) -> CallProfileStats:
    """callstats.compute, once per profile (the main view and the server table share it)."""
    return profile.derived("call_stats", (len(profile.calls), len(profile.steps), len(profile.call_totals)),
                           lambda: callstats.compute(profile))


def _shape_args(args) -> dict:
    return {name: (None if shape is None else {"dtype": dtype, "shape": list(shape)})
            for name, dtype, shape in args}


def _step_entry(steps: Sequence[Step]) -> dict:
    """One step's entry of the step timeline, or a group's (exporters/json_summary.py)."""
    first, one = steps[0], len(steps) == 1
    return {**({"pid": first.pid, "tid": first.tid} if one else {}),
            "start_ns": first.start_ns, "end_ns": steps[-1].end_ns, "dur_ns": sum(s.dur_ns for s in steps),
            "steps": len(steps), "tokens": sum(s.n_tokens for s in steps),
            **({"query_lens": list(first.query_lens)} if one else {}),
            "phase": timeline_groups.merged_phase(s.phase for s in steps),
            "prefill_seqs": sum(s.prefill_seqs for s in steps), "decode_seqs": sum(s.decode_seqs for s in steps),
            "calls": sum(s.n_calls for s in steps)}


def step_timeline(steps: list[Step]) -> dict:
    """The summary's step_list, bound as its decode_call_list is; step_group says by how much."""
    k, grouped = timeline_groups.groups(sorted(steps, key=lambda s: (s.start_ns, s.tid)))
    return {"step_group": k, "step_list": [_step_entry(g) for g in grouped]}


def _main_keys(profile: Profile) -> dict:
    """The same top-level keys as the neutral view's, with steps where it has decode calls."""
    st = call_stats(profile)
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
        **step_timeline(st.steps),
        "phases": {name: {"steps": ph.steps, "tokens": ph.tokens, "time_ns": ph.time_ns, "op_ns": ph.op_ns}
                   for name, ph in st.phases.items()},
        "server_metrics": [{"what": r.what, "server": r.server, "ours": r.ours, "unit": r.unit}
                           for r in callstats.server_rows(profile, st)],
        "meta": {str(k): str(v) for k, v in profile.meta.items()},
    }


def _cost_rules(profile: Profile) -> dict[str, dict]:
    return packs.cost_rules(profile.meta.get("pack")) if profile.calls or profile.call_totals else {}


def _roofline_keys(profile: Profile) -> dict:
    rules = _cost_rules(profile)
    if not rules:
        return {}
    return roofline_keys(stamped.roofs(profile),
                         lambda roofs: cost.call_verdicts(profile, roofs, rules))


def _args(args) -> str:
    return ", ".join(f"{name}=-" if shape is None else f"{name}={dtype}{list(shape)}"
                     for name, dtype, shape in args)


def shape_table(st: CallProfileStats) -> Table:
    t = Table(title=f"Ops by shape (top {TOP_SHAPES} by time)", title_justify="left")
    t.add_column("op")
    t.add_column("tensor arguments")
    for col in ("count", "total ms", "mean µs"):
        t.add_column(col, justify="right")
    for s in st.shapes[:TOP_SHAPES]:
        t.add_row(s.op, _args(s.args), f"{s.count:,}", ms(s.total_ns), us(s.total_ns / s.count))
    return t


def step_table(st: CallProfileStats) -> Table:
    t = Table(title="Steps (one model forward each)", title_justify="left")
    t.add_column("phase")
    for col in ("steps", "tokens", "time ms", "ms/step", "tokens/s", "native op ms"):
        t.add_column(col, justify="right")
    for name, ph in st.phases.items():
        per_step = ms(ph.time_ns / ph.steps) if ph.steps else "-"
        rate = "-" if ph.tokens_per_s is None else f"{ph.tokens_per_s:,.1f}"
        t.add_row(name, f"{ph.steps:,}", f"{ph.tokens:,}", ms(ph.time_ns), per_step, rate, ms(ph.op_ns))
    return t


def _value(v: float | None, unit: str) -> str:
    if v is None:
        return "-"
    return f"{v * 1e3:,.3f} ms" if unit == "s" else f"{v:,.0f}"


def server_table(rows: list[callstats.ServerRow]) -> Table:
    t = Table(title="The server's own /metrics over the recording, beside profinfer's",
              title_justify="left")
    t.add_column("")
    t.add_column("server", justify="right")
    t.add_column("profinfer", justify="right")
    for r in rows:
        t.add_row(r.what, _value(r.server, r.unit), _value(r.ours, r.unit))
    return t


def _print_main(profile: Profile, console: Console) -> None:
    st = call_stats(profile)
    console.print(op_table(st.ops, "Native ops (all threads)"))
    if profile.call_totals:
        console.print(f"[dim]calls counted in BPF (no timeline asked): p50 and p99 from a log "
                      f"histogram, within {loghist.PRECISION:.2%}; -o trace.pftrace records each call[/]")
    console.print(shape_table(st))
    if st.steps:
        console.print(step_table(st))
        rate = "-" if st.steps_per_s is None else f"{st.steps_per_s:,.1f}"
        console.print(f"steps {len(st.steps):,}   steps/s {rate}   prefill tokens "
                      f"{st.prefill_tokens:,}   decode tokens {st.decode_tokens:,}   "
                      f"lost events {profile.lost_events:,}")
    else:
        console.print("[yellow]no steps: none of the pack's step ops ran or was probed[/]")


def _print_roofline(profile: Profile, console: Console) -> None:
    rules = packs.cost_rules(profile.meta.get("pack"))
    judged = stamped.roofs(profile)
    if rules and judged.value is not None:
        vs = cost.call_verdicts(profile, judged.value, rules)
        if vs:
            console.print(roofline_table(vs[:12], judged.value))
            console.print(roofline_origin(judged))


def _print_server(profile: Profile, console: Console) -> None:
    rows = callstats.server_rows(profile, call_stats(profile))
    if rows:
        console.print(server_table(rows))


def _print_cost(profile: Profile, console: Console) -> None:
    print_cost(profile, console, say_origin=False)


def _print_unobserved(profile: Profile, console: Console) -> None:
    note = profile.meta.get("unobserved")
    if note:
        console.print(f"[yellow]{note}[/]")


# Levels beside the ops (sched, counters: 45) come between the steps and the roofline.
def setup(profile: Profile) -> dict[str, str]:
    """What diff says where two runs differ: eager or compiled."""
    mode = profile.meta.get("mode")
    return {"mode": mode.split(" ", 1)[0]} if mode else {}


VIEW = View(summary=(SummarySection(0, _main_keys), SummarySection(20, _roofline_keys)),
            report=(ReportSection(0, _print_main), ReportSection(47, _print_roofline),
                    ReportSection(48, _print_server), ReportSection(50, _print_cost),
                    ReportSection(51, _print_unobserved), ReportSection(99, print_lost)),
            series=(SeriesSection(0, comparable.series),))
SETUP = setup
IDENTITY = comparable.identity
