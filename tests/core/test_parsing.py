"""Readings of tenants' files in the worker process (profinfer.core.parsing): one that runs past
its deadline is killed, told, and not tried again, and the worker serves the next; one that
needs more memory than the worker's limit fails there, not in the caller; the caller waits
for a new reading a bounded while, then goes on (NotReady) and gets it later."""
from __future__ import annotations

import os
import time

import pytest

from profinfer.core import parsing
from profinfer.core.errors import ProfinferError


@pytest.fixture
def worker():
    parsing.start(wait_s=0.5, deadline_s=3.0)
    yield parsing._worker
    parsing.stop()


def _worker_pid(w) -> int:
    return w.proc.pid


def test_past_its_deadline_killed_told_and_not_tried_again(worker):
    first = _worker_pid(worker)
    t0 = time.monotonic()
    with pytest.raises(parsing.NotReady):
        parsing.run(("slow",), "time", "sleep", 60)
    assert time.monotonic() - t0 < 2.5          # the caller waited 0.5 s, not the reading's 60
    deadline = time.monotonic() + 30
    while True:
        try:
            parsing.run(("slow",), "time", "sleep", 60)
        except parsing.NotReady:
            assert time.monotonic() < deadline
            time.sleep(0.2)
            continue
        except ProfinferError as e:
            assert "took over 3 s" in str(e)
            break
    assert not os.path.exists(f"/proc/{first}")        # killed (and reaped)
    t0 = time.monotonic()
    with pytest.raises(ProfinferError, match="took over"):      # told again at once, not re-read
        parsing.run(("slow",), "time", "sleep", 60)
    assert time.monotonic() - t0 < 0.5
    # the next reading: a new worker
    assert _run_until_done(("pid",), "os", "getpid") not in (first, os.getpid())


def _run_until_done(key, module, function, *args):
    deadline = time.monotonic() + 30
    while True:
        try:
            return parsing.run(key, module, function, *args)
        except parsing.NotReady:
            assert time.monotonic() < deadline
            time.sleep(0.1)


def test_over_its_memory_fails_in_the_worker(worker):
    with pytest.raises(ProfinferError, match="MiB to read"):
        _run_until_done(("big",), "os", "urandom", 1 << 30)
    assert _run_until_done(("after",), "os", "getpid") == _worker_pid(worker)   # it lives on


def test_without_a_worker_readings_run_in_the_caller():
    assert parsing.run(("pid",), "os", "getpid") == os.getpid()
