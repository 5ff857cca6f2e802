"""The flight recorder's rolling baseline: each watched process's cumulative counts (its op
types', graph computes', decode calls' or steps', kernels', syncs': Metrics.totals) sampled
every SAMPLE_S over the last minutes, so that a capture can hold what the process did just
before its incident, and how much that varied from one interval to the next.

Each sample also keeps the levels the process had (what was counted: a family whose level
was taken away stops growing). For a stretch of time, each family's items (an op type, a kernel, a phase) get their rate,
time per call, and share of the family's time (of its count where it has no time: kernels),
each as the whole stretch's figure and as the lowest and highest of its SAMPLE_S intervals
(the baseline's own variation, against which a capture's figure is judged), the intervals in
which the family was nearly idle left out of the ranges."""
from __future__ import annotations

import threading
from collections import deque

from profinfer.core.base.waits import BASELINE_SAMPLE_S

SAMPLE_S = BASELINE_SAMPLE_S
MIN_INTERVALS = 3             # fewer, and a baseline has no variation to judge by
QUIET_FRACTION = 0.25         # an interval under this of the median rate is not in the ranges
MIN_GAP_S = 1.0               # a sample asked for this soon after the last is not taken


def _delta(new: dict, old: dict) -> dict[str, dict[str, tuple[float, float]]]:
    out = {}
    for family, items in new.items():
        before = old.get(family, {})
        got = {}
        for item, (n, s) in items.items():
            n0, s0 = before.get(item, (0, 0.0))
            if n > n0:          # counts that fell (a process moved between shared objects) give nothing
                got[item] = (n - n0, max(0.0, s - s0))
        out[family] = got
    return out


def _figures(items: dict[str, tuple[float, float]], seconds: float) -> dict[str, dict[str, float]]:
    """Each item's rate (a second), time per call, and share of its family's time (or count)."""
    total_s = sum(s for _, s in items.values())
    total_n = sum(n for n, _ in items.values())
    out = {}
    for item, (n, s) in items.items():
        share = s / total_s if total_s > 0 else n / total_n if total_n else 0.0
        out[item] = {"per_s": n / seconds, "s_per_call": s / n if n else 0.0, "share": share}
    return out


def _busy(intervals: list[tuple[float, dict]], family: str) -> list[tuple[float, dict]]:
    """The intervals in which the family ran at a quarter of its median rate at least: one
    in which the process was mostly idle (a load beginning, a pause) holds a few calls whose
    figures (a prompt's long computes) would stretch the range past any change."""
    rates = sorted(sum(n for n, _ in d.get(family, {}).values()) / dt for dt, d in intervals if dt > 0)
    if not rates:
        return []
    floor = QUIET_FRACTION * rates[len(rates) // 2]
    return [(dt, d) for dt, d in intervals if dt > 0 and sum(n for n, _ in d.get(family, {}).values()) / dt >= floor]


class RollingTotals:
    def __init__(self, horizon_s: float):
        self.horizon_s = horizon_s
        self.lock = threading.Lock()
        self.samples: dict[tuple, deque] = {}
        self.sampled_at = float("-inf")

    def due(self, now: float) -> bool:
        if now - self.sampled_at < SAMPLE_S:
            return False
        self.sampled_at = now
        return True

    def sample(self, key: tuple, now: float, totals: dict, levels: list[str], force: bool = False) -> None:
        """The process's cumulative counts now, and the levels it had (what was counted); not
        within MIN_GAP_S of the last unless forced (a firing's: its incident ends there)."""
        with self.lock:
            d = self.samples.setdefault(key, deque())
            if d and (now - d[-1][0] < MIN_GAP_S and not force or now <= d[-1][0]):
                return
            d.append((now, totals, levels))
            while d and d[0][0] < now - self.horizon_s - SAMPLE_S:
                d.popleft()

    def forget(self, key: tuple) -> None:
        with self.lock:
            self.samples.pop(key, None)

    def last_at_or_before(self, key: tuple, t: float) -> float | None:
        """When the newest sample at or before t was taken (None: none was)."""
        with self.lock:
            return max((sample[0] for sample in self.samples.get(key, ()) if sample[0] <= t), default=None)

    def between(self, key: tuple, lo: float, hi: float) -> dict | None:
        """The baseline of [lo, hi] (the samples within it): None with fewer than two."""
        with self.lock:
            within = [sample for sample in self.samples.get(key, ()) if lo <= sample[0] <= hi]
        if len(within) < 2:
            return None
        picked = [(t, v) for t, v, _ in within]
        levels = sorted({lv for _, _, had in within for lv in had})
        steady = len({tuple(had) for _, _, had in within}) == 1
        seconds = picked[-1][0] - picked[0][0]
        whole = _delta(picked[-1][1], picked[0][1])
        intervals = [(b[0] - a[0], _delta(b[1], a[1])) for a, b in zip(picked, picked[1:])]
        out = {"from_monotonic_s": picked[0][0], "until_monotonic_s": picked[-1][0], "seconds": seconds,
               "intervals": len(intervals), "levels": levels, "levels_steady": steady, "families": {}}
        for family, items in whole.items():
            figures = _figures(items, seconds)
            busy = _busy(intervals, family)
            if len(busy) >= MIN_INTERVALS:
                per = [_figures(d.get(family, {}), dt) for dt, d in busy]
                for item, f in figures.items():
                    for key in ("per_s", "s_per_call", "share"):
                        # an interval without the item: it ran 0 a second, 0 of the share
                        vals = [p[item][key] for p in per if item in p] + \
                               ([0.0] * sum(1 for p in per if item not in p) if key != "s_per_call" else [])
                        if vals:
                            f[key + "_range"] = [min(vals), max(vals)]
            if figures:
                out["families"][family] = figures
        return out
