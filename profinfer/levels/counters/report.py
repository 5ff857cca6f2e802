"""The counters' sections of the summary and the report: perf counters per op (scaled for
multiplexing), per phase and per token, with the metrics derived from them."""
from __future__ import annotations

from rich.console import Console
from rich.table import Table

from profinfer.core.profile.model import Profile
from profinfer.core.plugin.sections import ReportSection, SummarySection
from profinfer.core.plugin.tables import count
from profinfer.levels.counters import stats as counterstats
from profinfer.levels.counters.stats import CounterRow, CounterStats


def _keys(profile: Profile) -> dict:
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
        t.add_row(r.scope, f"{r.counted:,}", *(count(r.totals[n]) for n in cs.names),
                  *(f"{r.derived[m]:,.2f}" if m in r.derived else "-" for m in metrics))
    return t


def _print(profile: Profile, console: Console) -> None:
    cs = counterstats.compute(profile)
    if cs:
        console.print(counter_table(cs))
        per_tok = ", ".join(f"{p}: " + " ".join(f"{n} {count(v)}" for n, v in vals.items())
                            for p, vals in cs.per_token.items())
        if per_tok:
            console.print(f"per token: {per_tok}")
        for note in cs.notes:
            console.print(f"[yellow]counters: {note}[/]")


SUMMARY = (SummarySection(10, _keys),)
REPORT = (ReportSection(46, _print),)
