"""A flight recorder's capture (the daemon's, meta.flight in its trace): what fired it, the
trigger's series around the moment drawn in the terminal, and what changed against the
baseline before the incident.

The comparison is of the daemon's own counts (one method on both sides: daemon/flight/baseline.py),
the incident's against the baseline's: each family's items (op types, graph computes by
backend, decode calls or steps by phase, kernels, syncs) by share of the family's time (of
its count where it has no time), time per call, and rate. An item is "outside" where one of
those falls outside the range the baseline's own intervals spanned (by more than MARGIN of
it, and a point of share); "new" or "gone" where only one side has it."""
from __future__ import annotations

import json

from rich.table import Table
from rich.text import Text

from profinfer.core.base.errors import ProfinferError
from profinfer.core.profile.model import Profile
from profinfer.daemon.flight.triggers import in_unit

FAMILIES = {"call": "decode calls / steps", "op": "ops", "graph": "graph computes",
            "kernel": "CUDA kernels", "sync": "CUDA syncs"}
# the level that counts each family: where it changed between the two sides, not compared
FAMILY_LEVEL = {"op": "op", "graph": "graph", "kernel": "cuda-detail"}
BLOCKS = "▁▂▃▄▅▆▇█"
MIN_SHARE_SHOWN = 0.01        # items under this share on both sides are not listed
MARGIN = 0.05                 # beyond the baseline's range by more than this of it: outside
SHARE_FLOOR = 0.01            # and, for a share, by more than a point


def record(profile: Profile) -> dict | None:
    """The capture's flight record, None in a trace that is no flight recorder's capture;
    one that cannot be read as one raises ProfinferError (a trace is input: it may be
    anything)."""
    text = profile.meta.get("flight")
    if not text:
        return None
    try:
        rec = json.loads(text)
        if not isinstance(rec, dict) or not isinstance(rec.get("fired"), dict):
            raise TypeError("not an object with a fired object")
        rec["fired"] = _fired_in_units(rec["fired"])
        # everything the report and the summary read, read once here
        _header(rec)
        chart(rec["fired"])
        for row in changes(rec):
            _row_cells(row)
        _spans(rec)
    except (ValueError, TypeError, KeyError, AttributeError, IndexError, RecursionError, ZeroDivisionError,
            OverflowError) as e:
        raise ProfinferError(f"the trace's flight record (meta.flight) cannot be read: "
                             f"{type(e).__name__}: {str(e)[:200]}") from None
    return rec


def _outside(value: float, span: list | None, floor: float = 0.0) -> bool | None:
    """Beyond the baseline's range by more than MARGIN of it (and `floor`): a range its few
    intervals drew narrow does not flag every hundredth of a change."""
    if not span:
        return None
    lo, hi = span
    pad = max(MARGIN * max(abs(lo), abs(hi)), floor)
    return value < lo - pad or value > hi + pad


def changes(rec: dict) -> list[dict]:
    """Each item of each family, incident against baseline, the biggest share first."""
    counts = rec.get("counts") or {}
    base = ((counts.get("baseline") or {}).get("families")) or {}
    now = ((counts.get("incident") or {}).get("families")) or {}
    moved = _levels_changed(counts)
    rows = []
    for family in FAMILIES:
        b, n = base.get(family, {}), now.get(family, {})
        for item in sorted(set(b) | set(n)):
            fb, fn = b.get(item), n.get(item)
            row = {"family": family, "item": item, "baseline": fb, "incident": fn}
            if FAMILY_LEVEL.get(family) in moved:
                row["verdict"] = f"not comparable: the {FAMILY_LEVEL[family]} level changed"
            elif fb is None:
                row["verdict"] = "new"
            elif fn is None:
                row["verdict"] = "gone"
            else:
                keys = ("share", "per_s") + (("s_per_call",) if fb["s_per_call"] or fn["s_per_call"] else ())
                judged = {k: _outside(fn[k], fb.get(k + "_range"), SHARE_FLOOR if k == "share" else 0.0)
                          for k in keys}
                if all(v is None for v in judged.values()):
                    row["verdict"] = "no baseline variation"
                else:
                    out = [k for k, v in judged.items() if v]
                    row["verdict"] = "outside: " + ", ".join(out) if out else "within"
                row["share_change"] = fn["share"] - fb["share"]
                if fb["s_per_call"]:
                    row["per_call_ratio"] = fn["s_per_call"] / fb["s_per_call"]
            rows.append(row)
    return sorted(rows, key=lambda r: (list(FAMILIES).index(r["family"]),
                                       -max((r["incident"] or {}).get("share", 0), (r["baseline"] or {}).get("share", 0))))


def _levels_changed(counts: dict) -> set[str]:
    """The levels the process had on one side and not the other, or that changed within
    either (the governor stepped it): their families' counts are not alike."""
    b, i = counts.get("baseline") or {}, counts.get("incident") or {}
    if not b or not i:
        return set()
    moved = {str(lv) for lv in b.get("levels", [])} ^ {str(lv) for lv in i.get("levels", [])}
    for side in (b, i):
        if not side.get("levels_steady", True):
            moved |= {str(lv) for lv in side.get("levels", [])}
    return moved


def keys(profile: Profile) -> dict:
    rec = record(profile)
    if rec is None:
        return {}
    return {"flight": {"fired": rec["fired"], "levels": rec.get("levels"), "left_out": rec.get("left_out"),
                       "record_for_s": rec.get("record_for_s"), "cost": rec.get("cost"),
                       "baseline": _span((rec.get("counts") or {}).get("baseline")),
                       "incident": _span((rec.get("counts") or {}).get("incident")),
                       "changes": changes(rec)}}


def _span(counts: dict | None) -> dict | None:
    if not counts:
        return None
    return {k: counts.get(k) for k in ("from_monotonic_s", "until_monotonic_s", "seconds", "intervals")}


def sparkline(values: list[float], top: float) -> str:
    if top <= 0:
        return BLOCKS[0] * len(values)
    return "".join(BLOCKS[min(len(BLOCKS) - 1, int(v / top * (len(BLOCKS) - 1) + 0.5))] for v in values)


def _fired_in_units(fired: dict) -> dict:
    """The firing's figures and series by the names of its quantity's unit (a capture kept
    before quantities had units named them value_s, limit_s, baseline_s: seconds)."""
    if "value" in fired or "value_s" not in fired:
        return fired
    old = ("series", "series_after")
    return {**fired, "unit": "s", "value": fired.get("value_s"), "limit": fired.get("limit_s"),
            "baseline": fired.get("baseline_s"),
            **{k: [{**p, "value": p.get("value_s")} for p in fired[k]] for k in old if k in fired}}


def chart(fired: dict) -> list[str]:
    """The trigger's statistic per 1 s bin before the firing and after it, as blocks scaled
    to the largest of the series and its limit; a caret under the firing's bin."""
    points = [(float(p["t"]), float(p["value"])) for p in fired.get("series", [])]
    points += [(float(p["t"]), float(p["value"])) for p in fired.get("series_after", [])
               if not points or p["t"] > points[-1][0]]
    if not points:
        return []
    at = fired.get("fired_monotonic_s", points[-1][0])
    top = max([v for _, v in points] + [float(fired.get("limit") or 0.0)])
    line = sparkline([v for _, v in points], top)
    mark = next((i for i, (t, _) in enumerate(points) if t >= at - 1.0), len(points) - 1)
    span = f"{points[0][0] - at:+.0f} s .. {points[-1][0] - at:+.0f} s around the firing"
    return [f"  {line}   ({fired.get('quantity')} {fired.get('stat')} per second, {span}; "
            f"full height {in_unit(top, str(fired.get('unit', 's')))})",
            "  " + " " * mark + "^ fired"]


def _figure(f: dict | None, key: str, fmt) -> str:
    if f is None:
        return "-"
    span = f.get(key + "_range")
    return fmt(f[key]) + (f" ({fmt(span[0])}..{fmt(span[1])})" if span else "")


def _header(rec: dict) -> list[str]:
    fired = rec["fired"]
    unit = str(fired.get("unit", "s"))
    base = f", baseline {in_unit(fired.get('baseline'), unit)}" if fired.get("baseline") is not None else ""
    out = [f"Flight recorder: {fired.get('trigger')} fired: {fired.get('stat')} "
           f"{in_unit(fired.get('value'), unit)} {'<' if fired.get('below') else '>'} limit "
           f"{in_unit(fired.get('limit'), unit)}{base}; captured "
           f"{float(rec.get('record_for_s') or 0):g} s at {','.join(str(lv) for lv in rec.get('levels') or [])}"]
    out += [f"  left out: {level} ({why})" for level, why in (rec.get("left_out") or {}).items()]
    return out


def _spans(rec: dict) -> tuple[dict, dict] | None:
    """(baseline, incident) counts where both are there, their lengths read."""
    counts = rec.get("counts") or {}
    b, i = counts.get("baseline"), counts.get("incident")
    if not b or not i:
        return None
    return ({**b, "seconds": float(b["seconds"]), "intervals": int(b["intervals"])},
            {**i, "seconds": float(i["seconds"])})


_PCT, _MS, _RATE = (lambda v: f"{v:.1%}"), (lambda v: f"{v * 1e3:.3f} ms"), (lambda v: f"{v:,.1f}")


def _row_cells(r: dict) -> list[str]:
    fb, fn = r["baseline"], r["incident"]
    return [FAMILIES[r["family"]], str(r["item"]), _figure(fb, "share", _PCT), _figure(fn, "share", _PCT),
            _figure(fb, "s_per_call", _MS) if fb and fb["s_per_call"] else "-",
            _figure(fn, "s_per_call", _MS) if fn and fn["s_per_call"] else "-",
            _figure(fb, "per_s", _RATE), _figure(fn, "per_s", _RATE), r["verdict"]]


def print_flight(profile: Profile, console) -> None:
    rec = record(profile)
    if rec is None:
        return
    for line in _header(rec):            # a trace's text: printed as it is, no markup read in it
        console.print(line, markup=False, highlight=False)
    for line in chart(rec["fired"]):
        console.print(line, highlight=False, markup=False)
    spans = _spans(rec)
    if spans is None:
        console.print("  No comparison with a baseline: the daemon had not counted this process long enough "
                      "before the incident (its counts are sampled every 5 s).")
        return
    b, i = spans
    moved = _levels_changed(rec["counts"])
    if moved:
        console.print(f"  The process's levels changed between the baseline and the incident ({', '.join(sorted(moved))}): "
                      "their counts are not compared.", markup=False)
    rows = [r for r in changes(rec)
            if max((r["incident"] or {}).get("share", 0), (r["baseline"] or {}).get("share", 0)) >= MIN_SHARE_SHOWN]
    table = Table(title=f"What changed: the incident before its capture ({i['seconds']:.0f} s) against the baseline "
                        f"before it ({b['seconds']:.0f} s, {b['intervals']} intervals; ranges: their lowest..highest)")
    for col in ("what", "item", "share: baseline", "incident", "time a call: baseline", "incident", "a second: baseline",
                "incident", "verdict"):
        table.add_column(col, justify="left" if col in ("what", "item", "verdict") else "right")
    for r in rows:
        table.add_row(*(Text(cell) for cell in _row_cells(r)))
    console.print(table)
    if "op" not in (b.get("families") or {}):
        console.print("  No op types in the baseline: the daemon's op level was off before the incident "
                      "(--levels ...,op, within the budget).")
