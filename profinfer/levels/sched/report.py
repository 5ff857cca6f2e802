"""The sched level's sections of the summary and the report: each thread's time on and off
the CPU (preempted, waiting to run, sleeping), and the ops that were not running."""
from __future__ import annotations

from rich.console import Console
from rich.table import Table

from profinfer.core.profile.model import Profile
from profinfer.core.plugin.sections import ReportSection, SummarySection
from profinfer.core.plugin.tables import ms, pct
from profinfer.levels.sched import stats as schedstats
from profinfer.levels.sched.stats import SchedStats


def _keys(profile: Profile) -> dict:
    ss = schedstats.compute(profile)
    if ss is None:
        return {}
    return {"sched": {
        "switches": ss.switches, "wakeups": ss.wakeups,
        "threads": [{"tid": t.tid, "name": t.name, "on_cpu_ns": t.on_cpu_ns,
                     "runnable_ns": t.runnable_ns, "preempted_ns": t.preempted_ns,
                     "sleeping_ns": t.sleeping_ns, "preemptions": t.preemptions,
                     "preempted_by": [{"comm": c, "ns": ns} for c, ns in
                                      sorted(t.preempted_by.items(), key=lambda x: -x[1])]}
                    for t in ss.threads],
        "ops": [{"op": o.op, "count": o.count, "op_ns": o.op_ns, "preempted_ns": o.preempted_ns,
                 "runnable_ns": o.runnable_ns, "sleeping_ns": o.sleeping_ns} for o in ss.ops],
    }}


def sched_tables(ss: SchedStats) -> tuple[Table, Table]:
    t = Table(title=f"Scheduler ({ss.switches:,} switches, {ss.wakeups:,} wakeups)", title_justify="left")
    t.add_column("tid", justify="right")
    t.add_column("name")
    for col in ("on CPU ms", "preempted ms", "preemptions", "wakeup wait ms", "sleeping ms"):
        t.add_column(col, justify="right")
    t.add_column("preempted by")
    for th in ss.threads:
        top = sorted(th.preempted_by.items(), key=lambda x: -x[1])[:2]
        t.add_row(str(th.tid), th.name, ms(th.on_cpu_ns), ms(th.preempted_ns), f"{th.preemptions:,}",
                  ms(th.waking_ns), ms(th.sleeping_ns),
                  ", ".join(f"{c} {ms(ns)} ms" for c, ns in top) or "-")
    o = Table(title="Ops while not running", title_justify="left")
    o.add_column("op")
    for col in ("count", "op ms", "preempted ms", "runnable ms", "sleeping ms", "preempted %"):
        o.add_column(col, justify="right")
    for r in ss.ops[:12]:
        o.add_row(r.op, f"{r.count:,}", ms(r.op_ns), ms(r.preempted_ns), ms(r.runnable_ns),
                  ms(r.sleeping_ns), pct(r.preempted_ns / r.op_ns if r.op_ns else None))
    return t, o


def _print(profile: Profile, console: Console) -> None:
    ss = schedstats.compute(profile)
    if ss:
        for table in sched_tables(ss):
            console.print(table)


SUMMARY = (SummarySection(30, _keys),)
REPORT = (ReportSection(45, _print),)
