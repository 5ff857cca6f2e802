"""The flight recorder's pure logic: its trigger grammar, the rolling baseline's figures and
ranges, and the report's verdicts, on hand-computed numbers."""
from __future__ import annotations

import functools
import subprocess
from pathlib import Path

import pytest
from conftest import PROFINFER

from profinfer.core.base.errors import ProfinferError
from profinfer.daemon.flight.baseline import RollingTotals
from profinfer.daemon.flight.triggers import Triggers, parse_trigger
from profinfer.exporters.perfetto import with_meta
from profinfer.viewers.flight import changes, sparkline


def test_trigger_grammar():
    t = parse_trigger("tpot_p99 > 3x baseline for 5s")
    assert (t.quantity, t.stat, t.factor, t.limit, t.hold_s, t.below, t.unit) == ("tpot", "p99", 3.0, None, 5.0, False, "s")
    t = parse_trigger("ttft_p50 > 250ms")
    assert (t.limit, t.factor, t.hold_s) == (0.25, None, 0.0)
    t = parse_trigger("tps_p10 < 0.5x baseline for 2s")
    assert (t.quantity, t.percentile, t.factor, t.below, t.unit, t.reason) == ("tps", 10.0, 0.5, True, "tokens/s", "tps_p10")
    t = parse_trigger("batch_p50 > 12")
    assert (t.limit, t.unit) == (12.0, "tokens")
    assert parse_trigger("sync_p99 > 2ms").limit == pytest.approx(2e-3)
    assert parse_trigger("sync_p50 > 500ns").limit == pytest.approx(5e-7)
    assert parse_trigger("call_p99.5 > 1s").reason == "call_p99.5"
    # a tail of fewer than two samples of a full window (500) cannot be resolved: refused,
    # with the percentile that can
    for bad, most in (("call_p99.9 > 1s", "p99.6 or below"), ("tps_p0.2 < 0.5x baseline", "p0.4 or above")):
        with pytest.raises(ProfinferError, match=most):
            parse_trigger(bad)
    for bad in ("tpot > 3", "speed_p99 > 1s", "tpot_p99 >= 1s", "tpot_p99 > 3x", "", "tpot_p100 > 1s",
                "tps_p50 < 2x baseline", "tpot_p99 > 0.5x baseline", "batch_p50 > 12ms", "tps_p50 < 0",
                "tpot_p99 > " + "9" * 400 + "s", "tpot_p99 > 1s for " + "9" * 400 + "s"):
        with pytest.raises(ProfinferError):
            parse_trigger(bad)


def _feed(tr: Triggers, lo: int, hi: int, rate: float) -> None:
    """From second `lo` to `hi`, two tokens/s samples of `rate` a tenth of a second, judged
    as they come."""
    for tenth in range(lo * 10, hi * 10):
        now = tenth / 10
        tr.observe((1, 1), "tps", now, [rate, rate])
        tr.judge(now)


def test_a_rate_that_falls_fires_once_and_rearms():
    """`tps_p50 < 0.5x baseline for 2s`: 60 s of 100 tokens/s (20 samples a second), then 10 s
    at 30: it fires once, 2 s after the window's median falls under 50; back at 100, it re-arms
    once clear for its hold time and cooled down, and fires again at the next fall."""
    fired = []
    tr = Triggers([parse_trigger("tps_p50 < 0.5x baseline for 2s")], lambda key, f: fired.append(f),
                  cooldown_s=5.0, baseline_s=40.0)
    run = functools.partial(_feed, tr)
    run(0, 60, 100.0)
    assert fired == []
    run(60, 70, 30.0)
    assert len(fired) == 1
    f = fired[0]
    assert (f.baseline, f.limit, f.value) == (100.0, 50.0, 30.0)
    # the window's median is under 50 once more than half its samples are the new rate at
    # 99% confidence: 6 s in, 122 of its 202 (scipy's exact binomial test: 0.52 at least; at
    # 5.5 s, 112 of 192: 0.49), held 2 s
    assert 67.5 <= f.at <= 68.5 and f.as_dict()["below"] is True and f.as_dict()["unit"] == "tokens/s"
    run(70, 100, 100.0)
    assert len(fired) == 1
    run(100, 110, 30.0)
    assert len(fired) == 2 and fired[1].baseline == 100.0


@pytest.mark.parametrize("cooldown_s", [40.0, 60.0])
def test_a_rearm_as_the_cooldown_ends_keeps_the_baseline(cooldown_s):
    """A cooldown as long as the baseline's window (the steady-load test's 60 s each), or
    longer: a short slowdown that cleared re-arms the trigger as its cooldown ends, with the
    baseline from before it, armed at once (its limit stated) and firing at the next fall;
    only a condition that still holds once the baseline's window and the cooldown have passed
    is a new normal, its baseline taken afresh."""
    fired = []
    tr = Triggers([parse_trigger("tps_p50 < 0.5x baseline for 2s")], lambda key, f: fired.append(f),
                  cooldown_s=cooldown_s, baseline_s=40.0)
    run = functools.partial(_feed, tr)
    run(0, 60, 100.0)
    run(60, 70, 30.0)
    assert len(fired) == 1 and fired[0].at < 70
    rearmed = int(fired[0].at + cooldown_s) + 1     # clear since ~75 s, cooled down
    run(70, rearmed - 3, 100.0)
    assert tr.state_dicts((1, 1), rearmed - 3)[0]["fired_s_ago"] is not None     # cooling down
    run(rearmed - 3, rearmed, 100.0)
    state = tr.state_dicts((1, 1), rearmed)[0]
    assert state["fired_s_ago"] is None and state["limit"] == 50.0, state
    run(rearmed, rearmed + 10, 30.0)
    assert len(fired) == 2 and fired[1].baseline == 100.0
    run(rearmed + 10, rearmed + 110, 30.0)  # held past the baseline's window and the cooldown
    state = tr.state_dicts((1, 1), rearmed + 110)[0]
    assert state["fired_s_ago"] is None and len(fired) == 2, (state, fired)
    assert state["baseline"] == 30.0 and state["limit"] == 15.0, state


def test_baseline_figures_and_the_ranges_of_its_intervals():
    """Cumulative op counts sampled at 0, 5, 10, 15 s: MUL_MAT 100 calls of 1 ms each
    interval, ADD 100 calls of 0.25, 0.5, 0.25 ms: MUL_MAT's share 0.8, 2/3, 0.8."""
    r = RollingTotals(horizon_s=60)
    mul = add_n = 0
    add_s = mul_s = 0.0
    for t, add_each in ((0, None), (5, 0.25e-3), (10, 0.5e-3), (15, 0.25e-3)):
        if add_each is not None:
            mul, mul_s = mul + 100, mul_s + 0.1
            add_n, add_s = add_n + 100, add_s + 100 * add_each
        r.sample((1, 1), float(t), {"op": {"MUL_MAT": (mul, mul_s), **({"ADD": (add_n, add_s)} if add_n else {})}},
                 ["op", "token"])
    b = r.between((1, 1), 0.0, 15.0)
    assert b["intervals"] == 3 and b["seconds"] == 15.0
    m = b["families"]["op"]["MUL_MAT"]
    assert m["per_s"] == pytest.approx(20.0) and m["s_per_call"] == pytest.approx(1e-3)
    assert m["share"] == pytest.approx(0.3 / 0.4)
    assert m["share_range"] == pytest.approx([2 / 3, 0.8])
    assert b["families"]["op"]["ADD"]["s_per_call_range"] == pytest.approx([0.25e-3, 0.5e-3])
    assert r.between((1, 1), 0.0, 4.0) is None          # one sample: no stretch
    assert r.between((2, 1), 0.0, 15.0) is None         # another process


def test_verdicts_against_the_baseline():
    base = {"families": {"op": {
        "MUL_MAT": {"per_s": 20.0, "s_per_call": 1e-3, "share": 0.75, "share_range": [0.66, 0.8],
                    "s_per_call_range": [0.9e-3, 1.1e-3], "per_s_range": [19.0, 21.0]},
        "ADD": {"per_s": 20.0, "s_per_call": 0.3e-3, "share": 0.25, "share_range": [0.2, 0.34],
                "s_per_call_range": [0.25e-3, 0.5e-3], "per_s_range": [19.0, 21.0]}}}}
    now = {"families": {"op": {
        "MUL_MAT": {"per_s": 20.0, "s_per_call": 3e-3, "share": 0.9},
        "ADD": {"per_s": 20.0, "s_per_call": 0.3e-3, "share": 0.08},
        "SOFT_MAX": {"per_s": 5.0, "s_per_call": 0.1e-3, "share": 0.02}}}}
    rows = {r["item"]: r for r in changes({"fired": {}, "counts": {"baseline": base, "incident": now}})}
    assert rows["MUL_MAT"]["verdict"] == "outside: share, s_per_call" and rows["MUL_MAT"]["per_call_ratio"] == pytest.approx(3.0)
    assert rows["ADD"]["verdict"] == "outside: share"
    assert rows["SOFT_MAX"]["verdict"] == "new"
    assert [r["item"] for r in changes({"fired": {}, "counts": {"baseline": base, "incident": now}})] == \
        ["MUL_MAT", "ADD", "SOFT_MAX"]


def test_sparkline_scales_to_the_top():
    assert sparkline([0.0, 0.5, 1.0], 1.0) == "▁▅█"
    assert sparkline([1.0, 2.0], 4.0) == "▃▅"


GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "llamacpp.pftrace"


@pytest.mark.parametrize("flight", [
    "{not json", "[1]", '{"fired": {}, "record_for_s": "x"}',
    '{"fired": {"series": [1]}}', '{"fired": {"value": "x"}}', '{"fired": {"value": 1, "unit": "tokens", "limit": "x"}}', '{"fired": {}, "counts": [1]}',
    '{"fired": {}, "left_out": [1]}', '{"fired": {"series": [{"t": 0, "value": "x"}]}}',
    '{"fired": {}, "counts": {"baseline": {"seconds": 5, "intervals": 1, "families": {"op": {"A": {"share": 1}}}},'
    ' "incident": {"seconds": 5, "families": {"op": {"A": {"share": 1}}}}}}',
    "[" * 100000])
def test_a_malformed_flight_record_is_one_line(tmp_path, flight):
    """A trace is input: a flight record that cannot be read gets one line and exit 1 from
    `report` (text and --json), never a traceback."""
    trace = tmp_path / "bad.pftrace"
    trace.write_bytes(with_meta(GOLDEN.read_bytes(), {"flight": flight}))
    # the two runs at once (each reads the trace alone)
    runs = [subprocess.Popen([*PROFINFER, "report", str(trace), *extra], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
            for extra in ([], ["--json", str(tmp_path / "s.json")])]
    try:
        for p in runs:
            _, err = p.communicate(timeout=120)
            assert p.returncode != 0 and "Traceback" not in err, err
            assert "flight record" in err and len(err.strip().splitlines()) == 1, err
    finally:
        for p in runs:
            if p.poll() is None:
                p.kill()
                p.wait()


def test_a_nearly_idle_interval_is_left_out_of_the_ranges():
    """Four intervals of 1,000 graph computes of 1 ms, and one (the load beginning) of 10
    computes of 5 ms: its 5 ms is not in the range, which stays 1 ms."""
    r = RollingTotals(horizon_s=60)
    n, secs = 0, 0.0
    r.sample((1, 1), 0.0, {"graph": {}}, ["graph"])
    for t, (calls, each) in enumerate(((10, 5e-3), (1000, 1e-3), (1000, 1e-3), (1000, 1e-3), (1000, 1e-3)), start=1):
        n, secs = n + calls, secs + calls * each
        r.sample((1, 1), 5.0 * t, {"graph": {"CPU": (n, secs)}}, ["graph"])
    cpu = r.between((1, 1), 0.0, 25.0)["families"]["graph"]["CPU"]
    assert cpu["s_per_call_range"] == pytest.approx([1e-3, 1e-3])
    assert cpu["s_per_call"] == pytest.approx(4.05 / 4010)


def reported(trace: Path, flight: str) -> str:
    """`profinfer report` of the golden trace with this flight record: what it printed."""
    trace.write_bytes(with_meta(GOLDEN.read_bytes(), {"flight": flight}))
    r = subprocess.run([*PROFINFER, "report", str(trace)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_a_flight_records_text_is_printed_as_it_is(tmp_path):
    """Text from the trace (a trigger, an item's name) is printed as written: what looks like
    markup to the terminal's library is not read as such."""
    trace = tmp_path / "odd.pftrace"
    flight = ('{"fired": {"trigger": "[/x] [bold]", "value": 0.1, "limit": 0.05}, "levels": ["token"], '
              '"counts": {"baseline": {"seconds": "20", "intervals": 3, "levels": ["token"], "families": '
              '{"op": {"[/y]": {"share": 1.0, "per_s": 5.0, "s_per_call": 0.001}}}}, '
              '"incident": {"seconds": 5, "levels": ["token"], "families": '
              '{"op": {"[/y]": {"share": 1.0, "per_s": 5.0, "s_per_call": 0.002}}}}}}')
    out = reported(trace, flight)
    assert "[/x] [bold] fired" in out and "[/y]" in out


def test_a_capture_kept_before_quantities_had_units_still_reads(tmp_path):
    """A capture the daemon kept before quantities had units (value_s, limit_s, baseline_s:
    seconds) reads as before."""
    trace = tmp_path / "old.pftrace"
    flight = ('{"fired": {"trigger": "tpot_p99 > 3x baseline for 5s", "quantity": "tpot", "stat": "p99", '
              '"value_s": 0.03, "limit_s": 0.02, "baseline_s": 0.00667, "fired_monotonic_s": 12.0, '
              '"series": [{"t": 10.0, "value_s": 0.01, "samples": 50}, {"t": 11.0, "value_s": 0.03, "samples": 50}]}, '
              '"levels": ["token"]}')
    out = reported(trace, flight)
    assert "p99 30.00 ms > limit 20.00 ms, baseline 6.67 ms" in out and "full height 30.00 ms" in out, out
