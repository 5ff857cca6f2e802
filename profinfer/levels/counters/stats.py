"""Per-op perf counter totals and the metrics derived from them (pure logic).

Each op carries its counter deltas (already scaled for multiplexing) or None when they were
dropped (the thread migrated CPU inside the op, ...). Totals are over counted ops only, and
the number of dropped ops is reported beside them, never hidden.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from profinfer.core.profile.model import Profile
from profinfer.core.profile.opcolumns import as_columns
from profinfer.core.profile.stats import steps_by_number
from profinfer.core.profile.stats import PHASES, op_arrays, op_phases

_ALIASES = {"cpu-cycles": "cycles", "branch-instructions": "branches"}
CACHE_LINE = 64

# (metric, numerator, denominator, scale): value = scale * num / den
DERIVED = [
    ("IPC", "instructions", "cycles", 1.0),
    ("cache miss %", "cache-misses", "cache-references", 100.0),
    ("branch miss %", "branch-misses", "branches", 100.0),
    ("L1d load miss %", "L1-dcache-load-misses", "L1-dcache-loads", 100.0),
    ("LLC load miss %", "LLC-load-misses", "LLC-loads", 100.0),
    ("CPU util %", "task-clock", "_dur_ns", 100.0),
]


@dataclass
class CounterRow:
    scope: str                   # op type, or phase name
    counted: int                 # ops whose deltas are in the totals
    dur_ns: int                  # their summed duration
    totals: dict[str, float]
    derived: dict[str, float] = field(default_factory=dict)


@dataclass
class CounterStats:
    names: list[str]
    dropped: dict[str, int]
    by_op: list[CounterRow]                  # sorted by duration, descending
    by_phase: dict[str, CounterRow]
    per_token: dict[str, dict[str, float]]   # phase -> counter -> total per token
    notes: list[str]


def canonical(name: str) -> str:
    return _ALIASES.get(name, name)


def derived_tracks(names: list[str]) -> list[tuple[str, int, int, float]]:
    """(metric, numerator index, denominator index or -1 for the op's duration, scale) for the
    derived metrics the counters in `names` allow, e.g. IPC from instructions and cycles."""
    canon = [canonical(n) for n in names]
    out = []
    for metric, num, den, scale in DERIVED:
        if num in canon and (den == "_dur_ns" or den in canon):
            out.append((metric, canon.index(num), -1 if den == "_dur_ns" else canon.index(den), scale))
    return out


def derived_values(values: tuple[float, ...], dur_ns: int, tracks) -> list[float]:
    """One op's derived metrics, in derived_tracks() order (0 where the denominator is 0)."""
    out = []
    for _, num, den, scale in tracks:
        d = dur_ns if den < 0 else values[den]
        out.append(scale * values[num] / d if d else 0.0)
    return out


def derive(totals: dict[str, float], dur_ns: int) -> dict[str, float]:
    vals = {canonical(k): v for k, v in totals.items()}
    vals["_dur_ns"] = float(dur_ns)
    out = {}
    for metric, num, den, scale in DERIVED:
        if num in vals and den in vals and vals[den] > 0:
            out[metric] = scale * vals[num] / vals[den]
    if "LLC-load-misses" in vals:
        # each miss that leaves the last-level cache reads one line from DRAM (prefetches and
        # writebacks are not in it: a lower bound)
        out["DRAM read GB/s (LLC misses, lower bound)"] = (
            vals["LLC-load-misses"] * CACHE_LINE / dur_ns if dur_ns else 0.0)
    return out


def compute(profile: Profile) -> CounterStats | None:
    names = profile.counter_names
    if names and profile.calls:
        return _compute_calls(profile)
    if not names or not profile.ops:
        return None
    cols = as_columns(profile.ops)
    arr = op_arrays(cols)
    counted = cols.counted()
    values = (np.nan_to_num(cols.counters[:, :len(names)]) if cols.counters is not None
              else np.zeros((len(cols), len(names))))
    durs = arr.dur

    def row(scope: str, mask: np.ndarray) -> CounterRow:
        m = mask & counted
        totals = {n: float(values[m, i].sum()) for i, n in enumerate(names)}
        dur = int(durs[m].sum())
        return CounterRow(scope, int(m.sum()), dur, totals, derive(totals, dur))

    by_op = [row(name, arr.code == k) for k, name in enumerate(arr.names)]
    by_op.sort(key=lambda r: -r.dur_ns)
    phase = op_phases(arr, profile.tokens)
    by_phase = {p: row(p, phase == k) for k, p in enumerate(PHASES) if (phase == k).any()}
    tokens = dict.fromkeys(PHASES, 0)
    for t in profile.tokens:
        tokens[t.phase] += t.n_tokens
    per_token = {p: {n: v / tokens[p] for n, v in by_phase[p].totals.items()}
                 for p in ("prefill", "decode") if p in by_phase and tokens[p]}
    notes = []
    dropped = {k: v for k, v in profile.counter_dropped.items() if v}
    if dropped:
        notes.append(f"{sum(dropped.values())} of {len(profile.ops)} ops not counted ("
                     + ", ".join(f"{v} {k}" for k, v in dropped.items()) + ")")
    return CounterStats(list(names), dropped, by_op, by_phase, per_token, notes)


def _compute_calls(profile: Profile) -> CounterStats:
    """The same, for an engine whose ops are calls (vLLM): per op, and per phase of the step
    each call belongs to (its thread's step number)."""
    names = profile.counter_names
    phase_of = {k: st.phase for k, st in steps_by_number(profile).items()}

    def row(scope: str, calls) -> CounterRow:
        counted = [c for c in calls if c.counters is not None]
        totals = {n: float(sum(c.counters[i] for c in counted)) for i, n in enumerate(names)}
        dur = sum(c.dur_ns for c in counted)
        return CounterRow(scope, len(counted), dur, totals, derive(totals, dur))

    by_name: dict[str, list] = {}
    by_phase_calls: dict[str, list] = {}
    for c in profile.calls:
        by_name.setdefault(c.op, []).append(c)
        ph = phase_of.get((c.pid, c.tid, c.step))
        if ph is not None:
            by_phase_calls.setdefault(ph, []).append(c)
    by_op = sorted((row(op, cs) for op, cs in by_name.items()), key=lambda r: -r.dur_ns)
    by_phase = {p: row(p, by_phase_calls[p]) for p in PHASES if p in by_phase_calls}
    tokens = dict.fromkeys(PHASES, 0)
    for st in profile.steps:
        tokens[st.phase] += st.n_tokens
    per_token = {p: {n: v / tokens[p] for n, v in by_phase[p].totals.items()}
                 for p in ("prefill", "decode") if p in by_phase and tokens[p]}
    dropped = {k: v for k, v in profile.counter_dropped.items() if v}
    notes = ([f"{sum(dropped.values())} of {len(profile.calls)} calls not counted ("
              + ", ".join(f"{v} {k}" for k, v in dropped.items()) + ")"] if dropped else [])
    return CounterStats(list(names), dropped, by_op, by_phase, per_token, notes)
