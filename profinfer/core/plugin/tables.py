"""Number formats, tables and lines that more than one report section prints (rich)."""
from __future__ import annotations

import re

from rich.console import Console
from rich.table import Table

from profinfer.core.calibration import stamped, selfcost
from profinfer.core.profile.model import Profile
from profinfer.core.calibration.roofline import Roofs, Verdict
from profinfer.core.profile.stats import OpStats


def ms(ns: float | None) -> str:
    return "-" if ns is None else f"{ns / 1e6:,.3f}"


def us(ns: float | None) -> str:
    return "-" if ns is None else f"{ns / 1e3:,.1f}"


def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}"


def count(v: float) -> str:
    """A large count, short: 1.23G, 4.56M, 7.89k."""
    for unit, div in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(v) >= div:
            return f"{v / div:,.2f}{unit}"
    return f"{v:,.0f}"


def op_table(ops: list[OpStats], title: str = "Operators (all threads)") -> Table:
    t = Table(title=title, title_justify="left")
    t.add_column("op")
    for col in ("count", "total ms", "mean µs", "p50 µs", "p99 µs", "share %"):
        t.add_column(col, justify="right")
    for o in ops:
        t.add_row(o.op, f"{o.count:,}", ms(o.total_ns), us(o.mean_ns), us(o.p50_ns),
                  us(o.p99_ns), pct(o.share))
    return t


def roofs_line(roofs: Roofs) -> str:
    """The roofs a roofline is judged against, in one line."""
    caches = ", ".join(f"{c.level} {c.gbps:,.1f}" for c in roofs.caches)
    return (f"{roofs.peak_gbps:,.1f} GB/s read" + (f" (caches: {caches} GB/s)" if caches else
                                                  " (cache roofs not measured)")
            + f", {roofs.peak_gflops:,.1f} GFLOP/s f32 FMA; ridge {roofs.ridge:,.1f} FLOP/B")


def roofline_table(vs: list[Verdict], roofs: Roofs) -> Table:
    t = Table(title=f"Roofline (roofs: {roofs_line(roofs)})", title_justify="left")
    t.add_column("phase op")
    for col in ("nodes", "time ms", "GFLOP/s", "GB/s", "FLOP/B"):
        t.add_column(col, justify="right")
    t.add_column("verdict")
    t.add_column("roof")
    t.add_column("% of roof", justify="right")
    measured = any(v.measured_gbps is not None for v in vs)
    if measured:     # cross-check: DRAM reads the PMU saw (LLC load misses)
        t.add_column("GB/s (LLC misses)", justify="right")
    noted = any(v.notes for v in vs)
    if noted:
        t.add_column("note")
    for v in vs:
        extra = ([f"{v.measured_gbps:,.2f}" if v.measured_gbps is not None else "-"] if measured else [])
        t.add_row(v.scope, f"{v.nodes:,}", ms(v.time_ns), f"{v.gflops:,.2f}", f"{v.gbps:,.2f}",
                  f"{v.intensity:,.2f}", v.bound + ("" if v.bound == "neither" else "-bound"), v.roof,
                  f"{100 * v.roof_share:.0f}", *extra, *(["; ".join(v.notes)] if noted else []))
    return t


def roofline_origin(judged: stamped.Judged) -> str:
    """Whose roofs the verdicts were judged against (yellow when not the recording's own)."""
    return f"roofline: {judged.origin}" if judged.stored else f"[yellow]roofline: {judged.origin}[/]"


def cost_line(c: selfcost.SelfCost) -> str:
    """What profiling cost: probe hits and BPF time in the target, the collector's CPU."""
    hits = sum(c.hits.values())
    bpf = f"BPF {c.bpf_ns / max(c.bpf_runs, 1):,.0f} ns/run"
    if c.trap_ns is None:
        probes = f"{hits:,} probe hits ({bpf}; trap cost not measured: run `profinfer calibrate`)"
    else:
        share = c.in_target_share
        probes = (f"{hits:,} probe hits x {c.trap_ns / max(hits, 1) / 1e3:.2f} µs trap + {bpf}"
                  + ("" if share is None else f" = {share:.2%} of " + (
                      "the target's CPU time" if c.bearer_threads is None else
                      f"the time of the {c.bearer_threads} thread{'s' * (c.bearer_threads > 1)} that took them")))
    coll = c.collector_share
    slowdown = c.slowdown
    stated = "" if slowdown is None else (
        f"; time added {slowdown:.2%}"
        + ("" if c.trap_in_situ_ns is None else f" (traps at {c.trap_in_situ_ns / 1e3:.2f} µs, "
           + (c.trap_priced or "as the recording shows them"))
        + ("" if c.trap_in_situ_ns is None else
           (f", collector x{c.collector_factor:.2f} in the threads' time)" if c.collector_critical
            else ")")))
    return ("profiler cost: " + probes
            + ("" if coll is None else f"; collector {coll:.2%}") + stated)


def placement_line(meta: dict[str, str], prefix: str = "") -> str | None:
    """How many probes were attached and how many of them the kernel single-steps (and
    where), from the recording's <prefix>probes meta; None for a recording made before
    they were counted."""
    stepped = meta.get(f"{prefix}probes_stepped")
    if stepped is None:
        return None
    line = f"profiler cost: {int(meta.get(f'{prefix}probes', 0)):,} probes, {int(stepped):,} single-stepped"
    if int(stepped):
        return f"[yellow]{line} ({stepped_functions(meta.get(f'{prefix}probes_stepped_at', ''))})[/]"
    return line


def stepped_functions(listed: str, shown: int = 6) -> str:
    """The functions of a probes_stepped_at meta value, the first few of them (a C++ name
    by its qualified name, without its parameters)."""
    names = [_short_name(n) for n in listed.split(",") if n]
    return ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")


def _short_name(symbol: str) -> str:
    """An Itanium-mangled function name's qualified name (_Z16rotary_embeddingRN2at... ->
    rotary_embedding; _ZN3foo3barEv -> foo::bar); any other name as it is."""
    nested = symbol.startswith("_ZN")
    rest, parts = symbol[3 if nested else 2:], []
    while symbol.startswith("_Z") and (m := re.match(r"(\d+)", rest)):
        n = int(m.group(1))
        parts.append(rest[m.end():m.end() + n])
        rest = rest[m.end() + n:]
        if not nested or rest.startswith("E"):
            break
    return "::".join(parts) or symbol


def print_cost(profile: Profile, console: Console, say_origin: bool = True) -> None:
    """The profiler-cost line, (say_origin) whose trap costs it used when not the
    recording's own, and the probes placed."""
    trap = stamped.trap_costs(profile)
    cost = selfcost.compute(profile, trap.value)
    if cost:
        console.print(cost_line(cost))
        if say_origin and not trap.stored and trap.value is not None:
            console.print(f"[yellow]profiler cost: {trap.origin}[/]")
    placed = placement_line(profile.meta)
    if placed:
        console.print(placed)


def print_lost(profile: Profile, console: Console) -> None:
    if profile.lost_events:
        console.print(f"[yellow]warning: {profile.lost_events:,} events were lost; totals are lower bounds[/]")
