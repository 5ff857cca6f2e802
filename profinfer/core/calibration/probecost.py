"""What one uprobe hit costs on this machine: measured once per kernel and CPU, cached.

BPF's own run time is counted by the kernel (bpf_stats); the trap that gets there is not.
profinfer/core/calibration/native/probecost.c calls a tiny function in a loop and reports thread CPU time per
call; a uprobe is put on it (a plain perf uprobe event, no BPF) for alternate rounds, so the
difference is the trap, the kernel's emulation or single-step of the probed instruction, and
the return to user space. Three costs: a probe on an instruction the kernel emulates (how
profinfer places its probes), one on an instruction it must single-step, and what a
uretprobe adds on return.

Checked as the roofs are (see calibrate, loadcheck): a run taken while other processes used
the CPUs, or whose probed rounds disagree, is rejected; two runs must pass, or nothing is
cached.
"""
from __future__ import annotations

import ctypes
import os
import platform
import statistics
import subprocess
import time

from profinfer.core.target import buildcache
from profinfer.core.calibration import loadcheck, nativebuild
from profinfer.core.calibration.hits import Hit
from profinfer.core.ebpf.perf_event_open import PerfEventAttr, perf_event_open
from profinfer.core.base.errors import ProfinferError
from profinfer.core.calibration.loadcheck import UnreliableMeasurement
from profinfer.core.target.symbols import load_elf

UPROBE_PMU = "/sys/bus/event_source/devices/uprobe"
ROUNDS = 5                        # probed and plain rounds, alternating
CALLS = {"emulated": 200_000, "stepped": 20_000}
ATTEMPTS = 4             # runs, of which two must pass
SPREAD_LIMIT = 0.35      # the 3 cheapest probed rounds of each kind agree within 35%
QUICK_CALLS = {"emulated": 20_000, "stepped": 2_000}    # measure_quick: a tenth of the calls,
QUICK_ROUNDS = 3                                        # and 3 rounds of each


def _cache_path() -> str:
    return os.path.join(nativebuild.cache_dir(), "probecost.json")


def _key() -> str:
    from profinfer.core.calibration.machine_roofs import cpu_model
    return f"{cpu_model()}|{platform.release()}"


def _uprobe_attr(path: bytes, offset: int, retprobe: bool) -> tuple[PerfEventAttr, ctypes.Array]:
    try:
        with open(f"{UPROBE_PMU}/type") as f:
            pmu = int(f.read())
        with open(f"{UPROBE_PMU}/format/retprobe") as f:
            ret_bit = int(f.read().strip().split(":")[1])
    except (OSError, ValueError, IndexError):
        raise ProfinferError(f"this kernel has no uprobe PMU ({UPROBE_PMU})") from None
    buf = ctypes.create_string_buffer(path)
    attr = PerfEventAttr(pmu, PerfEventAttr.SIZE_VER5,
                                  (1 << ret_bit) if retprobe else 0)
    attr.config1, attr.config2 = ctypes.addressof(buf), offset
    return attr, buf          # the path buffer must live until the event is open


def _rounds(binary: str, function: str, offset: int, retprobe: bool,
            calls_by_function: dict[str, int] = CALLS, n_rounds: int = ROUNDS,
            alternate: bool = True) -> tuple[list[float], list[float]]:
    """ns per call of each plain and each probed round: alternating, or (alternate False)
    the plain rounds first and then the probed ones under one probe (removing a uprobe
    waits for the kernel's grace period, bench/results.md; measure_quick places it once)."""
    calls = calls_by_function[function]
    proc = subprocess.Popen([binary, function, str(calls), str(2 * n_rounds)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    plain, probed = [], []
    fd = -1
    try:
        for r in range(2 * n_rounds):
            is_probed = bool(r % 2) if alternate else r >= n_rounds
            if is_probed and fd < 0:
                attr, _buf = _uprobe_attr(binary.encode(), offset, retprobe)
                fd = perf_event_open(attr, proc.pid, -1)
                if fd < 0:
                    raise ProfinferError(f"cannot place a uprobe to measure its cost: "
                                         f"{os.strerror(-fd)}")
            proc.stdin.write("\n")
            proc.stdin.flush()
            (probed if is_probed else plain).append(float(proc.stdout.readline()))
            if fd >= 0 and alternate:
                os.close(fd)
                fd = -1
    finally:
        if fd >= 0:
            os.close(fd)
        proc.stdin.close()
        proc.wait(timeout=60)
    return plain, probed


def measure_checked() -> tuple[dict, list[str], str]:
    """One run: ns per hit ("emulated", "stepped", and "with_return": an emulated entry probe
    plus its uretprobe), what makes it unreliable (empty when it passed), and its check."""
    binary = nativebuild.build("probecost.c", ["-O2"])
    syms = load_elf(binary).symbols
    off = {f: syms[f"pi_probe_{f}"].file_offset for f in CALLS}
    kinds = {"emulated": ("emulated", False), "stepped": ("stepped", False),
             "with_return": ("emulated", True)}
    with loadcheck.LoadWindow() as window:
        rounds = {k: _rounds(binary, fn, off[fn], ret) for k, (fn, ret) in kinds.items()}
    cost = {k: max(statistics.median(probed) - statistics.median(plain), 0.0)
            for k, (plain, probed) in rounds.items()}
    spread = {k: loadcheck.spread(probed, 3, higher_is_better=False) for k, (_, probed) in rounds.items()}
    problems = [f"the machine was busy: {window.load.describe()}"] if window.load.busy else []
    problems += [f"{k} rounds differ by {s:.0%}" for k, s in spread.items() if s > SPREAD_LIMIT]
    return cost, problems, (f"cheapest 3 probed rounds within {max(spread.values()):.1%}, "
                            f"{window.load.describe()}")


def measure_quick(attempts: int = 2) -> tuple[dict | None, str]:
    """The costs in under a second, for a daemon that starts with none cached (its image):
    a tenth of calibrate's calls in 3 rounds of each kind under one probe, checked as calibrate checks each run (its 3 probed
    rounds of each kind agree within SPREAD_LIMIT; thread CPU time, so other
    processes' load, which a node serving inference always has, is not refused) with a
    second try if the first fails. Nothing is cached. (costs, how it was checked) or
    (None, why not)."""
    t0 = time.monotonic()
    try:
        binary = nativebuild.build("probecost.c", ["-O2"])
        syms = load_elf(binary).symbols
        off = {f: syms[f"pi_probe_{f}"].file_offset for f in CALLS}
    except (OSError, ProfinferError, KeyError) as e:
        return None, f"cannot build the measurement: {e}"
    kinds = {"emulated": ("emulated", False), "stepped": ("stepped", False),
             "with_return": ("emulated", True)}
    why = ""
    for _ in range(attempts):
        try:
            rounds = {k: _rounds(binary, fn, off[fn], ret, QUICK_CALLS, QUICK_ROUNDS, False) for k, (fn, ret) in kinds.items()}
        except (OSError, ValueError, ProfinferError, subprocess.SubprocessError) as e:
            return None, f"cannot measure: {e}"
        spread = {k: loadcheck.spread(probed, 3, higher_is_better=False) for k, (_, probed) in rounds.items()}
        bad = [f"{k} rounds differ by {v:.0%}" for k, v in spread.items() if v > SPREAD_LIMIT]
        if not bad:
            cost = {k: max(statistics.median(probed) - statistics.median(plain), 0.0)
                    for k, (plain, probed) in rounds.items()}
            return _as_costs(cost), (f"cheapest 3 probed rounds within {max(spread.values()):.1%}, "
                                     f"in {time.monotonic() - t0:.2f} s")
        why = "; ".join(bad)
    return None, f"unreliable ({why})"


def _as_costs(cost: dict) -> dict:
    return {Hit.EMULATED.price_key: round(cost["emulated"], 1), Hit.STEPPED.price_key: round(cost["stepped"], 1),
            Hit.RETURN.price_key: round(max(cost["with_return"] - cost["emulated"], 0.0), 1)}


def measure() -> dict:
    """The costs of one run, unchecked."""
    return _as_costs(measure_checked()[0])


def _load() -> dict:
    """The cache, if nobody but root or this user could have written it (else {})."""
    return buildcache.load_trusted_dict(_cache_path())


def describe(c: dict) -> str:
    return (f"uprobe hit: {c['emulated_ns'] / 1e3:.2f} µs on an emulated instruction, "
            f"{c['stepped_ns'] / 1e3:.2f} µs single-stepped, "
            f"+{c['uretprobe_extra_ns'] / 1e3:.2f} µs for a uretprobe's return")


def calibrate(force: bool = False, attempts: int = ATTEMPTS, note=lambda msg: None) -> dict:
    """The checked costs for this CPU and kernel, measured unless cached (or forced).

    Raises UnreliableMeasurement, caching nothing, when fewer than two runs pass."""
    cache = _load()
    if "check" in cache.get(_key(), {}) and not force:
        return cache[_key()]
    checks: list[str] = []

    def run_once():
        cost, problems, check = measure_checked()
        if not problems:
            checks.append(check)
        return cost, problems

    # interference only adds to a trap's cost: the cheapest of the runs that passed
    cost, problems, agreement = loadcheck.settle(run_once, attempts, False, note, "probe cost")
    result = _as_costs(cost)
    if problems:
        raise UnreliableMeasurement(
            f"probe costs not cached: {'; '.join(problems)}. Measured (maybe off) "
            f"{describe(result)}; run `profinfer calibrate` again when the machine is idle")
    result.update(check=f"cheapest of {agreement}; last: {checks[-1]}",
                  measured_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    buildcache.store_entry(_cache_path(), _key(), result)
    return result


def cached() -> dict | None:
    """The checked costs for this CPU and kernel, if `profinfer calibrate` measured them."""
    entry = _load().get(_key())
    return entry if isinstance(entry, dict) and "check" in entry else None
