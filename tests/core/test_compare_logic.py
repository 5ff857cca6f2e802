"""core.compare's rules on samples whose truth is known by construction (drawn here), and
diff's gate parsing: the statistics behind `profinfer diff`."""
from __future__ import annotations

import numpy as np
import pytest

from profinfer.core.diff import compare
from profinfer.core.diff.compare import Series
from profinfer.core.base.errors import ProfinferError
from profinfer.exporters.comparison import FAIL, INCONCLUSIVE, PASS, Gate, gate_verdict, parse_gate, runs_to_resolve


def _series(samples, name="decode MUL_MAT", section="op", unit="ns per decode token") -> Series:
    return Series(section, name, unit, np.asarray(samples, np.float64))


def _draw(mean: float, n: int = 200, seed: int = 0, sd: float = 0.05) -> np.ndarray:
    return np.random.default_rng(seed).normal(mean, sd * mean, n)


def test_twice_the_time_is_slower_with_an_interval_around_it():
    c = compare.judge(_series(_draw(1000)), _series(_draw(2000, seed=1)), noise=0.05)
    assert c.verdict == compare.SLOWER and c.low < 1.0 < c.high and c.statistic == "median"


def test_the_same_distribution_is_no_change():
    c = compare.judge(_series(_draw(1000)), _series(_draw(1000, seed=1)), noise=0.05)
    assert c.verdict in (compare.NO_CHANGE, compare.WITHIN_NOISE) and not c.significant


def test_a_small_sure_change_is_within_the_noise_floor():
    c = compare.judge(_series(_draw(1000, sd=0.001)), _series(_draw(1020, seed=1, sd=0.001)), noise=0.05)
    assert c.low > 0 and c.verdict == compare.WITHIN_NOISE


def test_a_run_that_drifts_raises_its_own_floor():
    drifting = np.concatenate([_draw(1000, 50), _draw(1500, 50, seed=2)])
    c = compare.judge(_series(drifting), _series(_draw(1300, 100, seed=3)), noise=0.05)
    assert c.floor > 0.3 and not c.significant


def test_too_few_samples_are_shown_not_judged():
    c = compare.judge(_series([1.0, 2.0]), _series([3.0, 4.0]), noise=0.05)
    assert c.verdict == compare.FEW_SAMPLES and c.change == pytest.approx(3.5 / 1.5 - 1)


def test_a_quantity_of_one_side_only():
    changes = compare.compare([_series(_draw(1000), "decode RMS_NORM")], [_series(_draw(1000), "decode FUSED")], 0.05)
    assert [(c.name, c.verdict) for c in changes] == [("decode RMS_NORM", compare.ONLY_BEFORE),
                                                      ("decode FUSED", compare.ONLY_AFTER)]


def test_a_mostly_absent_op_is_compared_by_its_mean():
    sparse = np.zeros(100)
    sparse[::10] = 1000.0
    c = compare.judge(_series(sparse), _series(sparse * 3), noise=0.05)
    assert c.statistic == "mean" and c.change == pytest.approx(2.0)


def test_runs_offset_from_each_other_widen_the_interval():
    """Five runs a side whose whole-run offsets (±30%) dwarf their calls' spread: one run a
    side would call a 20% difference sure, pooled runs do not."""
    rng = np.random.default_rng(7)
    offsets = rng.uniform(0.7, 1.3, 10)
    runs = [[_series(_draw(1000 * o, 50, seed=i, sd=0.02))] for i, o in enumerate(offsets)]
    single = compare.judge(runs[0][0], runs[5][0], noise=0.05)
    pooled = compare.compare(compare.pool(runs[:5]), compare.pool(runs[5:]), noise=0.05)[0]
    assert single.high - single.low < 0.1
    assert pooled.high - pooled.low > 0.2 and not pooled.significant


def test_a_part_that_barely_moves_its_whole_is_within_noise():
    """An op of 1% of a token's time, 50% slower: the token moves by 0.5%."""
    whole_b, whole_a = _series(_draw(1000, sd=0.001), "decode time per token", "latency"), \
        _series(_draw(1005, seed=1, sd=0.001), "decode time per token", "latency")
    part_b, part_a = _series(_draw(10, sd=0.001), "decode ROPE"), _series(_draw(15, seed=1, sd=0.001), "decode ROPE")
    changes = {c.name: c for c in compare.compare([whole_b, part_b], [whole_a, part_a], 0.05)}
    assert changes["decode ROPE"].low > 0.4 and changes["decode ROPE"].verdict == compare.WITHIN_NOISE


def _run(speed: float, parts: dict[str, float], seed: int) -> list[Series]:
    """One run: a token's time and its finest parts, every part `speed` times its time."""
    out = [_series(_draw(speed * sum(parts.values()), seed=seed, sd=0.01), "decode time per token", "latency")]
    for i, (name, ns) in enumerate(parts.items()):
        out.append(Series("node", f"decode {name}", "ns per decode token",
                          _draw(speed * ns, seed=seed * 100 + i, sd=0.01), finest=True))
    return out


PARTS = {"MUL_MAT Qcur": 100, "MUL_MAT Kcur": 50, "MUL_MAT ffn_up": 300, "MUL_MAT ffn_out": 300, "RMS_NORM norm": 40,
         "ROPE Qcur": 30, "GET_ROWS inp": 1}


def test_one_run_a_side_a_whole_run_slower_is_not_a_change():
    """A process 60% slower in every part (a shared machine's run-to-run swing): one run a
    side, nothing is significant, and the common change says how much the run moved."""
    changes = compare.compare(_run(1.0, PARTS, 1), _run(1.6, PARTS, 2), 0.05)
    assert not [c for c in changes if c.significant]
    assert all(abs(c.common - 0.6) < 0.02 for c in changes), changes
    pooled = compare.compare(compare.pool([_run(1.0, PARTS, 1), _run(1.02, PARTS, 3)]),
                             compare.pool([_run(1.6, PARTS, 2), _run(1.62, PARTS, 4)]), 0.05)
    assert all(c.common is None for c in pooled) and pooled[0].verdict == compare.SLOWER


def test_one_run_a_side_parts_that_change_beyond_the_rest_are_flagged():
    """The FFN twice as slow in a run 30% faster overall: the FFN is slower, the rest (30%
    faster, as the whole run) is not flagged."""
    wide = dict(PARTS, **{"MUL_MAT ffn_up": 600, "MUL_MAT ffn_out": 600})
    changes = {c.name: c for c in compare.compare(_run(1.0, PARTS, 1), _run(0.7, wide, 2), 0.05)}
    assert abs(changes["decode MUL_MAT Qcur"].common + 0.3) < 0.02
    assert changes["decode MUL_MAT ffn_up"].verdict == compare.SLOWER
    assert changes["decode time per token"].verdict == compare.SLOWER
    assert not changes["decode MUL_MAT Qcur"].significant and not changes["decode ROPE Qcur"].significant


def test_one_run_a_side_a_part_must_move_its_whole_by_the_floor():
    """An op of 6% of a token's time, 50% slower (the token 3% slower): with several runs a
    side, slower; with one run a side (no common change here: two finest parts only), within
    noise, since one op's time swings that much between runs on its own."""
    parts = {"MUL_MAT Qcur": 500, "MUL_MAT ffn_up": 440}

    def run(rope: float, seed: int) -> list[Series]:
        out = _run(1.0, parts, seed)
        whole = out[0]
        return [Series(whole.section, whole.name, whole.unit, whole.samples + rope), *out[1:],
                _series(_draw(rope, seed=seed + 50, sd=0.01), "decode ROPE")]

    one = {c.name: c for c in compare.compare(run(60, 1), run(90, 2), 0.05)}
    assert one["decode ROPE"].common is None and one["decode ROPE"].low > 0.4
    assert one["decode ROPE"].verdict == compare.WITHIN_NOISE
    pooled = {c.name: c for c in compare.compare(compare.pool([run(60, 1), run(60, 3)]),
                                                 compare.pool([run(90, 2), run(90, 4)]), 0.05)}
    assert pooled["decode ROPE"].verdict == compare.SLOWER


def test_one_run_a_side_how_threads_shared_the_work_is_not_judged():
    """A thread's barrier waits twice as long, 20% of the token: with several runs a side,
    slower; with one run a side, within noise (one CPU slower than the other for a whole run
    does that)."""
    def run(wait: float, seed: int) -> list[Series]:
        out = _run(1.0, PARTS, seed)
        return [Series(out[0].section, out[0].name, out[0].unit, out[0].samples + wait), *out[1:],
                Series("thread", "decode thread 1 barrier wait", "ns per decode token",
                       _draw(wait, seed=seed + 50, sd=0.01), sharing=True)]

    one = {c.name: c for c in compare.compare(run(200, 1), run(400, 2), 0.05)}
    assert one["decode thread 1 barrier wait"].low > 0.9
    assert one["decode thread 1 barrier wait"].verdict == compare.WITHIN_NOISE
    pooled = {c.name: c for c in compare.compare(compare.pool([run(200, 1), run(200, 3)]),
                                                 compare.pool([run(400, 2), run(400, 4)]), 0.05)}
    assert pooled["decode thread 1 barrier wait"].verdict == compare.SLOWER


def test_the_common_change_leaves_out_small_parts():
    """Four parts of 0.5% of the token each, three times slower (1.5%), and three big ones unchanged:
    the common change is the big parts' (the small ones, most of the parts, swing on their
    own between runs)."""
    big = {"MUL_MAT Qcur": 400, "MUL_MAT ffn_up": 300, "MUL_MAT ffn_out": 300}
    small = {f"ADD n{i}": 5 for i in range(4)}
    changes = compare.compare(_run(1.0, {**big, **small}, 1),
                              _run(1.0, {**big, **{k: 3 * v for k, v in small.items()}}, 2), 0.05)
    assert abs(changes[0].common) < 0.02, changes[0]


def test_gates():
    assert parse_gate("5%") == Gate(0.05) and parse_gate("MUL_MAT=10%") == Gate(0.10, "MUL_MAT")
    for bad in ("lots", "=5%", "-5%", "nan%", "5", "0.05", "MUL_MAT=5"):    # a bare number: refused
        with pytest.raises(ProfinferError):
            parse_gate(bad)
    slower = compare.Change("op", "decode MUL_MAT", "ns per decode token", "median", 1.0, 2.0, 100, 100,
                            100, 100, 1.0, 0.9, 1.1, 0.05, compare.SLOWER)
    assert Gate(0.05).judge(slower, 1)["verdict"] == Gate(0.05, "MUL_MAT").judge(slower, 1)["verdict"] == FAIL
    assert Gate(0.05, "ROPE").judge(slower, 1) is None
    assert Gate(1.5, "MUL_MAT").judge(slower, 1)["verdict"] == PASS            # +90..+110%: wholly below
    assert Gate(1.0, "MUL_MAT").judge(slower, 1)["verdict"] == INCONCLUSIVE    # spans +100%
    assert Gate(0.05, "decode").matches(compare.Change(**{**slower.__dict__, "section": "latency",
                                                          "name": "decode time per token"}))


def _gated(before: list[Series], after: list[Series], gate: Gate = Gate(0.05), runs: int = 1) -> tuple[str, list[dict]]:
    rows = [r for c in compare.compare(before, after, 0.05) if (r := gate.judge(c, runs)) is not None]
    return gate_verdict(rows, (gate,)), rows


def test_one_run_a_side_a_broad_regression_is_never_a_pass():
    """Every part 30% slower (all the matmuls and the rest: a slower build, or a process that
    ran slower, which one run a side cannot tell apart): the gate does not pass it. Its time
    per token is inconclusive, asking for runs a side; pooled over three runs a side, where
    run-to-run noise is measured, it fails."""
    verdict, rows = _gated(_run(1.0, PARTS, 1), _run(1.3, PARTS, 2))
    token = next(r for r in rows if r["name"] == "decode time per token")
    assert verdict == INCONCLUSIVE and token["verdict"] == INCONCLUSIVE and token["runs_needed"] == 3, token
    assert abs(token["common"] - 0.3) < 0.02 and "common change" in token["why"]
    pooled = _gated(compare.pool([_run(1.0, PARTS, s) for s in (1, 3, 5)]),
                    compare.pool([_run(1.3, PARTS, s) for s in (2, 4, 6)]), runs=3)
    assert pooled[0] == FAIL, pooled[1]


def test_the_gate_passes_only_an_interval_wholly_below_its_limit():
    """No change: pass. A 2% change with a tight interval under a 5% gate: pass. A change of
    about the limit with an interval across it: inconclusive, with the runs a side that
    would likely tell. A change whose interval lies wholly above: fail."""
    assert _gated(_run(1.0, PARTS, 1), _run(1.0, PARTS, 2))[0] == PASS
    token = lambda x: [_series(x, "decode time per token", "latency")]   # noqa: E731
    assert _gated(token(_draw(100, sd=0.01)), token(_draw(102, seed=1, sd=0.01)))[0] == PASS
    verdict, rows = _gated(token(_draw(100, n=40, sd=0.2)), token(_draw(106, n=40, seed=1, sd=0.2)))
    assert verdict == INCONCLUSIVE and rows[0]["low"] < 0.05 < rows[0]["high"], rows
    assert rows[0]["runs_needed"] is None or rows[0]["runs_needed"] > 1, rows
    assert _gated(token(_draw(100, sd=0.01)), token(_draw(130, seed=1, sd=0.01)))[0] == FAIL


def test_runs_to_resolve_narrow_the_interval_as_one_over_sqrt_runs():
    c = compare.Change("latency", "decode time per token", "ns", "median", 1.0, 1.1, 100, 100, 100, 100,
                       0.10, 0.0, 0.20, 0.05, compare.UNCERTAIN)
    # half-width 10%, 5% from the limit: (10/5)^2 = 4 times the runs
    assert runs_to_resolve(c, 0.05, 1) == 4 and runs_to_resolve(c, 0.05, 2) == 8
    assert runs_to_resolve(c, 0.10, 1) is None          # on the limit: no number of runs tells
    assert runs_to_resolve(c, 0.099, 1) is None         # more than 30


def _op(samples) -> compare.Series:
    return compare.Series("op", "decode MUL_MAT", "ns per decode token", np.asarray(samples, np.float64))


def test_over_many_samples_the_interval_is_the_medians():
    """4096 samples a side, a fifth of the before side's 3 times slower (stalls), the rest's
    median 9.8% slower after: the median is the statistic shown, and its interval covers its
    true change (a bootstrap of group means had called it 26% faster, its interval far from it)."""
    rng = np.random.default_rng(7)
    n = 4096
    before = rng.normal(100.0, 3.0, n)
    before[rng.random(n) < 0.2] *= 3
    after = rng.normal(109.8, 3.0, n)
    c = compare.judge(_op(before), _op(after), 0.05)
    true = np.median(after) / np.median(before) - 1
    assert c.statistic == "median" and c.change == pytest.approx(true)
    assert c.low <= true <= c.high and c.high - c.low < 0.05, c
    assert c.verdict == compare.SLOWER, c


def test_a_tail_added_after_moves_the_median_little():
    """The after side alone gains a tail (a tenth of its samples 3 times slower): its median
    moves a few percent, and the interval is around that move, not the tail's mean."""
    rng = np.random.default_rng(8)
    n = 4096
    before, after = rng.normal(100.0, 3.0, n), rng.normal(100.0, 3.0, n)
    after[rng.random(n) < 0.1] *= 3
    c = compare.judge(_op(before), _op(after), 0.05)
    true = np.median(after) / np.median(before) - 1
    assert c.low <= true <= c.high and c.high < 0.1, c


def test_a_decode_batch_that_differs_is_among_the_differences():
    """Time per token is per token: one run decoding a token a call against one decoding
    four a call (four concurrent requests) moves it with no change of code, so the batch is
    listed among what differs; runs of one batch list nothing."""
    from profinfer.core.profile.model import Profile, TokenCall
    from profinfer.exporters.comparison import _differences, _setup

    def run(batch: int) -> Profile:
        calls = [TokenCall(1, i * 1000, i * 1000 + 500, 8, True) if i == 0 else
                 TokenCall(1, i * 1000, i * 1000 + 500, batch, False, decode_tokens=batch) for i in range(20)]
        return Profile(pid=1, process_name="x", tokens=calls)

    assert _differences(_setup(run(1)), _setup(run(1))) == []
    assert _differences(_setup(run(1)), _setup(run(4))) == [
        {"fact": "decode tokens a call (median)", "before": "1", "after": "4"}]


def _spread(sd: float, runs: int = 8) -> dict:
    return {("latency", "decode time per token"): compare.Spread(sd, runs)}


def test_one_run_a_side_a_broad_regression_fails_beyond_the_calibrated_spread():
    """Every part 30% slower, one run a side: with this command's run-to-run spread measured
    here (sd 3% over 8 runs: two runs differ by chance within ±10%), the time per token lies
    beyond it and the limit: the gate fails where, unmeasured, it was inconclusive. With a
    spread as wide as the change (sd 12%), it is inconclusive again."""
    before, after = _run(1.0, PARTS, 1), _run(1.3, PARTS, 2)
    changes = compare.compare(before, after, 0.05, spreads=_spread(0.03))
    token = next(c for c in changes if c.name == "decode time per token")
    assert token.spread == 0.03 and token.common is None and token.verdict == compare.SLOWER, token
    assert token.low < 0.3 - 0.08 and token.high > 0.3 + 0.08, token       # widened by the spread
    rows = [r for c in changes if (r := Gate(0.05).judge(c, 1)) is not None]
    assert gate_verdict(rows, (Gate(0.05),)) == FAIL, rows
    wide = compare.compare(before, after, 0.05, spreads=_spread(0.12))
    rows = [r for c in wide if (r := Gate(0.05).judge(c, 1)) is not None]
    assert gate_verdict(rows, (Gate(0.05),)) == INCONCLUSIVE, rows


def test_one_run_a_side_no_change_is_no_failure_with_a_calibrated_spread():
    """The same command twice, one run a side, 8% apart by chance (within what sd 3% allows):
    not a failure; the interval covers no change; and the part rows still judged by the
    common change."""
    changes = compare.compare(_run(1.0, PARTS, 1), _run(1.08, PARTS, 2), 0.05, spreads=_spread(0.03))
    token = next(c for c in changes if c.name == "decode time per token")
    assert token.low < 0 < token.high and not token.significant, token
    rows = [r for c in changes if (r := Gate(0.05).judge(c, 1)) is not None]
    assert gate_verdict(rows, (Gate(0.05),)) == INCONCLUSIVE, rows
    assert all(c.common is not None for c in changes if c.section != "latency")


def test_the_spread_widens_by_students_t_over_its_runs():
    """Half-width: t(0.975, runs - 1) sqrt(2) sd, added to the interval's in quadrature on each
    side, in log."""
    half = compare.Spread(0.05, 6).half_width(0.95)
    assert half == pytest.approx(2.5706 * np.sqrt(2) * 0.05, rel=1e-3)
    low, high = compare.widen(0.10, 0.08, 0.12, half)
    c = np.log(1.10)
    assert np.log1p(low) == pytest.approx(c - np.hypot(c - np.log(1.08), half))
    assert np.log1p(high) == pytest.approx(c + np.hypot(np.log(1.12) - c, half))


def test_a_slowdown_growing_through_the_run_is_flagged():
    """One run a side: before steady at 1000 (±2%), after growing from 1000 to 2000 through
    the run. Its drift is a trend (its quarters rise one after another) and the before side
    is steady: the change is flagged slower, not left within a floor made of its own growth;
    the interval covers the true change of the medians. A run that swings up and down as
    much (a neighbour's bursts) still raises the floor."""
    n = 200
    rng = np.random.default_rng(3)
    before = 1000 * (1 + 0.02 * rng.standard_normal(n))
    growing = np.linspace(1000, 2000, n) * (1 + 0.02 * rng.standard_normal(n))
    c = compare.judge(_series(before), _series(growing), 0.05, one_run=True)
    true = np.median(growing) / np.median(before) - 1
    assert c.verdict == compare.SLOWER and c.floor == 0.05, c
    assert c.low <= true <= c.high, (true, c)
    swinging = 1000 * np.where((np.arange(n) // 50) % 2, 1.5, 1.0) * (1 + 0.02 * rng.standard_normal(n))
    s = compare.judge(_series(before), _series(swinging), 0.05, one_run=True)
    assert s.floor > 0.5 and not s.significant, s
    # steady noise is no trend: 2,000 noisy runs, none taken for one
    assert not any(compare.trend(1000 * (1 + 0.1 * rng.standard_normal(n))) for _ in range(2000))


def test_a_quantity_growing_with_its_place_in_both_runs_is_paired_place_by_place():
    """One run a side of one command: attention's time grows with the KV cache's length, from
    1000 to 1600 through the run, on both sides (±3% a unit). Its drift within each run is
    ~35%, which as a floor (twice that, one run a side) hid any change of it. Paired place by
    place the growth cancels: the same runs are no change, and the same growth 20% slower is
    flagged, its interval covering the true change. Runs that do not line up (other lengths),
    or where only one side grows, are judged as before."""
    n = 256
    growth = np.linspace(1000, 1600, n)
    rng = np.random.default_rng(11)

    def run(scale: float) -> np.ndarray:
        return growth * scale * (1 + 0.03 * rng.standard_normal(n))

    before = run(1.0)
    assert compare.drift(before) > 0.3           # what the floor held before pairing
    same = compare.judge(_series(before), _series(run(1.0)), 0.05, one_run=True)
    assert not same.significant and same.floor < 0.1, same
    slower = compare.judge(_series(before), _series(run(1.2)), 0.05, one_run=True)
    true = 0.2
    assert slower.verdict == compare.SLOWER and slower.low <= true <= slower.high, slower
    # not of one command (as many units is the sign): the place cannot be paired
    shorter = compare.judge(_series(before), _series(run(1.2)[: n - 10]), 0.05, one_run=True)
    assert shorter.floor > 0.6 and not shorter.significant, shorter
    # 150 pairs of runs of one command: no false alarm (a rate of 1 in 50 would show one
    # with 95% probability)
    alarms = sum(compare.judge(_series(run(1.0)), _series(run(1.0)), 0.05, one_run=True).significant
                 for _ in range(150))
    assert alarms == 0, alarms
