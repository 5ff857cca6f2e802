"""llama.cpp's sections of the summary and the report: the roofline of its graph nodes (ggml's
cost model), time per transformer layer and against the context length, MoE expert
activations, llama-server's requests. Its tokens, graphs and ops are shown by the neutral main view."""
from __future__ import annotations

from rich.console import Console
from rich.table import Table

from profinfer.core.calibration import stamped
from profinfer.core.profile.model import Profile
from profinfer.core.plugin.sections import ReportSection, SeriesSection, SummarySection, roofline_keys
from profinfer.core.plugin.tables import ms, pct, roofline_origin, roofline_table
from profinfer.engines.llamacpp.views import comparable, cost, layers, moe, requests


def holds(profile: Profile) -> bool:
    return bool(profile.tokens or profile.ops or profile.op_totals)


def _roofline_keys(profile: Profile) -> dict:
    if not profile.ops or profile.calls:
        return {}
    return roofline_keys(stamped.roofs(profile), lambda roofs: cost.verdicts(profile, roofs))


def _layer_keys(profile: Profile) -> dict:
    if not profile.ops or not profile.graphs:
        return {}
    return {"layers": [{"layer": r.layer, "phase": r.phase, "nodes": r.nodes, "time_ns": r.time_ns}
                       for r in layers.layer_times(profile)],
            "decode_by_context": [{"kv_len": r.kv_len, "calls": r.calls, "mean_call_ns": r.mean_call_ns,
                                   "mean_attention_ns": r.mean_attention_ns}
                                  for r in layers.decode_by_context(profile)]}


def _moe_keys(profile: Profile) -> dict:
    moe_stats = moe.compute(profile)
    if moe_stats is None:
        return {}
    return {"moe": {"n_experts": moe_stats.n_experts, "n_used": moe_stats.n_used, "layers": moe_stats.layers,
                    "activations": moe_stats.total, "routed_tokens": moe_stats.tokens,
                    "counts": moe_stats.counts.tolist(),
                    "by_phase": {p: c.tolist() for p, c in moe_stats.by_phase.items()}}}


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
            cells += [ms(r.time_ns) if r else "-", pct(r.time_ns / totals[ph]) if r else "-"]
        t.add_row("outside layers" if layer is None else str(layer), *cells)
    return t


def context_table(rows: list[layers.ContextRow]) -> Table:
    t = Table(title="Decode time vs context (KV length read by attention)", title_justify="left")
    for col in ("KV length", "calls", "ms / call", "attention ms / call", "attention %"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(f"{r.kv_len:,}", f"{r.calls:,}", ms(r.mean_call_ns), ms(r.mean_attention_ns),
                  pct(r.mean_attention_ns / r.mean_call_ns if r.mean_call_ns else None))
    return t


def moe_heatmap(moe_stats: moe.MoeStats) -> Table:
    t = Table(title=f"MoE expert activations ({moe_stats.total:,}: {sum(moe_stats.tokens.values()):,} routed tokens × "
              f"{moe_stats.n_used} experts × {len(moe_stats.layers)} layers)", title_justify="left")
    t.add_column("layer", justify="right")
    for e in range(moe_stats.n_experts):
        t.add_column(f"e{e}", justify="right")
    peak = max(int(moe_stats.counts.max()), 1)
    for i, layer in enumerate(moe_stats.layers):
        cells = []
        for v in moe_stats.counts[i].tolist():
            heat = int(255 * (1 - v / peak))
            cells.append(f"[on rgb(255,{heat},{heat})]{v:,}[/]")
        t.add_row(str(layer), *cells)
    return t


def _print_roofline(profile: Profile, console: Console) -> None:
    if not profile.ops or profile.calls:
        return
    judged = stamped.roofs(profile)
    if judged.value is not None and (vs := cost.verdicts(profile, judged.value)):
        console.print(roofline_table(vs[:12], judged.value))
    console.print(roofline_origin(judged))


def _print_layers(profile: Profile, console: Console) -> None:
    if not profile.ops or not profile.graphs:
        return
    lrows = layers.layer_times(profile)
    if any(r.layer is not None for r in lrows):
        console.print(layer_table(lrows))
    crows = layers.decode_by_context(profile)
    if crows:
        console.print(context_table(crows))


def _print_moe(profile: Profile, console: Console) -> None:
    moe_stats = moe.compute(profile)
    if moe_stats:
        console.print(moe_heatmap(moe_stats))


SUMMARY = (SummarySection(20, _roofline_keys), SummarySection(40, _layer_keys),
           SummarySection(41, _moe_keys), SummarySection(42, requests.keys))
REPORT = (ReportSection(20, _print_roofline), ReportSection(40, _print_layers),
          ReportSection(41, _print_moe), ReportSection(42, requests.render))
SERIES = (SeriesSection(40, comparable.series),)
IDENTITY = comparable.identity
SETUP = comparable.shapes
