"""The flight recorder's triggers: conditions on a watched process's own series (latencies,
decode throughput, batch sizes, CUDA sync times: QUANTITIES), such as `tpot_p99 > 3x
baseline for 5s`, `ttft_p99 > 2s` or `tps_p10 < 0.5x baseline`, that, held for their time,
fire once per incident. A trigger fires again only after its condition has been clear for its hold
time and a cooldown has passed since it fired; a baseline-relative one whose condition still
holds once its baseline's window and the cooldown have passed takes that as the new normal.

A condition's statistic is taken over the samples of the last window (10 s unless set), or
over the newest WINDOW_MAX_SAMPLES where there are more (a busy server's window would
otherwise hold so many fast samples that a slowdown took seconds to reach its p99). It holds
only where the samples resolve it: the statistic is beyond the limit, and the share of
samples beyond the limit is past the percentile's tail (1% for a p99 above, 10% for a p10
below) at a one-sided CONFIDENCE (Clopper-Pearson), so that one slow token among many does
not make a p99. A window with fewer samples than the percentile could ever be resolved by is
widened back, up to WIDEST_WINDOWS windows (a TTFT at half a request a second). `for HOLD`
is the time the condition held at every judgment, and the samples that came within the hold
must resolve it by themselves, in each of HOLD_SLICES slices in turn: an outlier that keeps a
small window's p99 up, or a slowdown over the hold's first second, does not hold it.

A baseline is the median of the same statistic over each window's length of the baseline
window (5 minutes unless set) before the condition's window: a window's typical statistic.
It is not taken while the process is young (its samples span less than
the whole baseline window), and it is frozen from any excursion of the statistic over half
the way to the limit, whose samples (from its window's start on) never enter a later
baseline: a flap shorter than the hold, or a ramp that passes half the way within about half
a baseline window, does not raise it (a slower ramp is followed: so a rolling baseline does).
An excursion that lasts a baseline window without firing, or excursions that cover half of
one, are the new normal: the baseline is taken from them at once (the trigger stays armed)."""
from __future__ import annotations

import math
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from profinfer.core.base.errors import ProfinferError
from profinfer.daemon.flight.series import BIN_S, WINDOW_MAX_SAMPLES, Series

# each quantity's meaning and unit: seconds; decode tokens per second; tokens
QUANTITIES = {"ttft": ("time to first token", "s"),
              "tpot": ("time per output token", "s"),
              "call": ("decode call (llama.cpp) or step (vLLM) time", "s"),
              "tps": ("decode tokens per second of a decode call or step (its decoding sequences' "
                      "tokens over its time)", "tokens/s"),
              "batch": ("tokens in a decode call or step (prompt and decode)", "tokens"),
              "sync": ("a CUDA synchronising call's time (the cuda level's mean over each of "
                       "the daemon's reads of its counts)", "s")}
DEFAULT_WINDOW_S = 10.0
DEFAULT_BASELINE_S = 300.0
# a percentile whose tail holds fewer samples than this in a full window is refused (p99.9
# of 500 samples would be their second largest)
MIN_TAIL_SAMPLES = 2
CONFIDENCE = 0.99
WIDEST_WINDOWS = 6          # a window too sparse to resolve its percentile widens this far back
HOLD_SLICES = 2             # a hold's samples, in halves in turn, each resolves the condition (in fifths, a
                            # preempted server's fifth often held one slow token: it fired seconds late)
MIN_BASELINE_SAMPLES = 100
EVALUATE_S = 0.5            # conditions judged at most this often
BASELINE_EVERY_S = 5.0      # a baseline not frozen is recomputed at most this often (or each half window)
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

    @property
    def tail(self) -> float:
        """The share of samples beyond the limit that puts the statistic beyond it: 1% for a
        p99 above, 10% for a p10 below."""
        return self.percentile / 100 if self.below else 1 - self.percentile / 100

    @property
    def fewest_samples(self) -> int:
        """The fewest samples that can resolve the condition (every one of them beyond the
        limit): its window is widened to hold them."""
        return max(2, math.ceil(math.log(1 - CONFIDENCE) / math.log(self.tail) + 1e-9))


def share_beyond_low(beyond: int, n: int) -> float:
    """The one-sided lower bound, at CONFIDENCE, on the share of a quantity's samples beyond a
    limit, from `beyond` of `n` (Clopper-Pearson)."""
    if not 0 < beyond <= n:
        return 0.0
    # imported here: scipy's import takes ~0.3 s, which every command reaching this module's
    # display helpers (a recording's summary) would pay
    from scipy.special import betaincinv
    return float(betaincinv(beyond, n - beyond + 1, 1 - CONFIDENCE))


def resolves(trigger: "Trigger", samples: np.ndarray, limit: float) -> bool:
    """The samples resolve the condition: more than the percentile's tail of them lie beyond
    the limit, at CONFIDENCE."""
    n = len(samples)
    if n == 0:
        return False
    beyond = int(np.count_nonzero(samples < limit if trigger.below else samples > limit))
    return share_beyond_low(beyond, n) > trigger.tail


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
    tail = float(m["stat"]) / 100 if below else 1 - float(m["stat"]) / 100
    if tail * WINDOW_MAX_SAMPLES < MIN_TAIL_SAMPLES:
        most = 100 * (1 - MIN_TAIL_SAMPLES / WINDOW_MAX_SAMPLES)
        raise ProfinferError(f"--trigger {text!r}: a window keeps {WINDOW_MAX_SAMPLES} samples at most, and "
                             f"{stat}'s tail would hold fewer than {MIN_TAIL_SAMPLES} of them; use "
                             + (f"p{100 - most:g} or above" if below else f"p{most:g} or below"))
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
    value: float | None = None             # the statistic at the last judgment (None: no samples)
    limit: float | None = None             # and the limit then (None: no baseline yet)
    window: tuple[float, int] = (0.0, 0)   # the last judgment's window: how far back (s), samples
    resolved: bool = False                 # the condition held over that window's samples
    first_seen: float | None = None        # the first judgment with samples (how young it is)
    excursion_since: float | None = None   # the statistic over half the way to the limit since
    left_out: list[tuple[float, float, int]] = field(default_factory=list)  # excursions' spans (from, to, how many)
    baseline_why: str = "none yet"         # why the baseline is what it is (status)
    window_why: str = ""                   # a window too sparse to resolve the condition: why (status)

    def as_dict(self, trigger: Trigger, now: float) -> dict:
        """What `profinfer status` shows of it: armed (a value and a limit), holding, fired;
        the window it was judged over, and its baseline's state."""
        return {"trigger": trigger.text, "unit": trigger.unit, "value": self.value, "limit": self.limit,
                "baseline": self.baseline if trigger.factor is not None else None,
                "baseline_state": self.baseline_why if trigger.factor is not None else None,
                "window_s": self.window[0], "window_samples": self.window[1], "resolved": self.resolved,
                "window_state": self.window_why or None,
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
    window_s: float = DEFAULT_WINDOW_S      # the window judged (as far back as it was widened)
    hold_samples: int = 0                   # the samples that came within the hold

    def as_dict(self) -> dict:
        return {"trigger": self.trigger.text, "reason": self.trigger.reason,
                "quantity": self.trigger.quantity, "stat": self.trigger.stat, "unit": self.trigger.unit,
                "below": self.trigger.below,
                "value": self.value, "limit": self.limit, "baseline": self.baseline,
                "hold_s": self.trigger.hold_s, "window_s": self.window_s, "hold_samples": self.hold_samples,
                "baseline_window_s": self.baseline_window_s, "baseline_until_monotonic_s": self.baseline_until,
                "window_samples": self.window_samples, "fired_monotonic_s": self.at,
                "series": [{"t": t, "value": v, "samples": n} for t, v, n in self.series]}


class Triggers:
    """Every watched process's series and each trigger's state for it; judge() fires
    `on_fire(key, firing)` (key: the process's (pid, start)) from the agent's loop."""

    def __init__(self, triggers: list[Trigger], on_fire: Callable[[tuple, Firing], None],
                 cooldown_s: float = DEFAULT_COOLDOWN_S, baseline_s: float = DEFAULT_BASELINE_S,
                 on_pending: Callable[[tuple], None] = lambda key: None, window_s: float = DEFAULT_WINDOW_S):
        self.triggers = triggers
        self.on_fire = on_fire
        self.on_pending = on_pending      # a condition began to hold for the process (key)
        self.cooldown_s = cooldown_s
        self.baseline_s = baseline_s
        self.window_s = window_s
        self.baseline_every_s = min(BASELINE_EVERY_S, window_s / 2)
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
            widest = WIDEST_WINDOWS * self.window_s
            per.setdefault(quantity, Series(max(widest, self.window_s + self.baseline_s), widest)).add(now, values)

    def forget(self, key: tuple) -> None:
        with self.lock:
            self.series.pop(key, None)
            self.states.pop(key, None)

    def series_since(self, key: tuple, trigger: Trigger, lo: float) -> list[tuple[float, float, int]]:
        with self.lock:
            s = self.series.get(key, {}).get(trigger.quantity)
            return s.per_bin(lo, trigger.percentile) if s else []

    def rearm(self, key: tuple, trigger: Trigger) -> None:
        """The trigger's firing for the process undone (its capture could not start: the places
        were taken): it fires again once its condition has held for its hold anew."""
        with self.lock:
            states = self.states.get(key)
            if states is not None and trigger in self.triggers:
                state = states[self.triggers.index(trigger)]
                state.fired_at = state.clear_since = state.pending_since = None

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
        window, oldest = s.newest(now - self.window_s, trigger.fewest_samples, now - WIDEST_WINDOWS * self.window_s)
        value = float(np.percentile(window, trigger.percentile)) if len(window) else None
        state.window = (now - min(oldest, now - self.window_s), len(window))
        state.window_why = "" if len(window) >= trigger.fewest_samples else (
            f"too sparse: {len(window)} samples in {state.window[0]:.0f} s (widened as far as it goes), "
            f"{trigger.fewest_samples} needed to resolve {trigger.stat}")
        if value is not None and state.first_seen is None:
            state.first_seen = now
        limit = trigger.limit
        if trigger.factor is not None:
            self._baseline(trigger, state, s, now, value, window)
            limit = trigger.factor * state.baseline if state.baseline is not None else None
        state.value, state.limit = value, limit
        holds = state.resolved = value is not None and limit is not None and trigger.beyond(value, limit) \
            and resolves(trigger, window, limit)
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
                state.excursion_since, state.left_out = None, []
                if shifted:
                    state.baseline = None
                    state.baseline_why = "taken afresh: the condition held past a baseline window (a new normal)"
            return None
        if not holds:
            state.pending_since = None
            return None
        if state.pending_since is None:
            state.pending_since = now
        if now - state.pending_since < trigger.hold_s:
            return None
        held = np.zeros(0)
        if trigger.hold_s > 0:
            # the samples that came within the hold resolve it by themselves, in each of its
            # slices in turn (not a window's old outlier, nor a slowdown over its first second)
            held = s.since(state.pending_since)
            parts = max(1, min(HOLD_SLICES, len(held) // trigger.fewest_samples))
            if not all(resolves(trigger, part, limit) for part in np.array_split(held, parts)):
                return None
        state.fired_at = now
        factored = trigger.factor is not None
        return Firing(trigger, now, value, limit, state.baseline if factored else None,
                      state.baseline_until if factored else None, self.baseline_s, len(window),
                      s.per_bin(now - SERIES_S, trigger.percentile), state.baseline_lo if factored else float("-inf"),
                      state.pending_since, state.window[0], len(held))

    def _baseline(self, trigger: Trigger, state: TriggerState, s: Series, now: float, value: float | None,
                  window: np.ndarray) -> None:
        """The trigger's baseline for the process, taken again at most each baseline_every_s
        while the condition neither holds nor has fired: never while the process is young,
        frozen from an excursion that the window resolves over half the way to the limit
        (whose samples no later baseline holds), an excursion that lasts a baseline window being the new normal."""
        afresh = ""
        if state.baseline is not None and value is not None and state.pending_since is None and state.fired_at is None:
            midway = state.baseline * (1 + trigger.factor) / 2
            if trigger.beyond(value, midway) and resolves(trigger, window, midway):
                if state.excursion_since is None:
                    state.excursion_since = now
                elif now - state.excursion_since >= self.baseline_s:     # the new normal
                    # taken at once from the excursion's samples (a baseline window of them):
                    # left unset until the next recompute, the trigger judged nothing meanwhile
                    state.baseline_from, state.baseline = state.excursion_since, None
                    state.excursion_since, state.left_out = None, []
                    state.baseline_at = float("-inf")
                    afresh = "taken afresh: an excursion lasted a baseline window (a new normal)"
            elif state.excursion_since is not None:
                a, n = state.excursion_since - self.window_s, 1
                if state.left_out and state.left_out[-1][1] >= a:     # overlapping the last: merged
                    a, _, before = state.left_out.pop()
                    n += before
                state.left_out.append((a, now, n))
                state.excursion_since = None
        lo = now - self.window_s - self.baseline_s
        state.left_out = [(a, z, n) for a, z, n in state.left_out if z > lo]
        if sum(n for _, _, n in state.left_out) >= 2 and \
                sum(min(z, now - self.window_s) - max(a, lo) for a, z, _ in state.left_out) >= self.baseline_s / 2:
            # excursions that come and go over half its window: that is how the process runs now
            state.left_out, state.baseline, state.baseline_at = [], None, float("-inf")
            afresh = "taken afresh: excursions covered half the baseline window (a new normal)"
        if state.excursion_since is not None:
            state.baseline_why = f"frozen: the statistic is over half the way to the limit (since {now - state.excursion_since:.0f} s)"
            return
        if state.pending_since is not None or state.fired_at is not None or now - state.baseline_at < self.baseline_every_s:
            return
        state.baseline_at = now
        lo = max(now - self.window_s - self.baseline_s, state.baseline_from)
        chunks, span = s.chunks(lo, now - self.window_s, self.window_s, [(a, z) for a, z, _ in state.left_out])
        samples = sum(len(c) for c in chunks)
        # a process's first baseline spans the whole window (a young process's load is not yet
        # its normal); one taken again after an incident, a quarter of it
        need = self.baseline_s if state.baseline_from == float("-inf") else self.baseline_s / 4
        if samples >= MIN_BASELINE_SAMPLES and span >= need - BIN_S:     # (bins begin on whole seconds)
            # the median of the statistic over each window's length of it: a window's typical
            # statistic, as the condition's is a window's (a p99 over a whole baseline would be
            # its few highest samples: a flap, a ramp's newest)
            state.baseline = float(np.median([np.percentile(c, trigger.percentile) for c in chunks]))
            state.baseline_until, state.baseline_lo = now - self.window_s, lo
            state.baseline_why = f"{samples} samples over {span:.0f} s" + (f" ({afresh})" if afresh else "")
        elif state.baseline is None:
            seen = 0.0 if state.first_seen is None else now - state.first_seen
            state.baseline_why = (f"young: samples over {min(span, seen):.0f} s of the {need:.0f} s needed "
                                  f"(and the {self.window_s:g} s window after them)" if span < need - BIN_S
                                  else f"too few samples ({samples} of {MIN_BASELINE_SAMPLES})")
        else:       # the one before (an incident, excursions) holds until a new one is whole
            state.baseline_why = (f"held from {now - state.baseline_until:.0f} s ago: {samples} samples "
                                  f"over {span:.0f} s outside incidents and excursions since")
