"""Two profiles compared: one JSON object of plain values, what `diff` prints, writes with
--json and gates on (schema: profinfer/exporters/diff.schema.json, described in
docs/analysis.md#diff).

The runs must be comparable: held by the same engine (or the same levels alone), with the
same model structure (each plugin's IDENTITY). Otherwise IncomparableRuns says why in one
line. What differs between comparable runs (builds, kernel, threads, shapes) is listed, and
where only the build differs that is said.

Each quantity the main view and the plugins give (core.sections.series_sections) is judged
by core.compare; the roofline verdicts that changed and each run's coverage (lost events,
the share of graph time the probes explain) are beside them, so that a bad recording is
not taken for a change.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass
from pathlib import Path

from profinfer.core.diff import comparable, compare
from profinfer.core.plugin import sections
from profinfer.core.base.errors import ProfinferError
from profinfer.core.calibration.loadcheck import OTHERS_CPU_LIMIT
from profinfer.core.profile.model import Profile
from profinfer.core.plugin.sections import SeriesSection, View
from profinfer.exporters import json_summary, runspread

SCHEMA = "profinfer.diff/3"
METHOD = (f"ratio of the {{statistic}}s, moving-block bootstrap ({compare.RESAMPLES} resamples, blocks "
          "of about sqrt(n) units, seeded); several runs a side: widened to Welch's t on the runs' log "
          "statistics; one run a side: a time judged against the finest parts' common change too, or a "
          "phase's time per token widened by the command's calibrated run-to-run spread, Student's t "
          "(runs - 1) x sqrt(2) x its sd, in quadrature")
NOISE = 0.05            # the default noise floor: bench/results.md, "diff: run-to-run noise"
CONFIDENCE = 0.95
# Facts of a recording's meta that say how it was made: listed where two runs differ.
SETUP_META = re.compile(r"^(engine|levels|kernel|cpus_online|tensor_layout|counters|roofs:cpu|"
                        r"build_id:.*|version:.*|engine_version)$")
# Facts that follow from the build alone: where only these differ, "only the build differs"
# (tensor_layout: how the recording read the engine's structs, DWARF where the build has it).
BUILD_FACT = re.compile(r"^(build_id:.*|version:.*|engine_version|tensor_layout)$")
# A library's soname version (libggml.so.0.26.0): one library across builds.
SONAME_VERSION = re.compile(r"(\.so)(\.\d+)+$")
# A run's coverage worth a warning: a change this large or more between the runs.
COVERAGE_GAP = 0.05

# The neutral main view's quantities (decode calls, ops, threads), for profiles no engine's
# own view stands for.
NEUTRAL = View(series=(SeriesSection(0, comparable.series),))


class IncomparableRuns(ProfinferError):
    exit_code = 2


# The gate's verdicts and their exit statuses (2 is bad input or runs that cannot be compared).
PASS, FAIL, INCONCLUSIVE = "pass", "fail", "inconclusive"
GATE_EXIT = {PASS: 0, FAIL: 1, INCONCLUSIVE: 3}
MAX_RUNS_SAID = 30      # an inconclusive row needing more runs a side than this says "more than"


@dataclass(frozen=True)
class Gate:
    """`--fail-above [WHAT=]PCT`: a slowdown beyond `limit` of `what` (a row's name, an op, a
    phase: see matches), or without `what` of any phase's time per token or any op. Each row
    it names gets a verdict (judge): fail where its interval lies wholly above the limit (and
    the change is beyond the noise floor), pass where it lies wholly below, inconclusive
    where it spans the limit."""
    limit: float
    what: str | None = None

    def matches(self, c: compare.Change) -> bool:
        if self.what is None:
            return c.section == "op" or (c.section == "latency" and c.name.endswith("time per token"))
        w = self.what
        return c.name == w or c.name.split(" ", 1)[-1] == w or c.name == f"{w} time per token"

    def judge(self, c: compare.Change, runs: int) -> dict | None:
        """This gate's verdict on row c, with why, and for an inconclusive one how many runs a
        side would likely resolve it (None: more than MAX_RUNS_SAID, or not by more runs of
        this kind); None where the gate does not judge the row. `runs`: the fewer runs of a
        side. The default gate (no WHAT) judges the phases' time per token (the wall time a
        user waits) by all three verdicts, and an op only by fail: an op's own interval
        spanning the limit (a small op's swings) leaves it to the time per token."""
        if not self.matches(c) or c.change is None or c.verdict == compare.ONLY_BEFORE:
            return None
        judged_fully = self.what is not None or c.section == "latency"
        row = {"gate": self.label, "name": c.name, "change": c.change, "low": c.low, "high": c.high,
               "common": c.common, "runs_needed": None}
        if c.low is None:           # too few samples, or only in the after runs
            if not judged_fully or c.change <= self.limit:
                return {**row, "verdict": PASS, "why": "below the limit by its estimate"}
            return {**row, "verdict": INCONCLUSIVE, "why": f"{c.verdict}: not judged by an interval"}
        # with one run a side, the interval beyond the parts' common change
        low, high = (c.low, c.high) if c.common is None else \
            ((1 + c.low) / (1 + c.common) - 1, (1 + c.high) / (1 + c.common) - 1)
        if c.verdict == compare.SLOWER and low > self.limit:
            return {**row, "verdict": FAIL, "why": "its interval lies wholly above the limit" +
                    ("" if c.common is None else f", beyond the parts' common change ({c.common:+.1%})") +
                    ("" if c.spread is None else f", widened by the runs' measured spread here (sd {c.spread:.1%})")}
        if c.high < self.limit:
            return {**row, "verdict": PASS, "why": "its interval lies wholly below the limit"}
        if not judged_fully:
            return {**row, "verdict": PASS, "why": "an op, judged by fail alone: its time per token judges the rest"}
        if c.common is not None and high < self.limit:
            # most of the work moved alike: a slower build, or this process ran slower than
            # the other (one run a side does not measure that)
            return {**row, "verdict": INCONCLUSIVE, "runs_needed": 3,
                    "why": f"the parts' common change ({c.common:+.1%}) covers it: one run a side cannot "
                           "tell a slower build from a slower run"}
        if low > self.limit:        # above the limit, but not beyond the noise floor
            return {**row, "verdict": INCONCLUSIVE, "runs_needed": None,
                    "why": f"above the limit, within the noise floor ({c.floor:.1%}): {c.verdict}"}
        return {**row, "verdict": INCONCLUSIVE, "runs_needed": runs_to_resolve(c, self.limit, runs),
                "why": "its interval spans the limit"}

    @property
    def label(self) -> str:
        return f"{self.what + '=' if self.what else ''}{self.limit * 100:g}%"


def runs_to_resolve(c: compare.Change, limit: float, runs: int) -> int | None:
    """Runs a side that would likely put the interval of c wholly on one side of `limit`: an
    interval narrows as 1/sqrt(runs) (its estimate staying where it is); None beyond
    MAX_RUNS_SAID, or where the estimate lies on the limit."""
    half, gap = (c.high - c.low) / 2, abs(c.change - limit)
    if gap <= 0:
        return None
    need = max(runs + 1, math.ceil(runs * (half / gap) ** 2))
    return need if need <= MAX_RUNS_SAID else None


def _wall_first(row: dict, gate: Gate, c: compare.Change, changes: list[compare.Change],
                threads_differ: bool) -> dict:
    """The default gate's verdict on an op row, whose time is CPU time summed over the threads
    (more threads spin and wait more), where the runs' op threads differ: not a failure where
    its phase's time per token (the wall time a user waits) lies wholly below the limit: `-t 8`
    against `-t 4` doubles a memory-bound decode's op CPU while its tokens come faster. With
    the same threads an op's CPU time is its work, and a slower op fails whatever the rest did."""
    if gate.what is not None or c.section != "op" or row["verdict"] != FAIL or not threads_differ:
        return row
    wall = next((w for w in changes if w.section == "latency" and w.unit == c.unit
                 and w.name.endswith("time per token")), None)
    if wall is None or wall.high is None or wall.high >= gate.limit:
        return row
    return {**row, "verdict": PASS,
            "why": f"CPU time over the threads: its phase's time per token (the wall) lies wholly below the "
                   f"limit ({wall.change:+.1%}, {wall.low:+.1%}..{wall.high:+.1%})"}


def gate_verdict(rows: list[dict], gates: tuple[Gate, ...]) -> str | None:
    """fail if a row failed, inconclusive if one was, else pass; None without gates."""
    if not gates:
        return None
    verdicts = {r["verdict"] for r in rows}
    return FAIL if FAIL in verdicts else INCONCLUSIVE if INCONCLUSIVE in verdicts else PASS


def parse_percent(text: str, what: str) -> float:
    """A percentage written with its sign ("5%"): a bare number is refused, since "5" read as a
    fraction is 500% and read as percent is what 0.05 would not be."""
    t = text.strip()
    if not t.endswith("%"):
        raise ProfinferError(f"{what}: {text!r} has no % sign (write 5% for five percent)")
    try:
        value = float(t[:-1]) / 100
    except ValueError:
        raise ProfinferError(f"{what}: {text!r} is not a percentage (like 5%)") from None
    if not 0 <= value < 100 or value != value:
        raise ProfinferError(f"{what}: {text!r} is out of range")
    return value


def parse_gate(text: str) -> Gate:
    what, sep, pct = text.rpartition("=")
    if sep and not what.strip():
        raise ProfinferError(f"--fail-above: {text!r} names nothing before '='")
    return Gate(parse_percent(pct, "--fail-above"), what.strip() or None)


def _engine(profile: Profile) -> str:
    return profile.meta.get("engine") or ("levels " + profile.meta.get("levels", "?"))


def _identity(profile: Profile) -> dict:
    return {"engine": _engine(profile), **sections.facts(profile, "IDENTITY")}


def _refusal(before: dict, after: dict) -> str | None:
    for key in before.keys() | after.keys():
        b, a = before.get(key), after.get(key)
        if b == a:
            continue
        if isinstance(b, frozenset) and isinstance(a, frozenset):
            gone, new = sorted(b - a), sorted(a - b)
            parts = ([f"only before: {', '.join(gone[:4])}{' ...' if len(gone) > 4 else ''}"] if gone else []) + \
                    ([f"only after: {', '.join(new[:4])}{' ...' if len(new) > 4 else ''}"] if new else [])
            return f"{key} differ ({'; '.join(parts)})"
        return f"{key}: {b or 'none'} before, {a or 'none'} after"
    return None


def _setup(profile: Profile) -> dict[str, str]:
    out = {SONAME_VERSION.sub(r"\1", k): str(v) for k, v in profile.meta.items() if SETUP_META.match(k)}
    threads = comparable.op_threads(profile)
    if threads:
        out["op threads"] = str(threads)
    # time per token is per token: a larger batch (another batch size, more concurrent
    # requests) moves it with no change of code, so a batch that differs is said
    batches = sorted(t.n_tokens for t in profile.tokens if not t.prefill)
    if batches:
        out["decode tokens a call (median)"] = f"{batches[len(batches) // 2]:g}"
    out.update((k, str(v)) for k, v in sections.facts(profile, "SETUP").items())
    return out


def _differences(before: dict[str, str], after: dict[str, str]) -> list[dict]:
    return [{"fact": k, "before": before.get(k), "after": after.get(k)}
            for k in sorted(before.keys() | after.keys()) if before.get(k) != after.get(k)]


def _coverage(profile: Profile, summary: dict) -> dict:
    threads = summary.get("threads") or []
    graph = sum(t.get("graph_ns") or 0 for t in threads)
    explained = [t for t in threads if None not in (t.get("op_ns"), t.get("barrier_ns"), t.get("arrival_ns"))]
    covered = sum(t["op_ns"] + t["barrier_ns"] + t["arrival_ns"] for t in explained)
    return {"lost_events": profile.lost_events,
            "events": int(profile.meta.get("events", 0) or 0),
            "levels": profile.meta.get("levels", ""),
            "others_cpus": _float(profile.meta.get("others_cpus")),
            "graph_coverage": covered / graph if graph and explained else None}


def _float(text: str | None) -> float | None:
    try:
        return float(text) if text is not None else None
    except ValueError:
        return None


def _verdicts(summary: dict) -> dict[str, str]:
    roofline = summary.get("roofline") or {}
    return {v["scope"]: v["bound"] for v in roofline.get("verdicts") or []}


def _series(profile: Profile) -> list[compare.Series]:
    return [s for sec in sections.series_sections(profile, NEUTRAL) for s in sec.series(profile)]


def _side_coverage(runs: list[dict]) -> dict:
    """A side's coverage over its runs: lost events and events summed, the busiest
    neighbours, the least graph time explained."""
    covered = [r["graph_coverage"] for r in runs if r["graph_coverage"] is not None]
    others = [r["others_cpus"] for r in runs if r["others_cpus"] is not None]
    return {"lost_events": sum(r["lost_events"] for r in runs), "events": sum(r["events"] for r in runs),
            "levels": runs[0]["levels"], "others_cpus": max(others) if others else None,
            "graph_coverage": min(covered) if covered else None}


def _warnings(cov: dict[str, dict], inner: list[str]) -> list[str]:
    out = list(inner)
    for side, c in cov.items():
        if c["lost_events"]:
            share = c["lost_events"] / (c["events"] + c["lost_events"]) if c["events"] else None
            out.append(f"the {side} side lost {c['lost_events']:,} events"
                       + (f" ({share:.1%} of its records)" if share is not None else "")
                       + ": its totals are low, and a change may be the loss, not the code")
        if c["others_cpus"] is not None and c["others_cpus"] > OTHERS_CPU_LIMIT:
            out.append(f"other processes used {c['others_cpus']:.2f} CPUs while the {side} side "
                       "worked: its times are partly theirs")
    b, a = cov["before"]["graph_coverage"], cov["after"]["graph_coverage"]
    if b is not None and a is not None and abs(a - b) >= COVERAGE_GAP:
        out.append(f"the probes explain {b:.0%} of graph time before and {a:.0%} after: "
                   "compare the recordings, not only the code")
    if cov["before"]["levels"] != cov["after"]["levels"]:
        out.append(f"levels differ ({cov['before']['levels']} before, {cov['after']['levels']} after): "
                   "what one side did not record is not compared")
    return out


def _one_side(runs: list[Profile], side: str) -> list[str]:
    """A side's runs must be comparable with its first, and are said to differ in setup."""
    first, out = _identity(runs[0]), []
    for r in runs[1:]:
        why = _refusal(first, _identity(r))
        if why:
            raise IncomparableRuns(f"the {side} runs cannot be pooled: {why}")
        differs = _differences(_setup(runs[0]), _setup(r))
        if differs:
            out.append(f"the {side} runs differ in {', '.join(d['fact'] for d in differs)}")
    return out


def compare_profiles(before: list[Profile], after: list[Profile], noise: float = NOISE,
                     confidence: float = CONFIDENCE, gates: tuple[Gate, ...] = (),
                     names: tuple[list[str], list[str]] = (["before"], ["after"]),
                     statistic: str = "median") -> dict:
    """The comparison of two sides of one or more runs each (several: pooled, and the
    spread of their means a floor: core.compare); IncomparableRuns where they cannot be
    compared."""
    inner = _one_side(before, "before") + _one_side(after, "after")
    why = _refusal(_identity(before[0]), _identity(after[0]))
    if why:
        raise IncomparableRuns(f"the runs cannot be compared: {why}")
    summaries = {"before": [json_summary.summary(p) for p in before],
                 "after": [json_summary.summary(p) for p in after]}
    single = [side for side, runs in (("before", before), ("after", after)) if len(runs) == 1]
    calibrated = runspread.lookup([spread_key(before[0])[0], spread_key(after[0])[0]], statistic) if single else None
    changes = compare.compare(compare.pool([_series(p) for p in before]),
                              compare.pool([_series(p) for p in after]), noise, confidence, statistic,
                              calibrated[0] if calibrated else None)
    unmatched = [g.what for g in gates if g.what is not None and not any(g.matches(c) for c in changes)]
    if unmatched:
        raise ProfinferError(f"--fail-above: {unmatched[0]!r} names no row of this comparison "
                             f"(rows: {_row_examples(changes)})")
    if single and calibrated:
        inner.append(f"one run {' and '.join(single)}: each phase's time per token judged with this "
                     f"command's {runspread.describe(calibrated[1])}")
    elif single:
        shift = next((c.common for c in changes if c.common is not None), None)
        inner.append(f"one run {' and '.join(single)}: how much a whole process's speed varies from "
                     "one run to the next is not measured (on a shared machine, by more than the floor)"
                     + (f"; the finest parts' common change, {shift:+.1%}, is taken for it: a time must "
                        "change beyond it too, and a part move its whole by the floor"
                        if shift is not None else "")
                     + "; several runs a side (comma lists or directories) measure it, or `profinfer "
                       "calibrate --spread-of RUNS` from runs of this command here")
    differences = _differences(_setup(before[0]), _setup(after[0]))
    vb, va = _verdicts(summaries["before"][0]), _verdicts(summaries["after"][0])
    coverage = {side: _side_coverage([_coverage(p, s) for p, s in zip(profiles, summaries[side])])
                for side, profiles in (("before", before), ("after", after))}
    runs = min(len(before), len(after))
    threads_differ = _setup(before[0]).get("op threads") != _setup(after[0]).get("op threads")
    judged = [_wall_first(r, g, c, changes, threads_differ) for g in gates for c in changes
              if (r := g.judge(c, runs)) is not None]
    verdict = gate_verdict(judged, gates)
    failed = [{k: r[k] for k in ("gate", "name", "change", "common")} for r in judged if r["verdict"] == FAIL]
    return {
        "schema": SCHEMA,
        "runs": {side: {"traces": list(n), "engine": _engine(profiles[0]), **coverage[side]}
                 for side, profiles, n in (("before", before, names[0]), ("after", after, names[1]))},
        "method": METHOD.format(statistic=statistic),
        "statistic": statistic,
        "confidence": confidence,
        "noise": noise,
        "differences": differences,
        "only_build_differs": bool(differences) and all(BUILD_FACT.match(d["fact"]) for d in differences),
        "changes": [asdict(c) for c in changes],
        "verdicts_changed": [{"scope": s, "before": vb.get(s), "after": va.get(s)}
                             for s in sorted(vb.keys() | va.keys()) if vb.get(s) != va.get(s)],
        "warnings": _warnings(coverage, inner),
        "gates": [g.label for g in gates],
        "gate": None if verdict is None else {
            "verdict": verdict, "exit": GATE_EXIT[verdict],
            "rows": [r for r in judged if r["verdict"] != PASS], "passed": sum(r["verdict"] == PASS for r in judged)},
        "failed": failed,
    }


def spread_key(profile: Profile) -> tuple[str, str]:
    """The key under which runs of this recording's setup have their spread (runspread)."""
    return runspread.setup_key({**_identity(profile), **_setup(profile)}, profile.meta)


def spread_of(runs: list[Profile], names: list[str]) -> dict:
    """`calibrate --spread-of`: the spread of runs of one command (runspread.measure)."""
    return runspread.measure([(spread_key(p), _series(p)) for p in runs], names)


def _row_examples(changes: list[compare.Change], shown: int = 6) -> str:
    """Some of the rows a gate may name: the phases' times, then the ops'."""
    names = [c.name for c in changes if c.section == "latency"] + [c.name for c in changes if c.section == "op"]
    names = list(dict.fromkeys(names))
    return ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")


def write_json(result: dict, path: str | Path) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2, allow_nan=False)
        f.write("\n")
