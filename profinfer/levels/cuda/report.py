"""The cuda level's sections of the summary and the report: top kernels (and the ops that
launched them), copies by kind, syncs (where the host waited), graph launches, allocations
and what was never freed; and what its probes cost. They come before the engine's view, and
stand alone for a CUDA program that is no known engine."""
from __future__ import annotations

from rich.console import Console
from rich.table import Table

from profinfer.core.calibration import stamped
from profinfer.core.calibration.hits import Hit, trap_ns
from profinfer.core.profile.model import Profile
from profinfer.core.plugin.sections import ReportSection, SeriesSection, SummarySection
from profinfer.core.plugin.tables import ms, placement_line
from profinfer.levels.cuda import comparable, stats as cudastats

TOP_KERNELS = 15


def _mib(n: int) -> str:
    return f"{n / (1 << 20):,.3f}"


def holds(profile: Profile) -> bool:
    return bool(profile.cuda_calls)


def render(profile: Profile, console: Console) -> dict:
    steps = len(profile.steps) or len(profile.tokens)
    s = cudastats.summary(profile.cuda_calls, steps)
    t = Table(title=f"CUDA kernels (top {TOP_KERNELS} by launches; {s['launches']:,} launches, "
                    f"{s['captured_launches']:,} captured into graphs, {s['graph_launches']:,} graph launches"
                    + (f"; {s['launches_per_step']:.1f} launches per step" if steps else "") + ")",
              title_justify="left")
    for col, just in (("kernel", "left"), ("launches", "right"), ("captured", "right"),
                      ("configs", "right"), ("launched by op", "left")):
        t.add_column(col, justify=just)
    for name, k in list(s["kernels"].items())[:TOP_KERNELS]:
        ops = ", ".join(f"{op} {n:,}" for op, n in sorted(k["ops"].items(), key=lambda kv: -kv[1])[:3])
        t.add_row(name, f"{k['launches']:,}", f"{k['captured']:,}", f"{len(k['configs'])}", ops)
    console.print(t)
    if s["copies"]:
        t = Table(title="CUDA copies and sets by kind", title_justify="left")
        for col in ("kind", "calls", "MiB", "host ms"):
            t.add_column(col, justify="left" if col == "kind" else "right")
        for kind, c in sorted(s["copies"].items()):
            t.add_row(kind, f"{c['calls']:,}", _mib(c["bytes"]), ms(c["host_ns"]))
        console.print(t)
    if s["syncs"] or any("sync_ns" in v for v in s["per_op"].values()):
        t = Table(title="Where the host waited for the GPU (syncs)", title_justify="left")
        for col in ("call", "calls", "blocked ms", "max ms"):
            t.add_column(col, justify="left" if col == "call" else "right")
        for api, c in sorted(s["syncs"].items()):
            t.add_row(api, f"{c['calls']:,}", ms(c["blocked_ns"]), ms(c["max_ns"]))
        for op, v in sorted(s["per_op"].items()):
            if v.get("syncs"):
                t.add_row(f"  in {op}", f"{v['syncs']:,}", ms(v.get("sync_ns", 0)), "")
        console.print(t)
    m = s["memory"]
    console.print(f"CUDA memory: {m['allocations']:,} allocations ({_mib(m['allocated_bytes'])} MiB), "
                  f"{m['frees']:,} frees, {m['failed']:,} failed; device peak {_mib(m['device_peak_bytes'])} MiB, "
                  f"live at end {_mib(m['device_live_bytes_at_end'])} MiB")
    for leak in m["not_freed"][:10]:
        console.print(f"  never freed: {leak['bytes']:,} B {leak['memory']} at {leak['ptr']} "
                      f"({leak['api']} from {leak['site']})")
    if s["errors"]:
        console.print("CUDA calls that failed: " + "; ".join(
            f"{api} {sum(v.values()):,} (" + ", ".join(f"error {r}: {n}" for r, n in v.items()) + ")"
            for api, v in sorted(s["errors"].items())))
    return s


def cuda_cost(profile: Profile) -> dict | None:
    """What the cuda level's probes cost per call: the kernel-counted BPF time per run plus
    the traps (the calibrated cost of each probe hit), from the recording's cuda_cost meta."""
    meta = profile.meta
    if "cuda_cost:bpf_ns" not in meta:
        return None
    calls = sum(c.count for c in profile.cuda_calls)
    if not calls:
        return None
    hits = {h.value: int(meta.get(f"cuda_cost:{h.count_key}", 0)) for h in Hit}
    costs = stamped.trap_costs(profile).value
    out = {"calls": calls, "bpf_ns": int(meta["cuda_cost:bpf_ns"]), "hits": hits}
    if costs:
        # a return probe shares its function's first-instruction trap with the entry probe:
        # it adds what the return costs beyond it (probecost's uretprobe_extra_ns)
        trap = trap_ns(hits, costs)
        out["trap_ns"] = trap
        out["per_call_ns"] = (trap + out["bpf_ns"]) / calls
    return out


def cuda_cost_line(profile: Profile) -> str:
    c = cuda_cost(profile)
    if c is None:
        return "profiler cost: not counted"
    if "per_call_ns" not in c:
        return (f"profiler cost: {c['calls']:,} CUDA calls, BPF {c['bpf_ns'] / c['calls']:,.0f} ns each "
                "(trap cost not measured: run `profinfer calibrate`)")
    per = c["per_call_ns"]
    steps = len(profile.steps) or len(profile.tokens)
    calls_per_step = c["calls"] / steps if steps else None
    at = (f"{calls_per_step:,.0f} CUDA calls per step here: {per * calls_per_step / 1e3:,.1f} µs per step"
          if calls_per_step else f"at 1,000 launches per token: {per * 1e3 / 1e6:.2f} ms per token")
    return (f"profiler cost: {c['calls']:,} CUDA calls, {per / 1e3:.2f} µs added per call "
            f"(traps + BPF, calibrated); {at}")


def _keys(profile: Profile) -> dict:
    if not profile.cuda_calls:
        return {}
    out = cudastats.summary(profile.cuda_calls, len(profile.steps) or len(profile.tokens))
    out["profiler_cost"] = cuda_cost(profile)
    return {"cuda": out}


def _print(profile: Profile, console: Console) -> None:
    if profile.cuda_calls:
        render(profile, console)
        console.print(cuda_cost_line(profile))
        placed = placement_line(profile.meta, "cuda_")
        if placed:
            console.print(placed)


SUMMARY = (SummarySection(60, _keys),)
REPORT = (ReportSection(-10, _print, alone=True),)
SERIES = (SeriesSection(60, comparable.series),)
