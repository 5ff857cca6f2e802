"""A command's run-to-run spread on this machine, for diff's judgment of one run a side
(`profinfer calibrate --spread-of RUNS`).

On a shared machine a whole process can run faster or slower than another of the same
command, every part alike (bench/results.md, "diff, one run a side"). One run a side cannot
see that: without a measure of it, diff calls a change of most of the work inconclusive. Runs
of one command recorded here measure it: for each phase's time per token (what the gate
judges in full), the sd of the logarithm of its statistic (median and mean) over the runs.
Kept per machine (the CPU model the recording names, and its CPUs) and setup (what `diff`
lists as differences: engine, model structure and shapes where recorded, builds, levels, op
threads, decode batch) in $PROFINFER_CACHE/spread.json. `diff` uses the
spread calibrated for the before run's setup (else the after run's) and says which.

What it cannot see: a machine whose neighbours changed since it was measured (measure
again), and a setup not measured (the runs must be of the command compared).
"""
from __future__ import annotations

import hashlib
import json
import os
import time

import numpy as np

from profinfer.core.target import buildcache
from profinfer.core.calibration import machine_roofs
from profinfer.core.diff import compare
from profinfer.core.base.errors import ProfinferError

MIN_RUNS = 6            # fewer: the sd is too uncertain to judge by (t with 4 degrees of freedom)
# facts of a recording left out of its setup's key: the calibration this machine had then
# (its CPU model is keyed as "machine"; its CPU count is cpus_online)
UNKEYED = ("roofs:", "trap:")


def _is_judged_row(s: compare.Series) -> bool:
    return s.section == "latency" and s.name.endswith("time per token")


def setup_key(facts: dict, meta: dict) -> tuple[str, str]:
    """(a key, what it stands for) of a recording's setup (`facts`: what diff compares of it,
    its identity and setup) on the machine it was recorded on (from its `meta`)."""
    keyed = {k: (sorted(v) if isinstance(v, frozenset) else v) for k, v in facts.items() if not k.startswith(UNKEYED)}
    # the machine it was recorded on, as the recording says (else this one: where it is read)
    keyed["machine"] = meta.get("roofs:cpu") or meta.get("trap:cpu") or machine_roofs.cpu_model()
    text = json.dumps(keyed, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16], text


def _cache_path() -> str:
    return os.path.join(buildcache.cache_dir(), "spread.json")


def measure(runs: list[tuple[tuple[str, str], list[compare.Series]]], names: list[str]) -> dict:
    """The spread of runs of one command, each given as (its setup_key, its series)
    (ProfinferError: too few, or of different setups)."""
    if len(runs) < MIN_RUNS:
        raise ProfinferError(f"--spread-of: {len(runs)} runs; give at least {MIN_RUNS} of one command")
    keys = [key for key, _ in runs]
    odd = next((n for n, k in zip(names, keys) if k[0] != keys[0][0]), None)
    if odd is not None:
        raise ProfinferError(f"--spread-of: {odd} is not a run of the same setup as {names[0]} "
                             "(the runs must be of one command: diff lists what differs)")
    rows: dict[str, dict[str, list[float]]] = {}
    for _, series in runs:
        for s in series:
            if _is_judged_row(s) and len(s.samples) >= compare.MIN_SAMPLES:
                for stat in compare.STATISTICS:
                    rows.setdefault(s.name, {}).setdefault(stat, []).append(float(compare._stat(stat, s.samples)))
    spreads = {name: {stat: float(np.std(np.log(v), ddof=1)) for stat, v in by.items() if min(v) > 0}
               for name, by in rows.items() if all(len(v) == len(runs) for v in by.values())}
    if not spreads:
        raise ProfinferError("--spread-of: the runs have no time per token of enough decode calls to measure")
    return {"key": keys[0][0], "setup": json.loads(keys[0][1]), "runs": len(runs), "rows": spreads,
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def store(entry: dict) -> None:
    buildcache.store_entry(_cache_path(), entry["key"], entry)


def lookup(keys: list[str], statistic: str) -> tuple[dict, dict] | None:
    """The calibrated spreads for a comparison ({row key: compare.Spread}, the entry), by the
    first of `keys` (the before run's setup, then the after run's) measured here; None where
    none was."""
    cache = buildcache.load_trusted_dict(_cache_path())
    for key in keys:
        entry = cache.get(key)
        if isinstance(entry, dict) and isinstance(entry.get("rows"), dict):
            try:
                spreads = {("latency", name): compare.Spread(float(by[statistic]), int(entry["runs"]))
                           for name, by in entry["rows"].items() if statistic in by}
            except (KeyError, TypeError, ValueError):
                continue
            if spreads and int(entry["runs"]) >= MIN_RUNS:
                return spreads, entry
    return None


def describe(entry: dict, confidence: float = 0.95) -> str:
    """The spread, and what one run a side can tell with it: two runs of the command differ by
    chance within ±half-width, so a change of most of the work must lie beyond that."""
    rows = []
    for name, by in entry["rows"].items():
        if "median" in by:
            half = compare.Spread(by["median"], entry["runs"]).half_width(confidence)
            rows.append(f"{name} {by['median']:.1%} (two runs differ by chance within "
                        f"-{-np.expm1(-half):.0%}..+{np.expm1(half):.0%})")
    return (f"run-to-run spread over {entry['runs']} runs (sd of the log median): {', '.join(rows)}; "
            f"measured {entry['measured_at']}")
