"""`profinfer calibrate` checks its measurement: with the CPUs kept busy by other processes it
caches nothing and says why (exit 75). (On an idle machine it caches the roofs and probe costs
with the check they passed: a whole calibration, timed, in tests/soak; setup.sh makes one on
every fresh machine.) No timed assertion on absolute numbers: only what the check decided and
what it left in the cache."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from contextlib import contextmanager

import pytest

from profinfer.core.calibration import machine_roofs, loadcheck, probecost

PROFINFER = [sys.executable, "-m", "profinfer.cli"]
SPIN = [sys.executable, "-c", "while True: pass"]


@contextmanager
def busy_cpus(n: int):
    """n processes that each keep a CPU busy (not our children's CPU time: never waited for
    inside a measurement)."""
    procs = [subprocess.Popen(SPIN) for _ in range(n)]
    try:
        time.sleep(0.3)
        yield
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


def calibrate_cli(cache, *args):
    env = {**os.environ, "PROFINFER_CACHE": str(cache)}
    return subprocess.run([*PROFINFER, "calibrate", *args], capture_output=True, text=True,
                          env=env, timeout=600)


def test_load_window_counts_others_not_us():
    with loadcheck.LoadWindow() as mine:        # our own child's work is not "others"
        subprocess.run([sys.executable, "-c", "import time\nt=time.time()\nwhile time.time()-t<1: pass"])
    with busy_cpus(1), loadcheck.LoadWindow() as theirs:
        time.sleep(1)
    assert mine.load.others_cpus < theirs.load.others_cpus
    assert theirs.load.busy and theirs.load.others_cpus > 0.7


def test_spread():
    assert loadcheck.spread([10, 9.5, 3, 9.8]) == pytest.approx(0.05)
    assert loadcheck.spread([1.0, 1.2, 5.0], higher_is_better=False) == pytest.approx(1 - 1 / 5)
    assert loadcheck.spread([10, 9]) == float("inf")              # too few to judge


def test_best_of_two_runs_that_passed(monkeypatch):
    """A whole-run slowdown passes one run's own check; the best of the runs that passed is
    the least disturbed, and a single passing run is not enough."""
    monkeypatch.setattr(loadcheck, "RETRY_PAUSE_S", 0)

    def runs(*results):
        it = iter(results)
        return lambda: next(it)

    notes = []
    fast, slow, busy = ({"fma": 160.0}, []), ({"fma": 118.0}, []), ({"fma": 60.0}, ["busy"])
    # two that disagree: keep looking, until two agree
    figures, problems, how = loadcheck.settle(runs(slow, busy, fast, ({"fma": 158.0}, []), fast),
                                              5, True, notes.append, "t")
    assert (figures, problems) == ({"fma": 160.0}, []) and "3 runs passed" in how
    figures, problems, how = loadcheck.settle(runs(slow, fast, busy), 3, True, notes.append, "t")
    assert figures == {"fma": 160.0} and not problems and "within 26%" in how
    figures, problems, _ = loadcheck.settle(runs(busy, fast, busy), 3, True, notes.append, "t")
    assert "1 of 3 runs passed, 2 needed" in problems[0] and "busy" in problems[0]
    # two rejected of three: the third cannot make two pass, and is not run
    figures, problems, _ = loadcheck.settle(runs(busy, busy), 3, True, notes.append, "t")
    assert "0 of 2 runs passed, 2 needed (of 3 at most)" in problems[0]
    assert notes == ["t run 2/5 rejected: busy", "t run 3/3 rejected: busy",
                     "t run 1/3 rejected: busy", "t run 3/3 rejected: busy",
                     "t run 1/3 rejected: busy", "t run 2/3 rejected: busy"]
    costs = ({"trap": 600.0, "noise": 1.0}, []), ({"trap": 580.0, "noise": 9.0}, [])
    assert loadcheck.settle(runs(*costs), 2, False, notes.append, "t", judged=("trap",))[:2] \
        == ({"trap": 580.0, "noise": 1.0}, [])


def test_busy_machine_caches_nothing(tmp_path):
    with busy_cpus(os.cpu_count() or 1):
        r = calibrate_cli(tmp_path, "--attempts", "2")
    assert r.returncode == 75, r.stdout + r.stderr
    err = r.stderr
    assert "roofs not cached" in err and "probe costs not cached" in err, err
    # the first run rejected: two passing runs are out of reach, the second is not made
    assert "the machine was busy" in err and "run 1/2 rejected" in err and "run 2/2" not in err, err
    assert not (tmp_path / "roofs.json").exists() and not (tmp_path / "probecost.json").exists()


def test_forced_busy_measurement_keeps_the_good_one(tmp_path, monkeypatch):
    """--force on a busy machine neither replaces nor removes a checked entry."""
    monkeypatch.setenv("PROFINFER_CACHE", str(tmp_path))
    good = {"threads": 1, "read_gbps": 12.5, "triad_gbps": 13.0, "fma_gflops": 99.0,
            "check": "test entry", "measured_at": "2000-01-01T00:00:00"}
    (tmp_path / "roofs.json").write_text(json.dumps({machine_roofs._key(1): good}))
    with busy_cpus(os.cpu_count() or 1), pytest.raises(loadcheck.UnreliableMeasurement) as e:
        machine_roofs.calibrate(1, force=True, attempts=1)
    assert "the machine was busy" in str(e.value)
    assert machine_roofs.cached(1) == good


def test_unchecked_entries_are_ignored(tmp_path, monkeypatch):
    """Entries cached before measurements were checked (like setup's 9.8 GB/s one) judge nothing."""
    monkeypatch.setenv("PROFINFER_CACHE", str(tmp_path))
    (tmp_path / "roofs.json").write_text(json.dumps(
        {machine_roofs._key(2): {"threads": 2, "read_gbps": 9.8, "triad_gbps": 9.0, "fma_gflops": 75.0}}))
    (tmp_path / "probecost.json").write_text(json.dumps(
        {probecost._key(): {"emulated_ns": 1.0, "stepped_ns": 2.0, "uretprobe_extra_ns": 3.0}}))
    assert machine_roofs.cached_roofs(2) is None and probecost.cached() is None
