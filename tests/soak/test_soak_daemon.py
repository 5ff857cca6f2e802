"""The daemon at length: two minutes of slowloris and a metrics flood beside a counted
llama-server, and churn of 50 llama.cpp processes. The default tier runs the same checks
shorter (tests/daemon/test_http.py, test_churn.py)."""
from __future__ import annotations

import pytest

from daemon_helpers import Daemon, kill_started
from test_churn import churn_keeps_the_daemon_flat
from test_http import counted_under_slowloris


@pytest.fixture(autouse=True)
def _no_workload_left():
    yield
    kill_started()


def test_two_minutes_of_slowloris_and_a_metrics_flood(tmp_path, llama_build, tiny_model, llama_env):
    d = Daemon(tmp_path)
    try:
        counted_under_slowloris(d, llama_build, tiny_model, llama_env, 120)
    finally:
        d.stop()


def test_fifty_processes_of_churn_keep_the_daemon_flat(tmp_path, llama_build, tiny_model, llama_env, bpf_watch):
    churn_keeps_the_daemon_flat(tmp_path, llama_build, tiny_model, llama_env, bpf_watch, waves=10)
