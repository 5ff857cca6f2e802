"""Two runs compared quantity by quantity, with confidence (pure logic): what `diff` judges.

A run is reduced to Series: one quantity (decode time per token, an op's time per decode
token, a layer's, a kernel's) as one sample per unit of work (a decode call, an engine step,
a sequence, a call), in the order the units ran. Two series with the same key are compared by
the ratio of a statistic of their samples: the median by default (a stall of the machine
in a few calls moves it little), or the mean (`diff --statistic mean`: what totals are made
of, tails included). A row whose median is zero on a side (a unit in two without the op) is
compared by its mean.

The interval is a moving-block bootstrap of that ratio: each run's samples are resampled in
contiguous blocks (about sqrt(n) long), so that slow drift within a run (a neighbour's load,
the KV cache growing) widens the interval instead of passing for a change. The resampling is
seeded: the same two traces always give the same answer. A series of more than MAX_POINTS
samples is resampled through an even sample of MAX_POINTS of them (every k-th: the same
distribution, so its statistic estimates the one shown, the median a median, never a mean of
groups), each resample's deviation from that sample's statistic scaled by sqrt(points/n) (a
statistic of n samples varies so much less than one of MAX_POINTS) around the whole series'.

A change is judged against a noise floor: the run-to-run noise the caller states (`diff
--noise`), or, where larger, what the runs themselves show of it: the quantity's drift
within a run (the range of the statistic over a run's quarters, over the whole run's; of
several runs, the median run's). A quantity that moves that much between parts of one run
is not called changed by less between two. Drift is modelled as noise or as a trend: where
one run's eighths rise (or fall) one after another beyond the stated noise while the other
run is steady within it (a slowdown growing through the run), that trend is the change, and
the steady run's drift alone is the floor's. Where both runs trend alike, one run a side of as many units
(the runs of one command: a quantity that grows with the unit's place, as attention with the
KV cache's length), the samples are paired place by place, and the drift of their ratios is
the floor's: the place moves both alike, and a change of the quantity shows beyond it.

Where both sides have several runs (pool), the run is the unit of run-to-run noise (a whole
process can run 30% slower than another on a shared VM): the interval is widened to cover
Welch's t interval on the logarithms of the runs' statistics. Only an interval wholly beyond the floor
is "slower" or "faster"; one inside it, or one that includes zero, is labelled as such.

Where a side has one run, run-to-run noise is not measured, and on a shared machine a whole
process can run far slower than another of the same command, every part of its work alike
(bench/results.md, "diff, one run a side"). So it is estimated from the runs themselves:
- the common change of each unit (a decode token, a prefill token): where the changes of its
  finest parts (Series.finest: kinds of graph node, an engine's ops) that hold at least
  COMMON_SHARE of their whole agree, their shorth; none with fewer than COMMON_PARTS such
  parts, and never for a count. A time of that unit (or moved by it: Series.speed_unit, TPOT
  by the decode token's) must lie beyond the floor both from no change and from the common
  change: a change of most parts alike is left to several runs a side to judge;
- a quantity's drift counts twice in its floor: two runs that each move that much within
  themselves can lie twice that apart;
- how the threads shared the work (Series.sharing: a thread's op time, barrier waits) is not
  judged significant: it follows how the machine scheduled the threads, which a run keeps
  throughout and the next does not.

A part of a whole (an op's time per decode token, of the decode time per token: rows of one
unit) is also judged by what it surely moves the whole by (its interval's bound nearest to
no change): less than IMPACT times the floor of the whole (1% of the decode time per token
at the default 5%) is within the noise of the whole, however large it is for the part; with
one run a side, IMPACT_ONE_RUN times it, as nothing pools a part's own swings away. Small
ops' times swing between runs of one process by tens of percent (bench/results.md) without
moving a token's time.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

RESAMPLES = 2000
MAX_POINTS = 1024
MIN_SAMPLES = 8          # fewer on a side: shown, not judged (a bootstrap of fewer is too narrow)
DRIFT_PARTS = 4          # a run's parts whose statistic gives its drift
TREND_PARTS = 8          # a run's parts that must rise one after another for its drift to be a trend
IMPACT = 0.2             # a part's change must move its whole by this share of the noise floor
IMPACT_ONE_RUN = 1.0     # the same with one run a side: parts swing on their own more, unpooled
COMMON_SHARE = 0.02      # parts under this share of their whole on both sides swing on their own: left out
COMMON_PARTS = 3         # fewer such parts: no common change
SEED = 20261204
STATISTICS = ("median", "mean")

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
    """One quantity of one side: a sample per unit of work, in the order the units ran."""
    section: str             # "latency", "op", "layer", "node", "kernel", "copy", "thread", ...
    name: str                # its row: "decode MUL_MAT", "layer 3", "decode time per token"
    unit: str                # what a sample is: "ns per decode token", "ns per call"
    samples: np.ndarray      # float64, one per unit of work
    events: int = 0          # the records behind the samples (op runs, calls), 0: the samples
    # pooled from several runs (pool): where each run's samples end in `samples`
    run_ends: tuple[int, ...] = ()
    # one of the finest disjoint parts of its whole (its unit's latency row): what the common
    # change of a run's speed is estimated from
    finest: bool = False
    # the unit whose finest parts' common change moves this time too (TPOT: the decode
    # token's); "": its own
    speed_unit: str = ""
    # how the threads shared the work (a thread's op time, barrier waits): set by how the
    # machine scheduled them, which one run keeps throughout and the next does not
    sharing: bool = False

    @property
    def key(self) -> tuple[str, str]:
        return self.section, self.name

    @property
    def runs(self) -> list[np.ndarray]:
        ends = self.run_ends or (len(self.samples),)
        return [self.samples[a:b] for a, b in zip((0, *ends[:-1]), ends)]


@dataclass(frozen=True)
class Change:
    section: str
    name: str
    unit: str
    statistic: str               # what was compared: "median" or "mean" of the samples
    before: float | None         # the statistic per unit (None: not in that side)
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
    common: float | None = None  # one run a side: the parts' common change it was also judged against
    # one run a side: the calibrated run-to-run spread (the sd of the log of this quantity's
    # statistic over runs of one command on this machine) its interval was widened by
    spread: float | None = None

    @property
    def significant(self) -> bool:
        return self.verdict in SIGNIFICANT


def _stat(name: str, x: np.ndarray, axis=None):
    return np.median(x, axis=axis) if name == "median" else np.mean(x, axis=axis)


def block_resamples(samples: np.ndarray, rng: np.random.Generator, statistic: str,
                    resamples: int = RESAMPLES, idx: np.ndarray | None = None) -> np.ndarray:
    """The statistic of `resamples` moving-block bootstrap resamples of `samples` (over
    MAX_POINTS of them: of an even sample of MAX_POINTS, rescaled to the whole's); `idx`:
    the resamples' places, drawn by block_places (two sides of as many samples resampled at
    the same places: paired)."""
    whole = np.asarray(samples, np.float64)
    step = -(-len(whole) // MAX_POINTS)
    x = whole[::step]
    n = len(x)
    if idx is None:
        idx = block_places(len(whole), rng, resamples)
    stats = _stat(statistic, x[idx], axis=1)
    if step == 1:
        return stats
    return _stat(statistic, whole) + (stats - _stat(statistic, x)) * np.sqrt(n / len(whole))


def block_places(samples: int, rng: np.random.Generator, resamples: int = RESAMPLES) -> np.ndarray:
    """The places of `resamples` moving-block resamples of a series of `samples` (of its even
    sample of MAX_POINTS where longer): blocks of about sqrt(n), one resample a row."""
    n = len(range(0, samples, -(-samples // MAX_POINTS)))
    block = max(1, min(n // 2 or 1, round(np.sqrt(n))))
    blocks = -(-n // block)
    starts = rng.integers(0, n - block + 1, size=(resamples, blocks))
    return (starts[:, :, None] + np.arange(block)).reshape(resamples, -1)[:, :n]


def _relative_range(values: list[float]) -> float:
    whole = float(np.mean(values)) if values else 0.0
    return (max(values) - min(values)) / whole if whole > 0 and len(values) > 1 else 0.0


def drift(samples: np.ndarray, statistic: str = "median") -> float:
    """How far the statistic of a run's DRIFT_PARTS consecutive parts lies apart, over the
    parts' mean value."""
    parts = [p for p in np.array_split(np.asarray(samples, np.float64), DRIFT_PARTS) if len(p)]
    return _relative_range([float(_stat(statistic, p)) for p in parts])


def spread(s: Series, statistic: str = "median") -> float:
    """The range of a pooled series' run statistics over their mean (0 for one run; a run
    without the quantity counts 0)."""
    return _relative_range([float(_stat(statistic, r)) if len(r) else 0.0 for r in s.runs])


def trend(samples: np.ndarray, statistic: str = "median") -> float:
    """A run's drift where it is a trend: its TREND_PARTS parts' statistics rising (or
    falling) part after part, each step at least half its share of the whole move, the last's
    over the first's less one; 0 where they go up and down, or move in one step (a
    neighbour's burst, or its start: noise), or the run is too short to tell (each part under
    MIN_SAMPLES). Eight parts: parts of steady noise pass this by chance about once in 10^4
    (four parts: 2%)."""
    x = np.asarray(samples, np.float64)
    if len(x) < TREND_PARTS * MIN_SAMPLES:
        return 0.0
    parts = [float(_stat(statistic, p)) for p in np.array_split(x, TREND_PARTS)]
    if parts[0] <= 0:
        return 0.0
    steps = np.diff(parts) * np.sign(parts[-1] - parts[0])
    if np.any(steps < 0.5 * (abs(parts[-1] - parts[0]) / len(steps))):
        return 0.0
    return parts[-1] / parts[0] - 1


def _floor(s: Series, statistic: str) -> float:
    """The drift within a side's runs: its run's, or the median run's of several (one
    disturbed run must not hide every change: the runs' interval already widens for it)."""
    drifts = [drift(r, statistic) for r in s.runs if len(r)]
    return float(np.median(drifts)) if drifts else 0.0


def run_interval(before: Series, after: Series, statistic: str, confidence: float
                 ) -> tuple[float, float] | None:
    """Where both sides have several runs: the interval of the change from the runs'
    statistics (Welch's t on their logarithms: the run is the unit of run-to-run noise);
    None otherwise."""
    b = [float(_stat(statistic, r)) for r in before.runs if len(r)]
    a = [float(_stat(statistic, r)) for r in after.runs if len(r)]
    if len(b) < 2 or len(a) < 2 or min(b + a) <= 0:
        return None
    lb, la = np.log(b), np.log(a)
    vb, va = lb.var(ddof=1) / len(lb), la.var(ddof=1) / len(la)
    se = np.sqrt(vb + va)
    if se == 0:
        return None
    dof = (vb + va) ** 2 / ((vb ** 2 / (len(lb) - 1) if vb else 0) + (va ** 2 / (len(la) - 1) if va else 0))
    from scipy import stats     # here: scipy takes ~0.5 s to import, and most commands never compare
    t = stats.t.ppf(0.5 + confidence / 2, dof)
    d = la.mean() - lb.mean()
    return float(np.expm1(d - t * se)), float(np.expm1(d + t * se))


@dataclass(frozen=True)
class Spread:
    """How much a quantity's statistic varies between runs of one command on this machine,
    measured (`profinfer calibrate --spread-of`): the sd of its logarithm over `runs` runs."""
    sd: float
    runs: int

    def half_width(self, confidence: float) -> float:
        """The half-width, in log, of where two new runs' log statistics differ by chance:
        their difference over sqrt(2) sd (sd estimated from `runs`) is Student's t with
        runs - 1 degrees of freedom."""
        from scipy import stats     # here: scipy takes ~0.5 s to import
        return float(stats.t.ppf(0.5 + confidence / 2, self.runs - 1) * np.sqrt(2) * self.sd)


def widen(change: float, low: float, high: float, half: float) -> tuple[float, float]:
    """An interval on a change widened, in log, by an independent error of half-width `half`
    (their half-widths added in quadrature, each side)."""
    c = np.log1p(change)
    down, up = c - np.log1p(low), np.log1p(high) - c
    return float(np.expm1(c - np.hypot(down, half))), float(np.expm1(c + np.hypot(up, half)))


def judge(before: Series | None, after: Series | None, noise: float, confidence: float = 0.95,
          statistic: str = "median", whole: float | None = None, common: float | None = None,
          one_run: bool = False, spread: Spread | None = None) -> Change:
    """The change from `before` to `after` (the same key; either may be missing); `whole`:
    the statistic of what this quantity is a part of, where it is one; `one_run`: a side has
    one run; `common`: then, the change of its unit's finest parts, a second hypothesis the
    change must lie beyond (None: no such parts); `spread`: then, this quantity's calibrated
    run-to-run spread, which widens its interval in place of that hypothesis."""
    s = before or after
    if (before is not None and after is not None and statistic == "median"
            and min(np.median(before.samples), np.median(after.samples)) <= 0 < max(before.samples.mean(), after.samples.mean())):
        statistic = "mean"          # the op is absent from most units: its median says nothing
    b_val = float(_stat(statistic, before.samples)) if before is not None and len(before.samples) else None
    a_val = float(_stat(statistic, after.samples)) if after is not None and len(after.samples) else None
    shared = dict(section=s.section, name=s.name, unit=s.unit, statistic=statistic, before=b_val, after=a_val,
                  before_n=len(before.samples) if before is not None else 0,
                  after_n=len(after.samples) if after is not None else 0,
                  before_events=(before.events or len(before.samples)) if before is not None else 0,
                  after_events=(after.events or len(after.samples)) if after is not None else 0)
    if b_val is None or a_val is None:
        return Change(**shared, change=None, low=None, high=None, floor=None,
                      verdict=ONLY_AFTER if b_val is None else ONLY_BEFORE)
    if b_val <= 0:          # nothing to divide by: nothing before, something after
        return Change(**shared, change=None if a_val > 0 else 0.0, low=None, high=None, floor=None,
                      verdict=ONLY_AFTER if a_val > 0 else NO_CHANGE)
    change = a_val / b_val - 1
    if min(len(before.samples), len(after.samples)) < MIN_SAMPLES:
        return Change(**shared, change=change, low=None, high=None, floor=None, verdict=FEW_SAMPLES)
    rng = np.random.default_rng(SEED)
    paired = paired_drift(before, after, statistic, noise) if one_run else None
    if paired is not None:          # the runs of one command, place by place: resampled at the same places
        places = block_places(len(before.samples), rng)
        b, a = (block_resamples(s.samples, rng, statistic, idx=places) for s in (before, after))
    else:
        b, a = block_resamples(before.samples, rng, statistic), block_resamples(after.samples, rng, statistic)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratios = a / np.where(b > 0, b, np.nan) - 1
    ratios = ratios[np.isfinite(ratios)]
    tail = (1 - confidence) / 2 * 100
    low, high = (float(v) for v in np.percentile(ratios, [tail, 100 - tail]))
    runs = run_interval(before, after, statistic, confidence)
    if runs is not None:             # the wider of the two: within runs, between runs
        low, high = min(low, runs[0]), max(high, runs[1])
    if one_run and spread is not None:     # what one run a side cannot see, as measured here
        low, high = widen(change, low, high, spread.half_width(confidence))
        common = None
    drift = _drift_of_both(before, after, statistic, noise, paired)
    floor = max(noise, (2 if one_run else 1) * drift)
    verdict = _verdict(change, low, high, floor)
    if common is not None and verdict in SIGNIFICANT:
        beyond = _verdict((1 + change) / (1 + common) - 1, (1 + low) / (1 + common) - 1,
                          (1 + high) / (1 + common) - 1, floor)
        if beyond != verdict:
            verdict = UNCERTAIN if beyond == UNCERTAIN else WITHIN_NOISE
    if one_run and s.sharing and verdict in SIGNIFICANT:
        verdict = WITHIN_NOISE
    surely = low if low > 0 else -high if high < 0 else 0.0
    impact = IMPACT_ONE_RUN if one_run else IMPACT
    if verdict != NO_CHANGE and whole and surely * b_val < impact * noise * whole:
        verdict = WITHIN_NOISE
    return Change(**shared, change=change, low=low, high=high, floor=floor, verdict=verdict, common=common,
                  spread=spread.sd if one_run and spread is not None else None)


def _drift_of_both(before: Series, after: Series, statistic: str, noise: float,
                   paired: float | None = None) -> float:
    """The drift the floor holds: the larger of the sides' (a quantity that moves that much
    within a run is not called changed by less between two), except, one run a side:
    - where one side trends beyond the noise floor (its parts' statistics rising part after
      part: a slowdown growing through the run) while the other is steady within it: that
      trend is the change, not noise, and the steady side's drift is the floor's;
    - where both trend alike (a quantity that grows with the unit's place in the run, as
      attention with the KV cache's length), the drift of their ratio unit by unit
      (paired_drift): the place moves both sides alike and cancels there, and what is left
      is what moves one run against the other (their interval then resamples both sides at
      the same places)."""
    b, a = _floor(before, statistic), _floor(after, statistic)
    if len(before.runs) == 1 and len(after.runs) == 1:
        if a > noise >= b and abs(trend(after.samples, statistic)) > noise:
            return b
        if b > noise >= a and abs(trend(before.samples, statistic)) > noise:
            return a
        if paired is not None:
            return min(max(b, a), paired)
    return max(b, a)


def paired_drift(before: Series, after: Series, statistic: str, noise: float) -> float | None:
    """One run a side with a sample per unit at the same places (as many units: the runs
    of one command) whose runs both trend beyond the noise the same way: the drift of the
    ratio of their samples, place by place. None otherwise (units that do not line up, or a
    quantity that does not move with its place on both sides: nothing to cancel)."""
    b, a = np.asarray(before.samples, np.float64), np.asarray(after.samples, np.float64)
    if len(before.runs) != 1 or len(after.runs) != 1 or len(b) != len(a) \
            or len(b) < TREND_PARTS * MIN_SAMPLES or np.any(b <= 0) or np.any(a <= 0):
        return None
    tb, ta = trend(b, statistic), trend(a, statistic)
    if min(abs(tb), abs(ta)) <= noise or tb * ta <= 0:
        return None
    return drift(a / b, statistic)


def _verdict(change: float, low: float, high: float, floor: float) -> str:
    if low > floor:
        return SLOWER
    if high < -floor:
        return FASTER
    if low <= 0 <= high:
        return NO_CHANGE
    if abs(change) < floor:
        return WITHIN_NOISE
    return UNCERTAIN


def pool(runs: list[list[Series]]) -> list[Series]:
    """Several runs of one side as one: each quantity's samples in run order, and where each
    run's end (a run without the quantity: none of its samples)."""
    if len(runs) == 1:
        return runs[0]
    first: dict[tuple[str, str], Series] = {}
    for run in runs:
        for s in run:
            first.setdefault(s.key, s)
    out = []
    for key, model in first.items():
        found = [next((s for s in run if s.key == key), None) for run in runs]
        parts = [s.samples if s is not None else np.zeros(0) for s in found]
        out.append(Series(model.section, model.name, model.unit, np.concatenate(parts),
                          sum((s.events or len(s.samples)) for s in found if s is not None),
                          tuple(np.cumsum([len(p) for p in parts]).tolist()), model.finest, model.speed_unit,
                          model.sharing))
    return out


def compare(before: list[Series], after: list[Series], noise: float, confidence: float = 0.95,
            statistic: str = "median", spreads: dict[tuple[str, str], Spread] | None = None) -> list[Change]:
    """Every quantity of either side, matched by key, in the order they first appear (the
    before side's, then what only the after side has); `spreads`: the calibrated run-to-run
    spread of some quantities (by key), used where a side has one run."""
    b = {s.key: s for s in before}
    a = {s.key: s for s in after}
    keys = list(b) + [k for k in a if k not in b]
    wholes = {s.unit: max(float(_stat(statistic, s.samples)), float(_stat(statistic, a[k].samples)))
              for k, s in b.items() if s.section == "latency" and k in a
              and len(s.samples) and len(a[k].samples)}
    one_run = not any(len(s.runs) > 1 for s in before) or not any(len(s.runs) > 1 for s in after)
    commons = common_changes(b, a, wholes, statistic) if one_run else {}
    out = []
    for k in keys:
        s = b.get(k) or a.get(k)
        out.append(judge(b.get(k), a.get(k), noise, confidence, statistic,
                         None if k[0] == "latency" else wholes.get(s.unit),
                         commons.get(s.speed_unit or s.unit), one_run, (spreads or {}).get(k)))
    return out


def common_changes(before: dict, after: dict, wholes: dict[str, float], statistic: str) -> dict[str, float]:
    """Per unit, the common change (shorth) of its finest parts on both sides with at least
    MIN_SAMPLES samples and COMMON_SHARE of their whole on a side; none for a unit of fewer
    than COMMON_PARTS."""
    changes: dict[str, list[float]] = {}
    for k, s in before.items():
        t = after.get(k)
        whole = wholes.get(s.unit)
        if not (s.finest and t is not None and whole) or min(len(s.samples), len(t.samples)) < MIN_SAMPLES:
            continue
        b, a = float(_stat(statistic, s.samples)), float(_stat(statistic, t.samples))
        if b > 0 and a > 0 and max(a, b) >= COMMON_SHARE * whole:
            changes.setdefault(s.unit, []).append(a / b - 1)
    return {unit: shorth(c) for unit, c in changes.items() if len(c) >= COMMON_PARTS}


def shorth(changes: list[float]) -> float:
    """Where most changes agree: the median of the shortest run of n // 2 + 1 sorted log
    changes (Rousseeuw's shorth, which half of them changing otherwise cannot move, where
    the plain median of 8 moves with 3)."""
    x = np.sort(np.log1p(changes))
    h = len(x) // 2 + 1
    i = int(np.argmin(x[h - 1:] - x[:len(x) - h + 1]))
    return float(np.expm1(np.median(x[i:i + h])))
