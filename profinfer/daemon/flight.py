"""The flight recorder's triggers: conditions on a watched process's own series (latencies,
decode throughput, batch sizes, CUDA sync times: QUANTITIES), such as `tpot_p99 > 3x
baseline for 5s`, `ttft_p99 > 2s` or `tps_p10 < 0.5x baseline`, that, held for their time,
fire once per incident. A trigger fires again only after its condition has been clear for its hold
time and a cooldown has passed since it fired; a baseline-relative one whose condition still
holds once its baseline's window and the cooldown have passed takes that as the new normal.

A condition's statistic is taken over the last WINDOW_S of samples, or over the newest
WINDOW_MAX_SAMPLES where there are more (a busy server's window would otherwise hold so many
fast samples that a slowdown took seconds to reach its p99); a baseline is the same
statistic over the baseline window before that (5 minutes unless set), frozen from the
moment the condition first holds (the incident's own samples never raise it). A window
with fewer than MIN_WINDOW_SAMPLES samples, or a baseline with fewer than
MIN_BASELINE_SAMPLES or covering less than a quarter of its window, judges nothing: a
process warming up does not fire."""
from __future__ import annotations

import math
import re
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from profinfer.core.errors import ProfinferError

# each quantity's meaning and unit: seconds; decode tokens per second; tokens
QUANTITIES = {"ttft": ("time to first token", "s"),
              "tpot": ("time per output token", "s"),
              "call": ("decode call (llama.cpp) or step (vLLM) time", "s"),
              "tps": ("decode tokens per second of a decode call or step (its decoding sequences' "
                      "tokens over its time)", "tokens/s"),
              "batch": ("tokens in a decode call or step (prompt and decode)", "tokens"),
              "sync": ("a CUDA synchronising call's time (the cuda level's mean over each of "
                       "the daemon's reads of its counts)", "s")}
WINDOW_S = 10.0
DEFAULT_BASELINE_S = 300.0
MIN_WINDOW_SAMPLES = 20
WINDOW_MAX_SAMPLES = 500
MIN_BASELINE_SAMPLES = 100
BIN_S = 1.0                 # samples are kept in bins of this long
# A bin keeps its newest WINDOW_MAX_SAMPLES (a bound whatever the rate); a baseline reads an
# even sample of at most BASELINE_BIN_SAMPLES of each (its percentile, cheaply, every few s)
BASELINE_BIN_SAMPLES = 100
EVALUATE_S = 0.5            # conditions judged at most this often
BASELINE_EVERY_S = 5.0      # a baseline not frozen is recomputed at most this often
SERIES_S = 120.0            # a firing carries its quantity's series this far back
DEFAULT_COOLDOWN_S = 60.0

_UNITS = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}
_SYNTAX = re.compile(
    r"^\s*(?P<quantity>[a-z]+)_p(?P<stat>\d{1,2}(?:\.\d+)?)\s*(?P<op>[<>])\s*(?P<value>\d+(?:\.\d+)?)\s*"
    r"(?P<unit>x\s*baseline|ns|us|ms|s)?\s*(?:for\s+(?P<hold>\d+(?:\.\d+)?)\s*(?P<hold_unit>ms|s)?)?\s*$")
EXAMPLES = "e.g. 'tpot_p99 > 3x baseline for 5s', 'ttft_p99 > 2s' or 'tps_p10 < 0.5x baseline for 5s'"


@dataclass(frozen=True)
class Trigger:
    text: str
    quantity: str            # a key of QUANTITIES
    stat: str                # `p99`, as written
    limit: float | None      # beyond this (in the quantity's unit); or
    factor: float | None     # beyond this multiple of the process's baseline
    hold_s: float
    below: bool = False      # the condition is the statistic under the limit (a rate fallen)

    @property
    def percentile(self) -> float:
        """The statistic: this percentile of the window's samples."""
        return float(self.stat[1:])

    @property
    def unit(self) -> str:
        return QUANTITIES[self.quantity][1]

    @property
    def reason(self) -> str:
        """What profinfer_captures_total{reason} says: the quantity and statistic."""
        return f"{self.quantity}_{self.stat}"

    def beyond(self, value: float, limit: float) -> bool:
        return value < limit if self.below else value > limit


def in_unit(value: float | None, unit: str) -> str:
    """A quantity's value as a person reads it: times in ms."""
    if value is None:
        return "?"
    return f"{value * 1e3:.2f} ms" if unit == "s" else f"{value:,.1f} {unit}"


def parse_duration(text: str, what: str) -> float:
    """`10s`, `500ms`, `2m` or bare seconds, above 0."""
    m = re.match(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m)?\s*$", text)
    seconds = float(m[1]) * {"ms": 1e-3, "s": 1.0, "m": 60.0}[m[2] or "s"] if m else math.nan
    if not 0 < seconds < math.inf:       # 309 digits make an infinity
        raise ProfinferError(f"{what} {text!r}: expected a duration above 0 (e.g. 10s, 500ms, 2m)")
    return seconds


def parse_trigger(text: str) -> Trigger:
    """`QUANTITY_pNN > LIMIT [for HOLD]` (or `<`: a rate fallen): LIMIT in the quantity's
    unit (a time in us, ms or s, seconds when bare; a count or rate bare), or `Nx baseline`;
    HOLD in ms or s (0 when left out)."""
    m = _SYNTAX.match(text)
    if m is None:
        raise ProfinferError(f"--trigger {text!r}: expected {EXAMPLES} (QUANTITY_pNN > or < LIMIT [for HOLD])")
    quantity, stat = m["quantity"], "p" + m["stat"]
    if quantity not in QUANTITIES:
        raise ProfinferError(f"--trigger {text!r}: no quantity {quantity!r}; choose from {', '.join(QUANTITIES)}")
    if not 0 < float(m["stat"]) < 100:
        raise ProfinferError(f"--trigger {text!r}: a percentile is between 0 and 100 (p50, p90, p99, p10)")
    value, below = float(m["value"]), m["op"] == "<"
    unit = (m["unit"] or "").replace(" ", "")
    hold = float(m["hold"] or 0) * _UNITS[m["hold_unit"] or "s"]
    if not (math.isfinite(value) and math.isfinite(hold)):
        raise ProfinferError(f"--trigger {text!r}: a number too large")
    if unit == "xbaseline":
        if value <= 0 or value == 1 or (value > 1) == below:
            raise ProfinferError(f"--trigger {text!r}: a multiple of the baseline is above 1 with '>', "
                                 f"between 0 and 1 with '<'")
        return Trigger(text.strip(), quantity, stat, None, value, hold, below)
    timed = QUANTITIES[quantity][1] == "s"
    if unit and not timed:
        raise ProfinferError(f"--trigger {text!r}: {quantity} is in {QUANTITIES[quantity][1]}: its limit "
                             f"is a bare number")
    if value <= 0:
        raise ProfinferError(f"--trigger {text!r}: the limit must be above 0")
    return Trigger(text.strip(), quantity, stat, value * (_UNITS[unit or "s"] if timed else 1.0),
                   None, hold, below)


class Bin:
    """A second's samples: its newest WINDOW_MAX_SAMPLES while the window may read them, then
    an even sample of BASELINE_BIN_SAMPLES (what a baseline reads), and how many came."""
    __slots__ = ("start", "values", "seen")

    def __init__(self, start: float):
        self.start = start
        self.values: deque[float] | np.ndarray = deque(maxlen=WINDOW_MAX_SAMPLES)
        self.seen = 0

    def compact(self) -> None:
        if isinstance(self.values, deque):
            v = np.asarray(self.values, dtype=np.float32)
            self.values = v[::max(1, len(v) // BASELINE_BIN_SAMPLES)][:BASELINE_BIN_SAMPLES]


class Series:
    """One quantity's samples (seconds) of one process, in bins of BIN_S, as far back as a
    baseline and its window reach (horizon_s)."""

    def __init__(self, horizon_s: float):
        self.horizon_s = horizon_s
        self.bins: deque[Bin] = deque()

    def add(self, now: float, values: list[float]) -> None:
        start = (now // BIN_S) * BIN_S
        if not self.bins or self.bins[-1].start != start:
            for old in reversed(self.bins):        # out of the window's reach: compacted
                if old.start >= start - WINDOW_S - BIN_S:
                    continue
                if not isinstance(old.values, deque):
                    break
                old.compact()
            while self.bins and self.bins[0].start < start - self.horizon_s - BIN_S:
                self.bins.popleft()
            self.bins.append(Bin(start))
        self.bins[-1].values.extend(values)
        self.bins[-1].seen += len(values)

    def between(self, lo: float, hi: float) -> tuple[np.ndarray, float]:
        """An even sample of the samples of the bins that begin inside [lo, hi), and how far
        back the first of them begins (s before hi)."""
        inside = [b for b in self.bins if lo <= b.start < hi and b.seen]
        if not inside:
            return np.zeros(0), 0.0
        parts = [np.asarray(b.values)[::max(1, len(b.values) // BASELINE_BIN_SAMPLES)] for b in inside]
        return np.concatenate(parts), hi - inside[0].start

    def newest(self, since: float) -> np.ndarray:
        """The newest samples from `since` on, WINDOW_MAX_SAMPLES at most."""
        parts, n = [], 0
        for b in reversed(self.bins):
            if b.start < since or n >= WINDOW_MAX_SAMPLES:
                break
            if b.seen:
                parts.append(list(b.values)[-(WINDOW_MAX_SAMPLES - n):])
                n += len(parts[-1])
        return np.concatenate([np.asarray(p) for p in parts]) if parts else np.zeros(0)

    def per_bin(self, lo: float, stat: float) -> list[tuple[float, float, int]]:
        """(bin start, the statistic, samples that came) of each bin from lo on (a firing's
        series; an older bin's statistic is its even sample's)."""
        return [(b.start, float(np.percentile(b.values, stat)), b.seen) for b in self.bins
                if b.start >= lo and b.seen]


@dataclass
class TriggerState:
    pending_since: float | None = None     # the condition has held since
    baseline: float | None = None          # frozen while pending or fired
    baseline_at: float = float("-inf")     # when it was last computed (not frozen)
    baseline_until: float | None = None    # its samples are from before this
    baseline_from: float = float("-inf")   # and from this on (a firing's re-arm)
    baseline_lo: float = float("-inf")     # the baseline's samples begin here (the one in use)
    fired_at: float | None = None          # it fired, and has not re-armed since
    clear_since: float | None = None       # after a firing, the condition is clear since
    value: float | None = None             # the statistic at the last judgment (None: too few samples)
    limit: float | None = None             # and the limit then (None: no baseline yet)

    def as_dict(self, trigger: Trigger, now: float) -> dict:
        """What `profinfer status` shows of it: armed (a value and a limit), holding, fired."""
        return {"trigger": trigger.text, "unit": trigger.unit, "value": self.value, "limit": self.limit,
                "baseline": self.baseline if trigger.factor is not None else None,
                "holding_s": None if self.pending_since is None or self.fired_at is not None else now - self.pending_since,
                "fired_s_ago": None if self.fired_at is None else now - self.fired_at}


@dataclass
class Firing:
    """What a trigger saw when it fired, for its capture's record (values in the quantity's
    unit)."""
    trigger: Trigger
    at: float                   # CLOCK_MONOTONIC s
    value: float                # the statistic over the window
    limit: float                # what it was beyond
    baseline: float | None
    baseline_until: float | None    # the baseline's samples are from before this (monotonic s)
    baseline_window_s: float
    window_samples: int
    series: list[tuple[float, float, int]] = field(default_factory=list)
    baseline_from: float = float("-inf")    # the baseline's samples begin here (or a re-arm's)
    began: float | None = None              # the condition has held since (monotonic s)

    def as_dict(self) -> dict:
        return {"trigger": self.trigger.text, "reason": self.trigger.reason,
                "quantity": self.trigger.quantity, "stat": self.trigger.stat, "unit": self.trigger.unit,
                "below": self.trigger.below,
                "value": self.value, "limit": self.limit, "baseline": self.baseline,
                "hold_s": self.trigger.hold_s, "window_s": WINDOW_S,
                "baseline_window_s": self.baseline_window_s, "baseline_until_monotonic_s": self.baseline_until,
                "window_samples": self.window_samples, "fired_monotonic_s": self.at,
                "series": [{"t": t, "value": v, "samples": n} for t, v, n in self.series]}


class Triggers:
    """Every watched process's series and each trigger's state for it; judge() fires
    `on_fire(key, firing)` (key: the process's (pid, start)) from the agent's loop."""

    def __init__(self, triggers: list[Trigger], on_fire: Callable[[tuple, Firing], None],
                 cooldown_s: float = DEFAULT_COOLDOWN_S, baseline_s: float = DEFAULT_BASELINE_S,
                 on_pending: Callable[[tuple], None] = lambda key: None):
        self.triggers = triggers
        self.on_fire = on_fire
        self.on_pending = on_pending      # a condition began to hold for the process (key)
        self.cooldown_s = cooldown_s
        self.baseline_s = baseline_s
        self.quantities = {t.quantity for t in triggers}
        self.lock = threading.Lock()
        self.series: dict[tuple, dict[str, Series]] = {}
        self.states: dict[tuple, list[TriggerState]] = {}
        self.judged_at = float("-inf")

    def observe(self, key: tuple, quantity: str, now: float, values: list[float]) -> None:
        if quantity not in self.quantities or not values:
            return
        with self.lock:
            per = self.series.setdefault(key, {})
            per.setdefault(quantity, Series(WINDOW_S + self.baseline_s)).add(now, values)

    def forget(self, key: tuple) -> None:
        with self.lock:
            self.series.pop(key, None)
            self.states.pop(key, None)

    def series_since(self, key: tuple, trigger: Trigger, lo: float) -> list[tuple[float, float, int]]:
        with self.lock:
            s = self.series.get(key, {}).get(trigger.quantity)
            return s.per_bin(lo, trigger.percentile) if s else []

    def state_dicts(self, key: tuple, now: float) -> list[dict]:
        """Each trigger's state for the process (TriggerState.as_dict)."""
        with self.lock:
            return [st.as_dict(t, now) for t, st in zip(self.triggers, self.states.get(key, []))]

    def judge(self, now: float) -> None:
        if now - self.judged_at < EVALUATE_S:
            return
        self.judged_at = now
        fired, pending = [], []
        with self.lock:
            for key, per in self.series.items():
                states = self.states.setdefault(key, [TriggerState() for _ in self.triggers])
                for trigger, state in zip(self.triggers, states):
                    s = per.get(trigger.quantity)
                    if s is not None:
                        was = state.pending_since
                        f = self._judge_one(trigger, state, s, now)
                        if was is None and state.pending_since is not None:
                            pending.append(key)
                        if f is not None:
                            fired.append((key, f))
        for key in dict.fromkeys(pending):      # outside the lock, as firings
            self.on_pending(key)
        for key, f in fired:             # outside the lock: a capture may take a while to start
            self.on_fire(key, f)

    def _judge_one(self, trigger: Trigger, state: TriggerState, s: Series, now: float) -> Firing | None:
        window = s.newest(now - WINDOW_S)
        stat = trigger.percentile
        value = float(np.percentile(window, stat)) if len(window) >= MIN_WINDOW_SAMPLES else None
        limit = trigger.limit
        if trigger.factor is not None:
            if state.pending_since is None and state.fired_at is None and now - state.baseline_at >= BASELINE_EVERY_S:
                state.baseline_at = now
                lo = max(now - WINDOW_S - self.baseline_s, state.baseline_from)
                base, span = s.between(lo, now - WINDOW_S)
                if len(base) >= MIN_BASELINE_SAMPLES and span >= self.baseline_s / 4:
                    state.baseline, state.baseline_until = float(np.percentile(base, stat)), now - WINDOW_S
                    state.baseline_lo = lo
                # else the one before the last incident holds until a new one is whole (or none yet)
            limit = trigger.factor * state.baseline if state.baseline is not None else None
        state.value, state.limit = value, limit
        holds = value is not None and limit is not None and trigger.beyond(value, limit)
        if state.fired_at is not None:       # re-armed once clear for the hold time and cooled down
            if holds:
                state.clear_since = None
            elif state.clear_since is None:
                state.clear_since = now
            cleared = state.clear_since is not None and now - state.clear_since >= trigger.hold_s \
                and now - state.fired_at >= self.cooldown_s
            # still holding once a baseline's window and the cooldown have both passed: the
            # process's new normal, the next baseline (a trigger clear by then re-arms as usual,
            # its baseline kept)
            shifted = trigger.factor is not None and state.clear_since is None \
                and now - state.fired_at >= max(self.baseline_s, self.cooldown_s)
            if cleared or shifted:
                state.fired_at = state.clear_since = state.pending_since = None
                # the next baseline's samples begin here: the incident and its capture are
                # not in it; until it is whole, the one before the incident holds (after a
                # shift, none: the old normal is gone)
                state.baseline_from, state.baseline_at = now, float("-inf")
                if shifted:
                    state.baseline = None
            return None
        if not holds:
            state.pending_since = None
            return None
        if state.pending_since is None:
            state.pending_since = now
        if now - state.pending_since < trigger.hold_s:
            return None
        state.fired_at = now
        factored = trigger.factor is not None
        return Firing(trigger, now, value, limit, state.baseline if factored else None,
                      state.baseline_until if factored else None, self.baseline_s, len(window),
                      s.per_bin(now - SERIES_S, stat), state.baseline_lo if factored else float("-inf"),
                      state.pending_since)
