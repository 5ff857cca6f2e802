"""Terminal view of a comparison (exporters/comparison.py): what differs between the runs,
then each section's quantities with their change, interval and verdict."""
from __future__ import annotations

from rich.console import Console
from rich.table import Table

from profinfer.core.diff import compare

SECTION_TITLES = {"latency": "Latency", "op": "Ops per phase", "layer": "Layers",
                  "node": "Nodes (one kind in every layer)", "thread": "Threads",
                  "step": "Steps", "kernel": "CUDA kernels", "copy": "CUDA copies",
                  "cuda": "CUDA calls"}
# Sections shown whole; the others show only what moved unless --all.
WHOLE = ("latency", "op")
STYLE = {compare.SLOWER: "bold red", compare.FASTER: "bold green", compare.UNCERTAIN: "yellow"}


def _time(ns: float | None, unit: str) -> str:
    if ns is None:
        return "-"
    if not unit.startswith("ns"):
        return f"{ns:,.3g}"
    for div, name in ((1e9, "s"), (1e6, "ms"), (1e3, "µs")):
        if abs(ns) >= div:
            return f"{ns / div:,.3f} {name}"
    return f"{ns:,.0f} ns"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:+.1f}%"


def _side(run: dict) -> str:
    traces = run["traces"]
    return traces[0] if len(traces) == 1 else f"{len(traces)} runs ({traces[0]}, ...)"


def _moved(c: dict) -> bool:
    return c["verdict"] in (compare.SLOWER, compare.FASTER, compare.UNCERTAIN,
                            compare.ONLY_BEFORE, compare.ONLY_AFTER)


def render(result: dict, console: Console, show_all: bool = False) -> None:
    runs = result["runs"]
    console.print(f"[bold]{_side(runs['before'])}[/] → [bold]{_side(runs['after'])}[/]   "
                  f"({runs['before']['engine']}; {result['confidence']:.0%} intervals, {result['method']}; "
                  f"noise floor ±{result['noise']:.0%})")
    if result["only_build_differs"]:
        console.print("only the build differs: " + ", ".join(
            f"{d['fact'].removeprefix('build_id:')} {(d['before'] or '-')[:12]} → {(d['after'] or '-')[:12]}"
            for d in result["differences"]))
    elif result["differences"]:
        console.print("what differs: " + "; ".join(
            f"{d['fact']} {d['before'] or '-'} → {d['after'] or '-'}" for d in result["differences"]))
    else:
        console.print("what differs: nothing the recordings say (same build, model, machine, threads)")
    for w in result["warnings"]:
        console.print(f"[yellow]warning: {w}[/]")
    by_section: dict[str, list[dict]] = {}
    for c in result["changes"]:
        by_section.setdefault(c["section"], []).append(c)
    for section, rows in by_section.items():
        shown = rows if show_all or section in WHOLE else [c for c in rows if _moved(c)]
        hidden = len(rows) - len(shown)
        if shown:
            console.print(_table(SECTION_TITLES.get(section, section), shown))
        if hidden:
            console.print(f"{SECTION_TITLES.get(section, section)}: {hidden} more within noise or "
                          "unchanged (--all shows them)")
    if result["verdicts_changed"]:
        t = Table(title="Roofline verdicts that changed", title_justify="left")
        for col in ("scope", "before", "after"):
            t.add_column(col)
        for v in result["verdicts_changed"]:
            t.add_row(v["scope"], v["before"] or "-", v["after"] or "-")
        console.print(t)
    significant = sum(c["verdict"] in compare.SIGNIFICANT for c in result["changes"])
    console.print(f"{significant} significant change{'s' if significant != 1 else ''} "
                  f"of {len(result['changes'])} quantities")
    gate = result["gate"]
    if gate is None:
        return
    for r in gate["rows"]:
        style = "bold red" if r["verdict"] == "fail" else "yellow"
        interval = "" if r["low"] is None else f" ({_pct(r['low'])} .. {_pct(r['high'])})"
        runs = "" if r["verdict"] != "inconclusive" else \
            f"; {r['runs_needed']} runs a side would likely tell" if r["runs_needed"] else \
            "; more runs a side may not tell"
        console.print(f"[{style}]{r['verdict'].upper()} {r['gate']}: {r['name']} {_pct(r['change'])}{interval}: "
                      f"{r['why']}{runs}[/]")
    console.print(f"gate {', '.join(result['gates'])}: {gate['verdict'].upper()} (exit {gate['exit']}; "
                  f"{gate['passed']} row{'s' if gate['passed'] != 1 else ''} passed)")


def _table(title: str, rows: list[dict]) -> Table:
    t = Table(title=title, title_justify="left")
    t.add_column("quantity")
    for col in ("before", "after", "change", "interval"):
        t.add_column(col, justify="right")
    t.add_column("verdict")
    t.add_column("per", style="dim")
    for c in rows:
        interval = "-" if c["low"] is None else f"{_pct(c['low'])} .. {_pct(c['high'])}"
        style = STYLE.get(c["verdict"], "")
        t.add_row(c["name"], _time(c["before"], c["unit"]), _time(c["after"], c["unit"]),
                  _pct(c["change"]), interval, f"[{style}]{c['verdict']}[/]" if style else c["verdict"],
                  c["unit"].removeprefix("ns ").removeprefix("per "))
    return t
