"""What a plugin's `report` module contributes to the JSON summary and the terminal report,
and the order they come in.

A report module (Plugin.report, e.g. profinfer/engines/vllm/views/report.py) may define:
- `holds(profile) -> bool`: whether the profile holds its records (an engine's ops, calls,
  decode calls; a level's own records);
- `SUMMARY`: SummarySections, keys it adds to the JSON summary;
- `REPORT`: ReportSections, what it prints in the terminal report;
- `SERIES`: SeriesSections, the quantities `diff` compares beyond the main view's;
- `IDENTITY(profile) -> dict`: what two runs must share to be compared (an engine's model
  structure: its layers, its graph's nodes), each fact a string or a frozenset of strings;
- `SETUP(profile) -> dict[str, str]`: what two comparable runs may differ in, said when they
  do (the shapes of a model's nodes);
- `VIEW` (an engine): its own main view, which replaces the neutral one (the exporter's and
  the viewer's, over tokens, graphs and ops) for the profiles it holds. An engine that holds
  a profile without one (llama.cpp) is shown by the neutral view.

Sections stand in the order of their `order`, lower first; a section whose records are not in
the profile adds no key and prints nothing. The summary's bands: 0 the main view's keys, 10
counters per op, 20 the roofline, 30 scheduling, 40 an engine's analyses, 50 the profiler's
cost, 60 a runtime level (cuda). The report's: below 0 a runtime level's own tables, 0 the
main view, 20 the roofline, 40 an engine's analyses, 45 levels beside the ops, 50 the
profiler's cost, 99 the lost-events warning.

A profile that no engine holds but a level does (a CUDA program that is no known engine)
reports only the sections marked `alone`.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

from profinfer.core.base import registry
from profinfer.core.diff.compare import Series
from profinfer.core.profile.model import Profile
from profinfer.core.calibration.roofline import Roofs, Verdict


@dataclass(frozen=True)
class SummarySection:
    order: int
    keys: Callable[[Profile], dict]          # the keys it adds ({} for none)


@dataclass(frozen=True)
class ReportSection:
    order: int
    render: Callable[[Profile, object], None]   # (profile, rich Console): prints its part
    alone: bool = False                          # also for a profile only levels' records fill


@dataclass(frozen=True)
class SeriesSection:
    """What `diff` compares (core.compare): a plugin's quantities of a profile, a sample per
    unit of work each."""
    order: int
    series: Callable[[Profile], list[Series]]


@dataclass(frozen=True)
class View:
    """A main view: the summary's and the report's sections for the profiles it stands for,
    and the quantities `diff` compares."""
    summary: tuple[SummarySection, ...] = ()
    report: tuple[ReportSection, ...] = ()
    series: tuple[SeriesSection, ...] = ()


def report_modules() -> list[tuple[registry.Plugin, ModuleType]]:
    """Each registered plugin's report module, by plugin name."""
    return [(p, p.part("report")) for p in registry.plugins() if p.report]


def _holds(module: ModuleType, profile: Profile) -> bool:
    holds = getattr(module, "holds", None)
    return bool(holds and holds(profile))


def main_view(profile: Profile, neutral: View) -> View | None:
    """The view of the engine that holds the profile where it has one, else `neutral`; None
    when no engine holds it but a level does (its sections stand alone)."""
    modules = report_modules()
    engines = [m for p, m in modules if isinstance(p, registry.Engine) and _holds(m, profile)]
    for m in engines:
        if getattr(m, "VIEW", None) is not None:
            return m.VIEW
    if not engines and any(_holds(m, profile) for p, m in modules if isinstance(p, registry.Level)):
        return None
    return neutral


def summary_sections(profile: Profile, neutral: View, common: tuple[SummarySection, ...] = ()
                     ) -> list[SummarySection]:
    """The summary's sections for this profile, in order."""
    main = main_view(profile, neutral) or neutral
    found = [*main.summary, *common,
             *(s for _, m in report_modules() for s in getattr(m, "SUMMARY", ()))]
    return sorted(found, key=lambda s: s.order)


def report_sections(profile: Profile, neutral: View, common: tuple[ReportSection, ...] = ()
                    ) -> list[ReportSection]:
    """The report's sections for this profile, in order."""
    main = main_view(profile, neutral)
    found = [*common, *(s for _, m in report_modules() for s in getattr(m, "REPORT", ()))]
    if main is None:
        found = [s for s in found if s.alone]
    else:
        found += main.report
    return sorted(found, key=lambda s: s.order)


def series_sections(profile: Profile, neutral: View) -> list[SeriesSection]:
    """What `diff` compares for this profile, in order (as the report's sections: the main
    view's, then every plugin's own)."""
    main = main_view(profile, neutral)
    found = [*(main.series if main is not None else ()),
             *(s for _, m in report_modules() for s in getattr(m, "SERIES", ()))]
    return sorted(found, key=lambda s: s.order)


def facts(profile: Profile, hook: str) -> dict[str, object]:
    """What the plugins that hold this profile say of it through `hook` ("IDENTITY": what two
    runs must share to be compared; "SETUP": what may differ, and is said when it does)."""
    out: dict[str, object] = {}
    for _, m in report_modules():
        fn = getattr(m, hook, None)
        if fn is not None and _holds(m, profile):
            out.update(fn(profile))
    return out


def roofline_keys(judged, verdicts: Callable[[Roofs], list[Verdict]]) -> dict:
    """The summary's "roofline": the roofs judged with (recorded_calibration.Judged) and the
    verdicts an engine's cost model gives against them; None without roofs."""
    roofs = judged.value
    if roofs is None:
        return {"roofline": None}
    return {"roofline": {
        "roofs": {"peak_gflops": roofs.peak_gflops, "peak_gbps": roofs.peak_gbps, "ridge": roofs.ridge,
                  "caches": [{"level": c.level, "gbps": c.gbps, "bytes": c.bytes} for c in roofs.caches],
                  **judged.as_json()},
        "verdicts": [{"scope": v.scope, "nodes": v.nodes, "time_ns": v.time_ns, "flops": v.flops,
                      "bytes": v.bytes, "gflops": v.gflops, "gbps": v.gbps, "intensity": v.intensity,
                      "bound": v.bound, "roof_share": v.roof_share, "roof": v.roof,
                      "roof_gbps": v.roof_gbps, "notes": list(v.notes),
                      "measured_gbps": v.measured_gbps}
                     for v in verdicts(roofs)]}}
