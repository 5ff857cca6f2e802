"""A trap's cost inside a process, measured there: a probe that does nothing, put in and
taken out of a program's calls in alternate windows (core/calibration/insitu.py), checked against the
calls as the program's own clock timed them."""
from __future__ import annotations

import subprocess
import time
from pathlib import Path

import numpy as np

from profinfer.core.calibration import insitu, probecost
from profinfer.core.ebpf import libbpf
from profinfer.core.target.arch import placement
from profinfer.core.target.symbols import load_elf

HERE = Path(__file__).parent


def test_the_bare_probe_costs_the_calls_it_is_in_one_trap(tmp_path):
    exe, log = tmp_path / "timed_calls", tmp_path / "calls.log"
    subprocess.run(["gcc", "-O1", "-o", str(exe), str(HERE / "timed_calls.c")], check=True)
    elf = load_elf(str(exe))
    sym = elf.find("work")
    after_first = placement.next_emulated(elf.code_bytes(sym, 16), 0)
    assert after_first == 4                                   # push rbx, past push rbp; mov
    stats_fd = libbpf.enable_run_time_stats()
    proc = subprocess.Popen([str(exe), "6", str(log)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        sampler = insitu.TrapSampler([(str(exe), None, [sym.file_offset + after_first])], proc.pid,
                                     windows=2, window_s=1.0)
        while not sampler.done:
            sampler.tick()
            time.sleep(0.05)
        runs, _ns = sampler.cost()
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
        if stats_fd >= 0:
            import os
            os.close(stats_fd)
    calls = np.loadtxt(log, dtype=np.int64)
    start, end = calls[:, 0], calls[:, 1]
    # the program's own count of the calls made while the probe was in: the bare program's
    # runs (every one of them, and no more), give or take the calls at each window's edges
    inside = sum(int(((start >= a) & (end <= b)).sum()) for a, b in sampler.on)
    around = sum(int(((end >= a) & (start <= b)).sum()) for a, b in sampler.on)
    assert inside <= runs <= around + 1000, (inside, runs, around)
    trap = sampler.trap_ns(start, end, np.zeros(len(start), np.int64))
    assert trap is not None
    ns, n = trap
    assert n >= 1000
    # one emulated trap, as this program pays it: of the order the calibration loop measures
    # (the loop keeps the kernel's path warm: the program's bursts and pauses do not)
    # (calibrate's cached figure, or, where setup's machine was too busy to cache one, a
    # measurement now: never no comparison. This one is a consistency check of two of
    # profinfer's own measurements; the outside truth is the program's clock, above)
    calibrated = (probecost.cached() or probecost.measure())["emulated_ns"]
    print("trap in the program", ns, "ns over", n, "calls; runs", runs, "calibrated", calibrated)
    assert 100 < ns < 20_000, ns
    assert calibrated / 3 < ns < calibrated * 10, (ns, calibrated)
    sampler.close()
