"""Terminal report of a Profile: op table, phase totals, latency line, thread table."""
from __future__ import annotations

from rich.console import Console
from rich.table import Table

from profinfer.levels.counters import stats as counterstats
from profinfer.engines.llamacpp import layers, moe
from profinfer.core import recorded_calibration, roofline, selfcost
from profinfer.levels.sched import stats as schedstats
from profinfer.levels.counters.stats import CounterStats
from profinfer.core.model import Profile
from profinfer.core.roofline import Roofs, Verdict
from profinfer.levels.sched.stats import SchedStats
from profinfer.core.stats import OpStats, ProfileStats, compute
from profinfer.viewers.terminal import report_console


def _ms(ns: float | None) -> str:
    return "-" if ns is None else f"{ns / 1e6:,.3f}"


def _us(ns: float | None) -> str:
    return "-" if ns is None else f"{ns / 1e3:,.1f}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}"


def op_table(ops: list[OpStats], title: str = "Operators (all threads)") -> Table:
    t = Table(title=title, title_justify="left")
    t.add_column("op")
    for col in ("count", "total ms", "mean µs", "p50 µs", "p99 µs", "share %"):
        t.add_column(col, justify="right")
    for o in ops:
        t.add_row(o.op, f"{o.count:,}", _ms(o.total_ns), _us(o.mean_ns), _us(o.p50_ns),
                  _us(o.p99_ns), _pct(o.share))
    return t


def phase_table(st: ProfileStats) -> Table:
    t = Table(title="Phases", title_justify="left")
    t.add_column("phase")
    for col in ("calls", "tokens", "time ms", "ms/token", "tokens/s", "op ms", "barrier ms"):
        t.add_column(col, justify="right")
    t.add_column("top op")
    for ph in st.phases.values():
        per_token = ph.time_ns / ph.tokens if ph.tokens else None
        tps = ph.tokens_per_s
        top = f"{ph.ops[0].op} {_pct(ph.ops[0].share)}%" if ph.ops else "-"
        t.add_row(ph.phase, f"{ph.calls:,}", f"{ph.tokens:,}", _ms(ph.time_ns), _ms(per_token),
                  "-" if tps is None else f"{tps:,.1f}", _ms(ph.op_ns), _ms(ph.barrier_ns), top)
    return t


def thread_table(st: ProfileStats) -> Table:
    t = Table(title="Threads", title_justify="left")
    t.add_column("tid", justify="right")
    t.add_column("name")
    for col in ("graph ms", "arrival ms", "op ms", "barrier ms", "coverage %"):
        t.add_column(col, justify="right")
    for th in st.threads:
        t.add_row(str(th.tid), th.name, _ms(th.graph_ns), _ms(th.arrival_ns), _ms(th.op_ns),
                  _ms(th.barrier_ns), _pct(th.coverage))
    return t


def _count(v: float) -> str:
    for unit, div in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(v) >= div:
            return f"{v / div:,.2f}{unit}"
    return f"{v:,.0f}"


def counter_table(cs: CounterStats) -> Table:
    t = Table(title="Counters per op (scaled for multiplexing; counted ops only)", title_justify="left")
    t.add_column("op")
    t.add_column("counted", justify="right")
    for n in cs.names:
        t.add_column(n, justify="right")
    metrics = [m for m in dict.fromkeys(k for r in cs.by_op for k in r.derived)]
    for m in metrics:
        t.add_column(m, justify="right")
    for r in cs.by_op:
        t.add_row(r.scope, f"{r.counted:,}", *(_count(r.totals[n]) for n in cs.names),
                  *(f"{r.derived[m]:,.2f}" if m in r.derived else "-" for m in metrics))
    return t


def roofline_table(vs: list[Verdict], roofs: Roofs) -> Table:
    t = Table(title=f"Roofline (roofs: {roofs.peak_gbps:,.1f} GB/s read, {roofs.peak_gflops:,.1f} "
              f"GFLOP/s f32 FMA; ridge {roofs.ridge:,.1f} FLOP/B)", title_justify="left")
    t.add_column("phase op")
    for col in ("nodes", "time ms", "GFLOP/s", "GB/s", "FLOP/B"):
        t.add_column(col, justify="right")
    t.add_column("verdict")
    t.add_column("% of roof", justify="right")
    measured = any(v.measured_gbps is not None for v in vs)
    if measured:     # cross-check: DRAM reads the PMU saw (LLC load misses)
        t.add_column("GB/s (LLC misses)", justify="right")
    for v in vs:
        extra = ([f"{v.measured_gbps:,.2f}" if v.measured_gbps is not None else "-"] if measured else [])
        t.add_row(v.scope, f"{v.nodes:,}", _ms(v.time_ns), f"{v.gflops:,.2f}", f"{v.gbps:,.2f}",
                  f"{v.intensity:,.2f}", v.bound + ("" if v.bound == "neither" else "-bound"),
                  f"{100 * v.roof_share:.0f}", *extra)
    return t


def sched_tables(ss: SchedStats) -> tuple[Table, Table]:
    t = Table(title=f"Scheduler ({ss.switches:,} switches, {ss.wakeups:,} wakeups)", title_justify="left")
    t.add_column("tid", justify="right")
    t.add_column("name")
    for col in ("on CPU ms", "preempted ms", "preemptions", "wakeup wait ms", "sleeping ms"):
        t.add_column(col, justify="right")
    t.add_column("preempted by")
    for th in ss.threads:
        top = sorted(th.preempted_by.items(), key=lambda x: -x[1])[:2]
        t.add_row(str(th.tid), th.name, _ms(th.on_cpu_ns), _ms(th.preempted_ns), f"{th.preemptions:,}",
                  _ms(th.waking_ns), _ms(th.sleeping_ns),
                  ", ".join(f"{c} {_ms(ns)} ms" for c, ns in top) or "-")
    o = Table(title="Ops while not running", title_justify="left")
    o.add_column("op")
    for col in ("count", "op ms", "preempted ms", "runnable ms", "sleeping ms", "preempted %"):
        o.add_column(col, justify="right")
    for r in ss.ops[:12]:
        o.add_row(r.op, f"{r.count:,}", _ms(r.op_ns), _ms(r.preempted_ns), _ms(r.runnable_ns),
                  _ms(r.sleeping_ns), _pct(r.preempted_ns / r.op_ns if r.op_ns else None))
    return t, o


def layer_table(rows: list[layers.LayerRow]) -> Table:
    by_layer: dict = {}
    phases = sorted({r.phase for r in rows})
    for r in rows:
        by_layer.setdefault(r.layer, {})[r.phase] = r
    t = Table(title="Per layer (node time: its longest thread's slice)",
              title_justify="left")
    t.add_column("layer", justify="right")
    for ph in phases:
        t.add_column(f"{ph} ms", justify="right")
        t.add_column(f"{ph} %", justify="right")
    totals = {ph: sum(r.time_ns for r in rows if r.phase == ph) or 1 for ph in phases}
    order = sorted(by_layer, key=lambda l: (l is None, l if l is not None else 0))
    for layer in order:
        cells = []
        for ph in phases:
            r = by_layer[layer].get(ph)
            cells += [_ms(r.time_ns) if r else "-", _pct(r.time_ns / totals[ph]) if r else "-"]
        t.add_row("outside layers" if layer is None else str(layer), *cells)
    return t


def context_table(rows: list[layers.ContextRow]) -> Table:
    t = Table(title="Decode time vs context (KV length read by attention)", title_justify="left")
    for col in ("KV length", "calls", "ms / call", "attention ms / call", "attention %"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(f"{r.kv_len:,}", f"{r.calls:,}", _ms(r.mean_call_ns), _ms(r.mean_attention_ns),
                  _pct(r.mean_attention_ns / r.mean_call_ns if r.mean_call_ns else None))
    return t


def moe_heatmap(ms: moe.MoeStats) -> Table:
    t = Table(title=f"MoE expert activations ({ms.total:,}: {sum(ms.tokens.values()):,} routed tokens × "
              f"{ms.n_used} experts × {len(ms.layers)} layers)", title_justify="left")
    t.add_column("layer", justify="right")
    for e in range(ms.n_experts):
        t.add_column(f"e{e}", justify="right")
    peak = max(int(ms.counts.max()), 1)
    for i, layer in enumerate(ms.layers):
        cells = []
        for v in ms.counts[i].tolist():
            heat = int(255 * (1 - v / peak))
            cells.append(f"[on rgb(255,{heat},{heat})]{v:,}[/]")
        t.add_row(str(layer), *cells)
    return t


def latency_line(st: ProfileStats) -> str:
    tps = st.tokens_per_s
    return (f"TTFT {_ms(st.ttft_ns)} ms   TPOT {_ms(st.tpot_ns)} ms   "
            f"decode {'-' if tps is None else f'{tps:,.2f}'} tokens/s   "
            f"sequences {len(st.sequences)}   lost events {st.lost_events:,}")


def render(profile: Profile, console: Console | None = None) -> ProfileStats:
    """Print the report; returns the stats it was built from."""
    console = console or report_console()
    if profile.cuda_calls:
        from profinfer.viewers import cudatable
        engine = bool(profile.calls or profile.steps or profile.tokens or profile.ops)
        if not engine:               # a program that is no known engine: its CUDA calls only
            cudatable.render(profile, console)
            console.print(cudatable.cuda_cost_line(profile))
            return compute(profile)
        cudatable.render(profile, console)
        console.print(cudatable.cuda_cost_line(profile))
    if profile.calls or profile.steps:
        from profinfer.viewers import calltable
        return calltable.render(profile, console)
    st = compute(profile)
    console.print(op_table(st.ops))
    console.print(phase_table(st))
    console.print(latency_line(st))
    console.print(thread_table(st))
    if profile.ops:
        judged = recorded_calibration.roofs(profile)
        if judged.value is not None and (vs := roofline.verdicts(profile, judged.value)):
            console.print(roofline_table(vs[:12], judged.value))
        console.print(f"roofline: {judged.origin}" if judged.stored else f"[yellow]roofline: {judged.origin}[/]")
    if profile.ops and profile.graphs:
        lrows = layers.layer_times(profile)
        if any(r.layer is not None for r in lrows):
            console.print(layer_table(lrows))
        crows = layers.decode_by_context(profile)
        if crows:
            console.print(context_table(crows))
    ms = moe.compute(profile)
    if ms:
        console.print(moe_heatmap(ms))
    render_sched_and_counters(profile, console)
    trap = recorded_calibration.trap_costs(profile)
    cost = selfcost.compute(profile, trap.value)
    if cost:
        console.print(cost_line(cost))
        if not trap.stored and trap.value is not None:
            console.print(f"[yellow]profiler cost: {trap.origin}[/]")
    if st.lost_events:
        console.print(f"[yellow]warning: {st.lost_events:,} events were lost; totals are lower bounds[/]")
    return st


def render_sched_and_counters(profile: Profile, console: Console) -> None:
    """The sched level's tables and the counters' (either engine's ops)."""
    ss = schedstats.compute(profile)
    if ss:
        for table in sched_tables(ss):
            console.print(table)
    cs = counterstats.compute(profile)
    if cs:
        console.print(counter_table(cs))
        per_tok = ", ".join(f"{p}: " + " ".join(f"{n} {_count(v)}" for n, v in vals.items())
                            for p, vals in cs.per_token.items())
        if per_tok:
            console.print(f"per token: {per_tok}")
        for note in cs.notes:
            console.print(f"[yellow]counters: {note}[/]")


def cost_line(c: selfcost.SelfCost) -> str:
    """What profiling cost: probe hits and BPF time in the target, the collector's CPU."""
    hits = sum(c.hits.values())
    bpf = f"BPF {c.bpf_ns / max(c.bpf_runs, 1):,.0f} ns/run"
    if c.trap_ns is None:
        probes = f"{hits:,} probe hits ({bpf}; trap cost not measured: run `profinfer calibrate`)"
    else:
        share = c.in_target_share
        probes = (f"{hits:,} probe hits x {c.trap_ns / max(hits, 1) / 1e3:.2f} µs trap + {bpf}"
                  + ("" if share is None else f" = {share:.2%} of the target's CPU time"))
    coll = c.collector_share
    slowdown = c.slowdown
    stated = "" if slowdown is None else (
        f"; time added {slowdown:.2%}"
        + ("" if c.trap_in_situ_ns is None else f" (traps at {c.trap_in_situ_ns / 1e3:.2f} µs, as the recording shows them")
        + ("" if c.trap_in_situ_ns is None else
           (f", collector x{c.collector_factor:.2f} in the threads' time)" if c.collector_critical
            else ")")))
    return ("profiler cost: " + probes
            + ("" if coll is None else f"; collector {coll:.2%}") + stated)
