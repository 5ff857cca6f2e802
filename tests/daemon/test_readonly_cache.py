"""A cache the daemon cannot write (the image's read-only root, a volume not mounted): one
warning line, the cache kept in memory, and every process watched and counted as before.
An empty cache, or one it cannot write: no calibration of the probes' traps, so the daemon
measures them at start (under a second), says so in /status, and prices hits at them."""
from __future__ import annotations

import os
import time

import pytest

import json

from conftest import llama_perf
from daemon_helpers import Daemon, Workload, _get, kill_started, series
from profinfer.core.calibration import probecost


@pytest.fixture(autouse=True)
def _no_workload_left():
    yield
    kill_started()


def test_unwritable_cache_warns_once_and_counts(tmp_path, llama_build, tiny_model, llama_env):
    cache = "/proc/profinfer-cache"          # a directory nobody can make, root included
    os.environ["PROFINFER_CACHE"] = cache    # inherited by the daemon
    try:
        d = Daemon(tmp_path)
    finally:
        del os.environ["PROFINFER_CACHE"]
    try:
        w = Workload(llama_build, tiny_model, llama_env, tmp_path, n=16)
        assert d.watched(w.proc.pid)["engine"] == "llama.cpp"
        w.go()
        err = w.finish()
        perf = llama_perf(err)      # its log drain is preloaded: a missing line is a defect
        assert "eval" in perf, f"llama.cpp's perf lines missing:\n{err[-2000:]}"
        deadline, got = time.monotonic() + 10, {}
        while time.monotonic() < deadline and got.get("decode") != perf["eval"][1]:
            got = series(_get(d.url + "/metrics")[1].decode(), "profinfer_tokens_total", w.proc.pid, "phase")
            time.sleep(0.2)
        assert got.get("decode") == perf["eval"][1], d.text()
        warnings = [l for l in d.text().splitlines() if "cannot be written" in l]
        assert len(warnings) >= 1 and all(cache in l for l in warnings), d.text()
        assert len({l.split(" (")[0] for l in warnings}) == len(warnings)     # once per directory
        assert "Traceback" not in d.text()
        _measured_at_start(d)
    finally:
        d.stop()


def _measured_at_start(d: Daemon) -> None:
    """/status says the trap costs were measured at start (and how long it took), and they agree
    with this machine's calibration (`profinfer calibrate`, checked over many more calls)
    within a factor of 2 where one is cached here."""
    status = json.loads(_get(d.url + "/status")[1])
    how = status["trap_costs_source"]
    assert how.startswith("measured at start: ") and status["traps_calibrated"], status
    assert f"probe hits priced at {how}" in d.text()
    # against calibrate's cached figures, or, where setup's machine was too busy to cache
    # them, a full measurement now: never no comparison (a consistency check of the daemon's
    # quick measurement against calibrate's checked one, not an outside truth)
    got, calibrated = status["trap_costs_ns"], probecost.cached() or probecost.measure()
    assert 0 < got["emulated_ns"] < got["stepped_ns"], got
    for k in ("emulated_ns", "stepped_ns"):
        assert calibrated[k] / 2 <= got[k] <= calibrated[k] * 2, (k, got, calibrated)


def test_an_empty_cache_measures_trap_costs_at_start(tmp_path):
    os.environ["PROFINFER_CACHE"] = str(tmp_path / "cache")
    try:
        d = Daemon(tmp_path)
    finally:
        del os.environ["PROFINFER_CACHE"]
    try:
        _measured_at_start(d)
    finally:
        d.stop()
