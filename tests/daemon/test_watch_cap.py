"""Any process that loads a CUDA runtime (or a library named like an engine's) is watched:
a tenant can start hundreds. The daemon watches at most --max-processes at once, keeps at
most as many exited ones' series, counts what it left out, and forgets what it read through
each process's /proc/PID/root once the process is gone.

The daemon runs in a PID namespace of its own (with its /proc), the tenants in it: on this
shared machine it would otherwise watch whatever else runs here too, and the counts would
be theirs as well. Its loop, cap and caches are the same there (discovery from the kernel
is off in a PID namespace: the /proc scan finds them)."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from daemon_helpers import Daemon, _get, cudart_tenant, kill_started
from profinfer.levels.cuda import workload

CAP, EXCESS = 3, 4
# The daemon in a new PID namespace (and mount namespace, with its own /proc), SIGTERM passed
# on; a tenant run in it. Each waits for its child without WUNTRACED: unshare and nsenter
# wait with it, and stop themselves for good when another daemon on this machine holds
# their child for a moment.
NEW = """
import ctypes, os, signal, sys
libc = ctypes.CDLL(None, use_errno=True)
assert libc.unshare(0x20000000 | 0x00020000) == 0       # CLONE_NEWPID | CLONE_NEWNS
pid = os.fork()
if pid == 0:
    assert libc.mount(b"none", b"/", None, 0x40000 | 0x4000, None) == 0   # MS_PRIVATE | MS_REC
    assert libc.mount(b"proc", b"/proc", b"proc", 0, None) == 0
    os.execvp(sys.argv[1], sys.argv[1:])
signal.signal(signal.SIGTERM, lambda *_: os.kill(pid, signal.SIGTERM))
sys.exit(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
"""
ENTER = """
import ctypes, os, sys
fd = os.open(sys.argv[1], os.O_RDONLY)
assert ctypes.CDLL(None, use_errno=True).setns(fd, 0x20000000) == 0   # CLONE_NEWPID
pid = os.fork()
if pid == 0:
    os.execvp(sys.argv[2], sys.argv[2:])
sys.exit(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
"""


@pytest.fixture(autouse=True)
def _no_workload_left():
    yield
    kill_started()


def _status(d) -> dict:
    return json.loads(_get(d.url + "/status")[1])


def _samples(d) -> dict[str, list]:
    text = _get(d.url + "/metrics")[1].decode()
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def _until(check, timeout: float = 60):     # a bound for a loaded machine, not a speed
    deadline = time.monotonic() + timeout
    while not check() and time.monotonic() < deadline:
        time.sleep(0.2)
    return check()


def test_watched_processes_and_series_capped_and_caches_pruned(tmp_path):
    cudart = workload.ensure_cudart12()
    d = Daemon(tmp_path, extra=("--max-processes", str(CAP), "--max-per-tenant", str(CAP)),
               prefix=(sys.executable, "-c", NEW))
    enter = (sys.executable, "-c", ENTER, f"/proc/{d.proc.pid}/ns/pid_for_children")
    procs = []
    try:
        for _ in range(CAP + EXCESS):
            procs.append(cudart_tenant(cudart, prefix=enter))
        pids = {p.ns_pid for p in procs}
        # each one found by the daemon: watched, or counted as left out
        assert _until(lambda: len(pids & {p["pid"] for p in _status(d)["processes"]}) == CAP
                      and _status(d)["limits"]["processes_dropped"] == EXCESS), (_status(d), d.text())
        status = _status(d)
        assert len(status["processes"]) == CAP and status["limits"]["left_out_now"] == EXCESS
        m = _samples(d)
        assert m["profinfer_processes_dropped"][0].value == EXCESS
        assert {s.labels["pid"] for s in m["profinfer_process_info"]} <= {str(p) for p in pids}
        assert len(m["profinfer_process_info"]) == CAP
        assert sum("left out" in l for l in d.text().splitlines()) == 1, d.text()   # said once
        assert status["caches"]["cudart_links"] > 0        # read through their /proc/PID/root
        # the watched ones exit: room, so the left-out ones are watched, up to the cap
        watched = [p for p in procs if p.ns_pid in {q["pid"] for q in status["processes"]}]
        for p in watched:
            p.stdin.close()
            p.wait(timeout=30)
        rest = [p for p in procs if p not in watched]
        assert _until(lambda: len({p.ns_pid for p in rest} & {q["pid"] for q in _status(d)["processes"]}) == CAP)
        for p in rest:
            p.stdin.close()
            p.wait(timeout=30)
        assert _until(lambda: not _status(d)["processes"]), _status(d)
        status = _status(d)
        # CAP + CAP exited within the TTL: only CAP of their series kept, the rest counted
        assert status["limits"]["series_dropped"] == CAP
        assert len(_samples(d)["profinfer_process_info"]) == CAP
        assert _samples(d)["profinfer_series_dropped"][0].value == CAP
        caches = status["caches"]
        assert (caches["kernel_symbol_tables"], caches["cudart_links"], caches["sequences"]) == (0, 0, 0), caches
        assert caches["process_series"] == CAP
        assert "Traceback" not in d.text()
    finally:
        d.stop()


def test_no_discovery_from_the_kernel_in_a_pid_namespace_of_its_own():
    """BPF names processes by their pids in the initial PID namespace: a daemon in another one
    (with its own /proc, as in a container without hostPID) could not continue what discovery
    stopped, so it runs without it."""
    done = subprocess.run([sys.executable, "-c", NEW, sys.executable, "-c",
                           "from profinfer.daemon.discovery import kernel as discover; print(discover.available())"],
                          capture_output=True, text=True, timeout=60, cwd=Path(__file__).resolve().parents[2])
    assert done.stdout.strip() == "not in the host's PID namespace (hostPID)", done
