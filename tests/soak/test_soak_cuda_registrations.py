"""The daemon's cuda level under a tenant's flood of kernel registrations: its memory stays
bounded (a minute of paced registrations: the soak tier)."""
from __future__ import annotations

import json
import subprocess
import time

from daemon_helpers import _STARTED, Daemon, _get, kill_started
from conftest import TESTS

import pytest


@pytest.fixture(autouse=True)
def _no_workload_left():
    yield
    kill_started()


FLOOD = TESTS / "levels" / "cuda" / "programs" / "registration_flood.c"


def _vm_hwm(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def test_a_flood_of_kernel_registrations_does_not_grow_the_daemon(tmp_path):
    """A tenant's own libcudart.so.12 (a bare __cudaRegisterFunction) called 250,000 times,
    each with a distinct host pointer and 120-byte name, 5 a millisecond (faster, the daemon's
    event buffer overflows and it learns few: at 20 a millisecond it lost 2 in 3): the daemon
    names at most 65,536 a table, so its peak memory (the kernel's VmHWM) grows by under
    32 MiB, where naming every one grew it by more (bench/results.md); the process is watched
    and runs to its end. (Soak: it takes a minute.)"""
    runtime = tmp_path / "libcudart.so.12"
    subprocess.run(["gcc", "-O1", "-shared", "-fPIC", "-DSTUB_RUNTIME", "-o", str(runtime), str(FLOOD)], check=True)
    flood = tmp_path / "flood"
    subprocess.run(["gcc", "-O1", "-o", str(flood), str(FLOOD), f"-L{tmp_path}", "-l:libcudart.so.12",
                    f"-Wl,-rpath,{tmp_path}"], check=True)
    d = Daemon(tmp_path)
    try:
        def run(n: int) -> None:
            proc = subprocess.Popen([str(flood), str(n), "5"], stdout=subprocess.PIPE, text=True)
            _STARTED.append(proc)
            out, _ = proc.communicate(timeout=120)
            assert proc.returncode == 0 and out.strip() == f"registered {n}", out
            deadline = time.monotonic() + 30     # its exit seen: what it sent drained
            while time.monotonic() < deadline and proc.pid in {
                    p["pid"] for p in json.loads(_get(d.url + "/status")[1])["processes"]}:
                time.sleep(0.2)
        run(1000)
        assert "(flood): cuda level" in d.text(), d.text()
        before = _vm_hwm(d.proc.pid)
        run(250_000)
        grew = _vm_hwm(d.proc.pid) - before
        lost = [l for l in _get(d.url + "/metrics")[1].decode().splitlines() if l.startswith("profinfer_events_lost")]
        print(f"the daemon's peak grew by {grew / 2**20:.1f} MiB; {lost}")
        assert grew < 32 << 20, (grew >> 20, d.text()[-2000:])
        assert d.proc.poll() is None
    finally:
        d.stop()
