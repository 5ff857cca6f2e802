"""Discovery's fallback where the kernel cannot end a hold (before Linux 6.13): a frozen
daemon's held process is continued by another daemon on the node once it has been held
STUCK_S. Here the kernel's deadline would end it first, so it is pushed past that (the
default tier's frozen-daemon test holds the kernel's deadline; this one waits ~12 s for a
path this kernel does not take by default)."""
from __future__ import annotations

import time

import pytest

from conftest import llama_perf
from daemon_helpers import kill_started
from test_node_discovery import NO_DEADLINE, ORPHAN_S, STUCK_S, _held_by_a_frozen_daemon, _state
from test_record_beside_daemon import daemon  # noqa: F401 (a fixture)
from test_record_beside_daemon import test_records_beside_a_daemon_count_every_decode as _records


@pytest.fixture(autouse=True)
def _no_workload_left():
    yield
    kill_started()


def test_a_process_held_by_a_frozen_daemon_is_continued_by_another(tmp_path, llama_build, tiny_model,
                                                                    llama_env):
    """A daemon frozen (alive, its watchdog too) while it holds a process: another daemon on
    the node leaves that process to it while it is young (a live daemon's own), and continues
    it once it has been held STUCK_S; the process runs to its end."""
    with _held_by_a_frozen_daemon(tmp_path, llama_build, tiny_model, llama_env, NO_DEADLINE) as (
            _, proc, start_second):
        held_at = time.monotonic()
        second = start_second()
        time.sleep(max(0.0, held_at + ORPHAN_S + 1 - time.monotonic()))
        assert _state(proc.pid) == "T", "another live daemon's young hold was ended"
        _, err = proc.communicate(timeout=STUCK_S + 60)
        waited = time.monotonic() - held_at
        assert proc.returncode == 0, err[-2000:]
        assert {"prompt eval", "eval"} <= llama_perf(err).keys(), err[-2000:]
        assert STUCK_S - 1 <= waited, waited
        assert f"PID {proc.pid}: held by a daemon gone or stuck" in second.text(), second.text()


def test_records_of_a_script_beside_a_daemon_count_every_decode(daemon, llama_build, tiny_model,  # noqa: F811
                                                               llama_env, tmp_path):
    """`record` of a shell script whose child is the engine, ten times beside a discovering
    daemon (put in the node's map by the follower's BPF at the fork): each exits 0 and counts
    every decode call llama.cpp reports; the daemon never holds it. The default tier records
    the engine as the command itself (tests/daemon/test_record_beside_daemon.py)."""
    _records("script", daemon, llama_build, tiny_model, llama_env, tmp_path)
