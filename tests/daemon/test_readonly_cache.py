"""A cache the daemon cannot write (the image's read-only root, a volume not mounted): one
warning line, the cache kept in memory, and every process watched and counted as before."""
from __future__ import annotations

import os
import time

import pytest

from conftest import llama_perf
from daemon_helpers import Daemon, Workload, _get, kill_started, series


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
        for _ in range(4):      # llama.cpp's async logger can lose its last lines
            w = Workload(llama_build, tiny_model, llama_env, tmp_path, n=16)
            assert d.watched(w.proc.pid)["engine"] == "llama.cpp"
            w.go()
            perf = llama_perf(w.finish())
            if "eval" in perf:
                break
        deadline, got = time.monotonic() + 10, {}
        while time.monotonic() < deadline and got.get("decode") != perf["eval"][1]:
            got = series(_get(d.url + "/metrics")[1].decode(), "profinfer_tokens_total", w.proc.pid, "phase")
            time.sleep(0.2)
        assert got.get("decode") == perf["eval"][1], d.text()
        warnings = [l for l in d.text().splitlines() if "cannot be written" in l]
        assert len(warnings) >= 1 and all(cache in l for l in warnings), d.text()
        assert len({l.split(" (")[0] for l in warnings}) == len(warnings)     # once per directory
        assert "Traceback" not in d.text()
    finally:
        d.stop()
