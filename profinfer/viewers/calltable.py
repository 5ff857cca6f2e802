"""Terminal report of a Profile whose ops are calls (vLLM): ops, their shapes, steps."""
from __future__ import annotations

from rich.console import Console
from rich.table import Table

from profinfer.engines.vllm import callstats
from profinfer.core import packs as probepack, recorded_calibration, roofline, selfcost
from profinfer.engines.vllm.callstats import CallProfileStats
from profinfer.core.model import Profile
from profinfer.viewers.optable import _ms, _us, cost_line, op_table, render_sched_and_counters, roofline_table

TOP_SHAPES = 15


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
        t.add_row(s.op, _args(s.args), f"{s.count:,}", _ms(s.total_ns), _us(s.total_ns / s.count))
    return t


def step_table(st: CallProfileStats) -> Table:
    t = Table(title="Steps (one model forward each)", title_justify="left")
    t.add_column("phase")
    for col in ("steps", "tokens", "time ms", "ms/step", "tokens/s", "native op ms"):
        t.add_column(col, justify="right")
    for name, ph in st.phases.items():
        per_step = _ms(ph.time_ns / ph.steps) if ph.steps else "-"
        rate = "-" if ph.tokens_per_s is None else f"{ph.tokens_per_s:,.1f}"
        t.add_row(name, f"{ph.steps:,}", f"{ph.tokens:,}", _ms(ph.time_ns), per_step, rate, _ms(ph.op_ns))
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


def render(profile: Profile, console: Console) -> CallProfileStats:
    st = callstats.compute(profile)
    console.print(op_table(st.ops, "Native ops (all threads)"))
    console.print(shape_table(st))
    if st.steps:
        console.print(step_table(st))
        rate = "-" if st.steps_per_s is None else f"{st.steps_per_s:,.1f}"
        console.print(f"steps {len(st.steps):,}   steps/s {rate}   prefill tokens "
                      f"{st.prefill_tokens:,}   decode tokens {st.decode_tokens:,}   "
                      f"lost events {profile.lost_events:,}")
    else:
        console.print("[yellow]no steps: none of the pack's step ops ran or was probed[/]")
    render_sched_and_counters(profile, console)
    rules = probepack.cost_rules(profile.meta.get("pack"))
    judged = recorded_calibration.roofs(profile)
    if rules and judged.value is not None:
        vs = roofline.call_verdicts(profile, judged.value, rules)
        if vs:
            console.print(roofline_table(vs[:12], judged.value))
            console.print(f"roofline: {judged.origin}" if judged.stored else f"[yellow]roofline: {judged.origin}[/]")
    rows = callstats.server_rows(profile, st)
    if rows:
        console.print(server_table(rows))
    trap = recorded_calibration.trap_costs(profile)
    cost = selfcost.compute(profile, trap.value)
    if cost:
        console.print(cost_line(cost))
    note = profile.meta.get("unobserved")
    if note:
        console.print(f"[yellow]{note}[/]")
    if profile.lost_events:
        console.print(f"[yellow]warning: {profile.lost_events:,} events were lost; totals are lower bounds[/]")
    return st
