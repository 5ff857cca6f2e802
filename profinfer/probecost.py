"""What one uprobe hit costs on this machine: measured once per kernel and CPU, cached.

BPF's own run time is counted by the kernel (bpf_stats); the trap that gets there is not.
profinfer/native/probecost.c calls a tiny function in a loop and reports thread CPU time per
call; a uprobe is put on it (a plain perf uprobe event, no BPF) for alternate rounds, so the
difference is the trap, the kernel's emulation or single-step of the probed instruction, and
the return to user space. Three costs: a probe on an instruction the kernel emulates (how
profinfer places its probes), one on an instruction it must single-step, and what a
uretprobe adds on return.
"""
from __future__ import annotations

import ctypes
import json
import os
import platform
import statistics
import subprocess

from . import counters, nativebuild
from .errors import ProfinferError
from .symbols import load_elf

UPROBE_PMU = "/sys/bus/event_source/devices/uprobe"
ROUNDS = 5                        # probed and plain rounds, alternating
CALLS = {"emulated": 200_000, "stepped": 20_000}


def _cache_path() -> str:
    return os.path.join(nativebuild.cache_dir(), "probecost.json")


def _key() -> str:
    from .calibrate import cpu_model
    return f"{cpu_model()}|{platform.release()}"


def _uprobe_attr(path: bytes, offset: int, retprobe: bool) -> tuple[counters.PerfEventAttr, ctypes.Array]:
    try:
        with open(f"{UPROBE_PMU}/type") as f:
            pmu = int(f.read())
        with open(f"{UPROBE_PMU}/format/retprobe") as f:
            ret_bit = int(f.read().strip().split(":")[1])
    except (OSError, ValueError, IndexError):
        raise ProfinferError(f"this kernel has no uprobe PMU ({UPROBE_PMU})") from None
    buf = ctypes.create_string_buffer(path)
    attr = counters.PerfEventAttr(pmu, counters.PerfEventAttr.SIZE_VER5,
                                  (1 << ret_bit) if retprobe else 0)
    attr.config1, attr.config2 = ctypes.addressof(buf), offset
    return attr, buf          # the path buffer must live until the event is open


def _rounds(binary: str, function: str, offset: int, retprobe: bool) -> float:
    """Median probed minus median plain ns per call."""
    calls = CALLS[function]
    proc = subprocess.Popen([binary, function, str(calls), str(2 * ROUNDS)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    plain, probed = [], []
    try:
        for r in range(2 * ROUNDS):
            fd = -1
            if r % 2:
                attr, _buf = _uprobe_attr(binary.encode(), offset, retprobe)
                fd = counters.perf_event_open(attr, proc.pid, -1)
                if fd < 0:
                    raise ProfinferError(f"cannot place a uprobe to measure its cost: "
                                         f"{os.strerror(-fd)}")
            try:
                proc.stdin.write("\n")
                proc.stdin.flush()
                ns = float(proc.stdout.readline())
            finally:
                if fd >= 0:
                    os.close(fd)
            (probed if r % 2 else plain).append(ns)
    finally:
        proc.stdin.close()
        proc.wait(timeout=60)
    return max(statistics.median(probed) - statistics.median(plain), 0.0)


def measure() -> dict:
    binary = nativebuild.build("probecost.c", ["-O2"])
    syms = load_elf(binary).symbols
    off = {f: syms[f"pi_probe_{f}"].file_offset for f in CALLS}
    emulated = _rounds(binary, "emulated", off["emulated"], False)
    stepped = _rounds(binary, "stepped", off["stepped"], False)
    with_return = _rounds(binary, "emulated", off["emulated"], True)
    return {"emulated_ns": round(emulated, 1), "stepped_ns": round(stepped, 1),
            "uretprobe_extra_ns": round(max(with_return - emulated, 0.0), 1)}


def _load() -> dict:
    try:
        with open(_cache_path()) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def calibrate(force: bool = False) -> dict:
    cache = _load()
    if _key() in cache and not force:
        return cache[_key()]
    result = measure()
    cache[_key()] = result
    os.makedirs(nativebuild.cache_dir(), exist_ok=True)
    with open(_cache_path(), "w") as f:
        json.dump(cache, f, indent=2)
    return result


def cached() -> dict | None:
    """The measured costs for this CPU and kernel, if `profinfer calibrate` measured them."""
    return _load().get(_key())
