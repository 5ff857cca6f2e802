"""Terminal report of a Profile: the main view (the neutral one below, over tokens, graphs
and ops, or the view of the engine that holds the profile), with each plugin's sections in
their order (core.sections)."""
from __future__ import annotations

from rich.console import Console
from rich.table import Table

from profinfer.core.plugin import sections
from profinfer.core.profile.model import Profile
from profinfer.core.plugin.sections import ReportSection, View
from profinfer.core.profile.stats import ProfileStats, compute, counted
from profinfer.core.plugin.tables import ms, op_table, pct, print_cost, print_lost
from profinfer.viewers import flight
from profinfer.viewers.terminal import report_console


def phase_table(st: ProfileStats) -> Table:
    t = Table(title="Phases", title_justify="left")
    t.add_column("phase")
    for col in ("calls", "tokens", "time ms", "ms/token", "tokens/s", "op ms", "barrier ms"):
        t.add_column(col, justify="right")
    t.add_column("top op")
    for ph in st.phases.values():
        per_token = ph.time_ns / ph.tokens if ph.tokens else None
        tps = ph.tokens_per_s
        top = f"{ph.ops[0].op} {pct(ph.ops[0].share)}%" if ph.ops else "-"
        t.add_row(ph.phase, f"{ph.calls:,}", f"{ph.tokens:,}", ms(ph.time_ns), ms(per_token),
                  "-" if tps is None else f"{tps:,.1f}", ms(ph.op_ns), ms(ph.barrier_ns), top)
    return t


def thread_table(st: ProfileStats) -> Table:
    t = Table(title="Threads", title_justify="left")
    t.add_column("tid", justify="right")
    t.add_column("name")
    for col in ("graph ms", "arrival ms", "op ms", "barrier ms", "coverage %"):
        t.add_column(col, justify="right")
    for th in st.threads:
        t.add_row(str(th.tid), th.name, ms(th.graph_ns), ms(th.arrival_ns), ms(th.op_ns),
                  ms(th.barrier_ns), pct(th.coverage))
    return t


def latency_line(st: ProfileStats) -> str:
    tps = st.tokens_per_s
    return (f"TTFT {ms(st.ttft_ns)} ms   TPOT {ms(st.tpot_ns)} ms   "
            f"decode {'-' if tps is None else f'{tps:,.2f}'} tokens/s   "
            f"sequences {len(st.sequences)}   lost events {st.lost_events:,}")


# Said under the op table of ops counted in BPF: which views need every node, and how to get them.
COUNTED = ("op level counted in BPF per op type and phase (no timeline asked): calls, total and "
           "mean time; -o trace.pftrace records every node (percentiles, barrier waits, per-thread "
           "op time, roofline, layers, MoE)")


def _main(profile: Profile, console: Console) -> None:
    st = compute(profile)
    console.print(op_table(st.ops))
    if counted(profile):
        console.print(COUNTED)
    console.print(phase_table(st))
    console.print(latency_line(st))
    console.print(thread_table(st))


# The view of a profile of tokens, graphs and ops that no engine's own view stands for.
NEUTRAL = View(report=(ReportSection(0, _main), ReportSection(50, print_cost), ReportSection(99, print_lost)))


# In every report: a flight recorder's capture says first what fired it.
COMMON = (ReportSection(-20, flight.print_flight, alone=True),)


def render(profile: Profile, console: Console | None = None) -> None:
    """Print the report."""
    console = console or report_console()
    for section in sections.report_sections(profile, NEUTRAL, COMMON):
        section.render(profile, console)
