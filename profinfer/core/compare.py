"""Two runs compared quantity by quantity, with confidence (pure logic): what `diff` judges.

A run is reduced to Series: one quantity (decode time per token, an op's time per decode
token, a layer's, a kernel's) as one sample per unit of work (a decode call, an engine step,
a sequence, a call), in the order the units ran. Two series with the same key are compared by
the ratio of their means.

The interval is a moving-block bootstrap of that ratio: each run's samples are resampled in
contiguous blocks (about sqrt(n) long), so that slow drift within a run (a neighbour's load,
the KV cache growing) widens the interval instead of passing for a change. The resampling is
seeded: the same two traces always give the same answer. A series of more than MAX_POINTS
samples is first reduced to MAX_POINTS means of consecutive samples (a block of its own).

A change is judged against a noise floor: the run-to-run noise the caller states (`diff
--noise`), or the quantity's own drift within a run where that is larger: the range of the
means of a run's quarters, over its mean, the larger of the two runs'. A quantity that moves
that much between parts of one run is not called changed by less between two runs. Only an
interval wholly beyond the floor is "slower" or "faster"; one inside it, or one that
includes zero, is labelled as such.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

RESAMPLES = 2000
MAX_POINTS = 1024
MIN_SAMPLES = 3          # fewer on a side: shown, not judged
DRIFT_PARTS = 4          # a run's parts whose means give its drift
SEED = 20261204

# Verdicts, from most to least telling.
SLOWER, FASTER = "slower", "faster"
UNCERTAIN = "uncertain"          # beyond the noise floor by its estimate, not by its interval
WITHIN_NOISE = "within noise"    # the interval excludes zero but its estimate is inside the floor
NO_CHANGE = "no change"          # the interval includes zero
FEW_SAMPLES = "too few samples"
ONLY_BEFORE, ONLY_AFTER = "only before", "only after"
SIGNIFICANT = (SLOWER, FASTER)
VERDICTS = (SLOWER, FASTER, UNCERTAIN, WITHIN_NOISE, NO_CHANGE, FEW_SAMPLES, ONLY_BEFORE, ONLY_AFTER)


@dataclass(frozen=True)
class Series:
    """One quantity of one run: a sample per unit of work, in the order the units ran."""
    section: str             # "latency", "op", "layer", "node", "kernel", "copy", "thread", ...
    name: str                # its row: "decode MUL_MAT", "layer 3", "decode time per token"
    unit: str                # what a sample is: "ns per decode token", "ns per call"
    samples: np.ndarray      # float64, one per unit of work
    events: int = 0          # the records behind the samples (op runs, calls), 0: the samples

    @property
    def key(self) -> tuple[str, str]:
        return self.section, self.name

    @property
    def mean(self) -> float:
        return float(self.samples.mean()) if len(self.samples) else 0.0


@dataclass(frozen=True)
class Change:
    section: str
    name: str
    unit: str
    before: float | None         # mean per unit (None: not in that run)
    after: float | None
    before_n: int                # samples
    after_n: int
    before_events: int
    after_events: int
    change: float | None         # after/before - 1
    low: float | None            # its interval's bounds (None: not judged)
    high: float | None
    floor: float | None          # the noise floor it was judged against
    verdict: str

    @property
    def significant(self) -> bool:
        return self.verdict in SIGNIFICANT


def _points(samples: np.ndarray) -> np.ndarray:
    """At most MAX_POINTS points: the means of consecutive equal runs of samples."""
    n = len(samples)
    if n <= MAX_POINTS:
        return samples
    edges = np.linspace(0, n, MAX_POINTS + 1).astype(np.int64)
    sums = np.add.reduceat(samples, edges[:-1])
    return sums / np.diff(edges)


def block_means(samples: np.ndarray, rng: np.random.Generator, resamples: int = RESAMPLES) -> np.ndarray:
    """The mean of `resamples` moving-block bootstrap resamples of `samples`."""
    x = _points(np.asarray(samples, np.float64))
    n = len(x)
    block = max(1, min(n // 2 or 1, round(math.sqrt(n))))
    blocks = -(-n // block)
    starts = rng.integers(0, n - block + 1, size=(resamples, blocks))
    idx = (starts[:, :, None] + np.arange(block)).reshape(resamples, -1)[:, :n]
    return x[idx].mean(axis=1)


def judge(before: Series | None, after: Series | None, noise: float, confidence: float = 0.95) -> Change:
    """The change from `before` to `after` (the same key; either may be missing)."""
    s = before or after
    b_mean = before.mean if before is not None else None
    a_mean = after.mean if after is not None else None
    common = dict(section=s.section, name=s.name, unit=s.unit, before=b_mean, after=a_mean,
                  before_n=len(before.samples) if before is not None else 0,
                  after_n=len(after.samples) if after is not None else 0,
                  before_events=(before.events or len(before.samples)) if before is not None else 0,
                  after_events=(after.events or len(after.samples)) if after is not None else 0)
    if before is None or after is None:
        return Change(**common, change=None, low=None, high=None, floor=None,
                      verdict=ONLY_AFTER if before is None else ONLY_BEFORE)
    if b_mean <= 0:          # nothing to divide by: nothing before, something after
        return Change(**common, change=None if a_mean > 0 else 0.0, low=None, high=None, floor=None,
                      verdict=ONLY_AFTER if a_mean > 0 else NO_CHANGE)
    change = a_mean / b_mean - 1
    if min(len(before.samples), len(after.samples)) < MIN_SAMPLES:
        return Change(**common, change=change, low=None, high=None, floor=None, verdict=FEW_SAMPLES)
    rng = np.random.default_rng(SEED)
    b, a = block_means(before.samples, rng), block_means(after.samples, rng)
    ratios = a / np.where(b > 0, b, np.nan) - 1
    ratios = ratios[np.isfinite(ratios)]
    tail = (1 - confidence) / 2 * 100
    low, high = (float(v) for v in np.percentile(ratios, [tail, 100 - tail]))
    floor = max(noise, drift(before.samples), drift(after.samples))
    return Change(**common, change=change, low=low, high=high, floor=floor,
                  verdict=_verdict(change, low, high, floor))


def drift(samples: np.ndarray) -> float:
    """How far the means of a run's DRIFT_PARTS consecutive parts lie apart, over its mean."""
    parts = np.array_split(np.asarray(samples, np.float64), DRIFT_PARTS)
    means = [p.mean() for p in parts if len(p)]
    whole = float(np.mean(samples))
    return (max(means) - min(means)) / whole if whole > 0 and len(means) > 1 else 0.0


def _verdict(change: float, low: float, high: float, noise: float) -> str:
    if low > noise:
        return SLOWER
    if high < -noise:
        return FASTER
    if low <= 0 <= high:
        return NO_CHANGE
    if abs(change) < noise:
        return WITHIN_NOISE
    return UNCERTAIN


def compare(before: list[Series], after: list[Series], noise: float, confidence: float = 0.95
            ) -> list[Change]:
    """Every quantity of either run, matched by key, in the order they first appear (the
    before run's, then what only the after run has)."""
    b = {s.key: s for s in before}
    a = {s.key: s for s in after}
    keys = list(b) + [k for k in a if k not in b]
    return [judge(b.get(k), a.get(k), noise, confidence) for k in keys]
