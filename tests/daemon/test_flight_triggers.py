"""The flight recorder's triggers against injected series, the adversarial cases first: a
lone outlier, a slowdown as long as the hold, a low request rate, a flap shorter than the
hold, a slow ramp, a process too young for a baseline; and the counts a short incident
keeps. The share of samples beyond a limit that resolves a percentile is checked against
scipy's exact binomial test (scipy.stats.binomtest), not against the trigger's own code."""
from __future__ import annotations

import threading

import pytest
from scipy.stats import binomtest

from profinfer.core.profile.model import TokenCall
from profinfer.daemon.flight.triggers import CONFIDENCE, Triggers, parse_trigger
from profinfer.daemon.discovery.identity import Identity
from profinfer.daemon.flight.recorder import FlightRecorder

KEY = (1, 1)


def _judged(trigger: str, baseline_s: float = 60.0, window_s: float = 10.0):
    fired = []
    tr = Triggers([parse_trigger(trigger)], lambda key, f: fired.append(f), cooldown_s=60.0,
                  baseline_s=baseline_s, window_s=window_s)
    return tr, fired


def _feed(tr: Triggers, quantity: str, lo: float, hi: float, per_s: int, value) -> None:
    """From `lo` to `hi` s, `per_s` samples a second (one each 1/per_s s; `value(t)` or a
    number), judged at each."""
    n = round((hi - lo) * per_s)
    for i in range(n):
        now = lo + i / per_s
        tr.observe(KEY, quantity, now, [value(now) if callable(value) else value])
        tr.judge(now)


def _low(beyond: int, n: int) -> float:
    """The one-sided lower bound at CONFIDENCE on a share, from scipy's exact binomial test."""
    return binomtest(beyond, n).proportion_ci(confidence_level=1 - 2 * (1 - CONFIDENCE), method="exact").low


def test_a_lone_outlier_does_not_fire_a_five_second_hold():
    """Eight 10 ms tokens a second, one of 200 ms: a 10 s window's p99 of its 80 samples is
    50 ms, past 3x the baseline for the whole 10 s the outlier is in it, which fired the
    trigger 5 s later. One sample of 80 beyond the limit does not resolve a p99 (its share,
    at 99%, is not past 1%); the trigger stays armed, and fires at a real slowdown after."""
    tr, fired = _judged("tpot_p99 > 3x baseline for 5s")
    _feed(tr, "tpot", 0, 80, 8, 0.010)
    assert tr.state_dicts(KEY, 80)[0]["baseline"] == pytest.approx(0.010)
    tr.observe(KEY, "tpot", 80.05, [0.200])
    state = tr.state_dicts(KEY, 80.05)[0]
    _feed(tr, "tpot", 80.1, 100, 8, 0.010)
    assert _low(1, 80) < 0.01 and fired == [], fired
    # a slowdown of 6 s: every token 40 ms; the condition holds at its fourth token (four of
    # 80: _low(4, 80) is past 1%, three not), 100.375 s, judged each 0.5 s, and fires 5 s on,
    # its hold's tokens all beyond
    assert _low(3, 80) < 0.01 < _low(4, 80)
    _feed(tr, "tpot", 100, 106, 8, 0.040)
    assert len(fired) == 1, state
    f = fired[0]
    assert 105.375 <= f.at <= 105.875 and f.hold_samples >= 36 and f.value > f.limit == pytest.approx(0.030)


@pytest.mark.parametrize("per_s", [2, 8, 10, 50])
def test_a_slowdown_shorter_than_the_hold_does_not_fire(per_s):
    """A 1.5 s slowdown, then normal again: the window's p99 stays past the limit while its
    slow samples are in it (10 s), and they are past 1% of the hold's; but the hold's later
    slices are normal: it never holds 5 s. A 5 s one does."""
    tr, fired = _judged("tpot_p99 > 3x baseline for 5s")
    _feed(tr, "tpot", 0, 80, per_s, 0.010)
    _feed(tr, "tpot", 80, 81.5, per_s, 0.050)
    _feed(tr, "tpot", 81.5, 100, per_s, 0.010)
    assert fired == []
    _feed(tr, "tpot", 100, 107, per_s, 0.050)
    # held from the judgment at which its slow samples resolve the window (the third of 21
    # at two a second, a second in), for 5 s
    assert len(fired) == 1 and 105 <= fired[0].at <= 106


@pytest.mark.parametrize("seed", range(20))
def test_a_preempted_servers_slowdown_fires_within_its_hold(seed):
    """A server whose CPUs competitors take: its tokens, 20 a second, are each slow (100 ms
    against 10) by chance, a quarter of them (a time slice lost, or not), as the real slowdown
    test's were. The hold's samples resolve the condition in its halves, and it fires within
    half a second (a judgment) of its hold's end; split in five, a fifth of the hold's samples
    often held one slow token or none, and it fired seconds late (a real test, once in five)."""
    import random
    rng = random.Random(seed)
    tr, fired = _judged("tpot_p99 > 1.8x baseline for 3s", baseline_s=8.0, window_s=4.0)
    _feed(tr, "tpot", 0, 20, 20, 0.010)
    _feed(tr, "tpot", 20, 30, 20, lambda t: 0.100 if rng.random() < 0.25 else 0.010)
    assert len(fired) == 1 and fired[0].at - fired[0].began <= 3 + 0.5, [(f.began, f.at) for f in fired]


def test_a_ttft_trigger_fires_at_half_a_request_a_second():
    """`ttft_p99 > 2s` with a first token every 2 s (six a 10 s window, both ends in it,
    where twenty were needed before): 300 ms ones for a minute, then 3 s ones. It fires at
    the second slow one, two of six past 2 s resolving a p99 (and one of six not)."""
    tr, fired = _judged("ttft_p99 > 2s")
    _feed(tr, "ttft", 0, 60, 0.5, 0.3)
    assert fired == []
    assert _low(1, 6) < 0.01 < _low(2, 6)
    _feed(tr, "ttft", 60, 70, 0.5, 3.0)
    assert len(fired) == 1 and fired[0].at == 62.0, fired
    assert fired[0].window_samples == 6


def test_a_sparse_median_widens_its_window_and_status_says_so():
    """`ttft_p50 > 2s` at a request each 2 s: five samples in 10 s cannot resolve a median at
    99% even all beyond (0.398); seven can (0.518): the window widens to hold them, and the
    status says over how long."""
    assert _low(5, 5) < 0.5 < _low(7, 7)
    tr, fired = _judged("ttft_p50 > 2s")
    _feed(tr, "ttft", 0, 30, 0.5, 3.0)
    state = tr.state_dicts(KEY, 30)[0]
    assert state["window_samples"] >= 7 and state["window_s"] >= 12, state
    assert len(fired) == 1 and fired[0].window_s >= 12


def test_a_flap_shorter_than_the_hold_stays_out_of_the_baseline():
    """Ten tokens a second of 10 ms; a 2 s flap of 50 ms, past 3x for the 12 s it is in the
    window, shorter than the 30 s hold: no firing. Its samples would have made a p99 over the
    baseline's whole window 50 ms (2 s of 60 is past 1%), and a later slowdown to 40 ms (4x)
    would not fire: the baseline (a typical window's p99, its excursion left out) stays
    10 ms, and it fires."""
    tr, fired = _judged("tpot_p99 > 3x baseline for 30s")
    _feed(tr, "tpot", 0, 80, 10, 0.010)
    _feed(tr, "tpot", 80, 82, 10, 0.050)
    _feed(tr, "tpot", 82, 120, 10, 0.010)
    assert fired == []
    assert tr.state_dicts(KEY, 120)[0]["baseline"] == pytest.approx(0.010)
    _feed(tr, "tpot", 120, 160, 10, 0.040)
    assert len(fired) == 1 and fired[0].baseline == pytest.approx(0.010)


def test_an_excursion_under_the_limit_stays_out_of_the_baseline():
    """35 s at 25 ms (2.5x: past half the way to 3x, under it): no firing, and most of the
    baseline's windows would have been the excursion's, its median 25 ms, a later 40 ms
    slowdown under 3x of it. Left out, the baseline stays 10 ms and the slowdown fires."""
    tr, fired = _judged("tpot_p99 > 3x baseline for 5s")
    _feed(tr, "tpot", 0, 80, 10, 0.010)
    _feed(tr, "tpot", 80, 115, 10, 0.025)
    _feed(tr, "tpot", 115, 125, 10, 0.010)
    assert fired == [] and tr.state_dicts(KEY, 125)[0]["baseline"] == pytest.approx(0.010)
    _feed(tr, "tpot", 125, 135, 10, 0.040)
    assert len(fired) == 1 and fired[0].baseline == pytest.approx(0.010)


def test_excursions_that_cover_half_the_baseline_window_are_the_new_normal():
    """22 ms (past half the way to 3x) for 15 s of every 30 s: each excursion is shorter than
    the baseline window, but together they are how the process runs now. The baseline is taken
    afresh with them in it (status says so), not held at the old 10 ms forever."""
    tr, fired = _judged("tpot_p99 > 3x baseline for 5s")
    _feed(tr, "tpot", 0, 80, 10, 0.010)
    for k in range(8):
        _feed(tr, "tpot", 80 + 30 * k, 95 + 30 * k, 10, 0.022)
        _feed(tr, "tpot", 95 + 30 * k, 110 + 30 * k, 10, 0.010)
    said = tr.states[KEY][0].baseline_why
    state = tr.state_dicts(KEY, 320)[0]
    assert fired == [] and state["baseline"] > 0.015, (state, said)


@pytest.mark.parametrize("case", ["one long excursion", "excursions over half the window"])
def test_a_new_normal_leaves_the_trigger_armed_at_every_judgment(case):
    """Decode throughput down to 0.7x (past half the way to 0.5x, not under it) for longer
    than the baseline window, or for 15 s of every 30: the new normal. Its baseline is taken
    at once from the excursion's samples, so the trigger judges a limit at every judgment
    from its first baseline on (the soak tier's steady server found it unarmed at 2 of 23
    polls: the baseline was left unset until its next recompute)."""
    tr, fired = _judged("tps_p50 < 0.5x baseline for 5s")
    unarmed, said = [], set()

    def fed(lo, hi, value):
        for i in range(round((hi - lo) * 10)):
            now = lo + i / 10
            tr.observe(KEY, "tps", now, [value])
            tr.judge(now)
            said.add(tr.states[KEY][0].baseline_why)
            if now >= 75 and tr.states[KEY][0].limit is None:
                unarmed.append((round(now, 1), tr.states[KEY][0].baseline_why))
    fed(0, 80, 1000.0)
    if case == "one long excursion":
        fed(80, 200, 700.0)
    else:
        for k in range(8):
            fed(80 + 30 * k, 95 + 30 * k, 700.0)
            fed(95 + 30 * k, 110 + 30 * k, 1000.0)
    state = tr.states[KEY][0]
    assert fired == [] and unarmed == [], unarmed[:5]
    assert any("new normal" in why for why in said), said
    if case == "one long excursion":
        assert state.baseline == pytest.approx(700.0)


def test_a_slow_ramp_fires_against_the_baseline_from_before_it():
    """From 10 ms to 50 ms over 100 s: a baseline taken as the ramp went would follow it 10 s
    behind and the limit (3x) would never be reached. Frozen from the excursion past half the
    way (2x), it fires once past 3x of the baseline before the ramp."""
    tr, fired = _judged("tpot_p99 > 3x baseline for 5s")
    _feed(tr, "tpot", 0, 80, 10, 0.010)
    _feed(tr, "tpot", 80, 180, 10, lambda t: 0.010 + 0.040 * (t - 80) / 100)
    assert len(fired) == 1, tr.state_dicts(KEY, 180)
    f = fired[0]
    assert f.baseline == pytest.approx(0.010, rel=0.05) and f.value > 0.030
    # past 3x at 30 ms: 50 s into the ramp, plus the hold
    assert 80 + 50 + 5 <= f.at <= 80 + 50 + 5 + 2


def test_a_window_too_sparse_even_widened_says_so():
    """`ttft_p50 > 2s` at a request each 12 s: six windows hold five or six, seven are needed
    to resolve a median: it cannot fire, and the status says why rather than look armed."""
    tr, fired = _judged("ttft_p50 > 2s")
    _feed(tr, "ttft", 0, 120, 1 / 12, 3.0)
    state = tr.state_dicts(KEY, 120)[0]
    assert fired == [] and state["window_state"].startswith("too sparse") and "7 needed" in state["window_state"], state


def test_a_young_process_has_no_baseline_and_status_says_so():
    """A process whose samples span less than the baseline window (60 s) has no baseline:
    a process that starts under load does not take that load as its normal. The status says
    it is young; once its samples span the window, the baseline is taken."""
    tr, fired = _judged("tpot_p99 > 3x baseline for 5s")
    _feed(tr, "tpot", 0, 30, 10, 0.050)
    state = tr.state_dicts(KEY, 30)[0]
    assert state["baseline"] is None and state["baseline_state"].startswith("young"), state
    _feed(tr, "tpot", 30, 75, 10, 0.050)
    state = tr.state_dicts(KEY, 75)[0]
    assert state["baseline"] == pytest.approx(0.050) and fired == [], state


class _Metrics:
    """A process's cumulative op counts: 100 MUL_MATs a second, 1 ms each, 4 ms from
    `slow_from` until `slow_until`."""

    def __init__(self, clock):
        self.clock, self.slow_from, self.slow_until = clock, float("inf"), float("inf")

    def totals(self, ident):
        return self.at(self.clock.now)

    def at(self, t: float) -> dict:
        slow = max(0.0, min(t, self.slow_until) - self.slow_from)
        fast = t - slow
        return {"op": {"MUL_MAT": (int(100 * t), 100 * fast * 1e-3 + 100 * slow * 4e-3)}}


class _Clock:
    now = 0.0

    def monotonic(self) -> float:
        return self.now


@pytest.mark.parametrize("trigger,slow_s", [("tpot_p99 > 20ms for 1s", 1.5), ("tpot_p99 > 20ms", 0.5)])
def test_a_short_incident_keeps_its_counts(monkeypatch, trigger, slow_s):
    """A slowdown of 1.5 s under `for 1s` (and of 0.5 s with no hold): the capture's record
    keeps the incident's counts, from the sample at or before the condition began to the
    firing (whose sample had been dropped within a second of the last, and the record said
    'not counted long enough'), exactly the process's counts over that stretch, with the
    slower MUL_MAT in them."""
    import profinfer.daemon.flight.recorder as recorder_module
    clock = _Clock()
    monkeypatch.setattr(recorder_module, "time", clock)
    ident = Identity(pid=KEY[0], start=KEY[1], comm="llama-server", exe="/x", engine="llama.cpp")
    metrics = _Metrics(clock)

    class Agent:
        lock = threading.Lock()
        watches = {KEY[0]: type("W", (), {"identity": ident, "levels": {"op", "token"}})()}

        def __init__(self):
            self.metrics, self.logged = metrics, []

        def log(self, line):
            self.logged.append(line)

    made = []
    rec = FlightRecorder(Agent(), type("C", (), {"running": set()})(), None, [parse_trigger(trigger)],
                         1.0, set(), 60.0, 60.0, 10.0)
    rec._capture = lambda w, firing, counts: made.append((firing, counts))
    monkeypatch.setattr(recorder_module.threading, "Thread",
                        lambda target, args, **kw: type("T", (), {"start": lambda self: target(*args)})())
    call = TokenCall(tid=1, start_ns=0, end_ns=10_000_000, n_tokens=1, prefill=False, decode_tokens=1)
    for i in range(int(30 * 10 + slow_s * 10 + 30)):          # the slowdown, then 3 s as before
        clock.now = i / 10
        slow = 30 <= clock.now < 30 + slow_s
        if slow and metrics.slow_from == float("inf"):
            metrics.slow_from = 30.0
        if not slow and clock.now >= 30:
            metrics.slow_until = min(metrics.slow_until, clock.now)
        rec.observe(ident, call, [], [(0.040e9 if slow else 0.010e9, 1)])
        rec.judge()
    assert len(made) == 1, made
    firing, counts = made[0]
    incident = counts["incident"]
    assert incident is not None and incident["until_monotonic_s"] == firing.at, counts
    # from the sample at or before the condition's start (one each 5 s, a second or more
    # before the firing), and exact for the stretch it states
    lo, hi = incident["from_monotonic_s"], incident["until_monotonic_s"]
    assert lo <= firing.began and (lo >= firing.began - 5 if slow_s > 1 else hi - lo >= 1), incident
    (n0, s0), (n1, s1) = (metrics.at(t)["op"]["MUL_MAT"] for t in (lo, hi))
    got = incident["families"]["op"]["MUL_MAT"]["s_per_call"]
    assert got == pytest.approx((s1 - s0) / (n1 - n0)) and got > 1.2e-3, incident


def test_a_firing_whose_capture_could_not_start_fires_again_while_it_holds():
    """A firing whose capture was refused (both places taken: another process's incident) is
    re-armed: with the slowdown still on, the trigger fires again a hold later, not never."""
    tr, fired = _judged("tpot_p99 > 3x baseline for 5s")
    _feed(tr, "tpot", 0, 80, 10, 0.010)
    _feed(tr, "tpot", 80, 86, 10, 0.050)
    assert len(fired) == 1
    tr.rearm(KEY, tr.triggers[0])
    _feed(tr, "tpot", 86, 93, 10, 0.050)
    assert len(fired) == 2 and fired[1].at >= fired[0].at + 5, [f.at for f in fired]


def test_firings_refused_for_want_of_a_place_are_said_once_and_counted(monkeypatch):
    """A slowdown held for 20 s under `for 1s` while every capture place is taken (429): the
    trigger fires again each time its condition has held anew, each refusal counted in
    /status's `deferred`, none a failure, and the log says it once, not once a firing."""
    import profinfer.daemon.flight.recorder as recorder_module
    from profinfer.daemon.flight.captures import BadRequest
    clock = _Clock()
    clock.time = clock.monotonic
    monkeypatch.setattr(recorder_module, "time", clock)
    ident = Identity(pid=KEY[0], start=KEY[1], comm="llama-server", exe="/x", engine="llama.cpp")

    class Agent:
        lock = threading.Lock()
        watches = {KEY[0]: type("W", (), {"identity": ident, "levels": {"token"}})()}
        seen = type("S", (), {"tenants": type("T", (), {"tenant": staticmethod(lambda key: "pod a")})()})()

        def __init__(self):
            self.metrics, self.logged = _Metrics(clock), []

        def log(self, line):
            self.logged.append(line)

    class Full:
        running: set = set()

        def run(self, *args):
            raise BadRequest(429, "2 captures are running; try again later")

    agent = Agent()
    rec = FlightRecorder(agent, Full(), None, [parse_trigger("tpot_p99 > 20ms for 1s")], 1.0, set(), 60.0, 60.0, 10.0)
    rec._affordable = lambda w, asked: (asked, {}, 0.0)
    monkeypatch.setattr(recorder_module.threading, "Thread",
                        lambda target, args, **kw: type("T", (), {"start": lambda self: target(*args)})())
    call = TokenCall(tid=1, start_ns=0, end_ns=10_000_000, n_tokens=1, prefill=False, decode_tokens=1)
    for i in range(int(50 * 10)):
        clock.now = i / 10
        rec.observe(ident, call, [], [(0.040e9 if clock.now >= 30 else 0.010e9, 1)])
        rec.judge()
    said = [line for line in agent.logged if "could not start yet" in line]
    fired = [line for line in agent.logged if " fired (" in line]
    assert rec.deferred >= 5 and rec.failed == 0, (rec.deferred, agent.logged)
    assert len(said) == 1 and len(fired) == 1, agent.logged
