"""Terminal report of a Profile: op table, phase totals, latency line, thread table."""
from __future__ import annotations

from rich.console import Console
from rich.table import Table

from profinfer.model import Profile
from profinfer.stats import ProfileStats, compute


def _ms(ns: float | None) -> str:
    return "-" if ns is None else f"{ns / 1e6:,.3f}"


def _us(ns: float | None) -> str:
    return "-" if ns is None else f"{ns / 1e3:,.1f}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}"


def op_table(st: ProfileStats) -> Table:
    t = Table(title="Operators (all threads)", title_justify="left")
    t.add_column("op")
    for col in ("count", "total ms", "mean µs", "p50 µs", "p99 µs", "share %"):
        t.add_column(col, justify="right")
    for o in st.ops:
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
    for col in ("graph ms", "op ms", "barrier ms", "coverage %"):
        t.add_column(col, justify="right")
    for th in st.threads:
        t.add_row(str(th.tid), th.name, _ms(th.graph_ns), _ms(th.op_ns), _ms(th.barrier_ns),
                  _pct(th.coverage))
    return t


def latency_line(st: ProfileStats) -> str:
    tps = st.tokens_per_s
    return (f"TTFT {_ms(st.ttft_ns)} ms   TPOT {_ms(st.tpot_ns)} ms   "
            f"decode {'-' if tps is None else f'{tps:,.2f}'} tokens/s   "
            f"sequences {len(st.sequences)}   lost events {st.lost_events:,}")


def render(profile: Profile, console: Console | None = None) -> ProfileStats:
    """Print the report; returns the stats it was built from."""
    console = console or Console()
    st = compute(profile)
    console.print(op_table(st))
    console.print(phase_table(st))
    console.print(latency_line(st))
    console.print(thread_table(st))
    if st.lost_events:
        console.print(f"[yellow]warning: {st.lost_events:,} events were lost; totals are lower bounds[/]")
    return st
