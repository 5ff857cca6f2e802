"""`profinfer calibrate`: measure this machine's roofs once and cache them.

A small C microbenchmark (profinfer/native/roofs.c, built with the system's gcc and OpenMP)
measures read bandwidth, triad bandwidth and f32 FMA throughput with N threads. The memory
roof is the read bandwidth (LLM weights are read, not written); the compute roof is f32 FMA,
which is what ggml's CPU matmuls run on (f16 and quantized weights are widened to it, or to
integer dot products of similar width).

Results are cached per CPU model and thread count in ~/.cache/profinfer/roofs.json; measure
on an otherwise idle machine (a busy one gives lower roofs and so flattering verdicts).
"""
from __future__ import annotations

import json
import os
import subprocess

from . import nativebuild
from .errors import ProfinferError
from .roofline import Roofs


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "Model")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return os.uname().machine


def _key(threads: int) -> str:
    return f"{cpu_model()}|{os.cpu_count()} cpus|{threads} threads"


def measure(threads: int, mib: int = 256) -> dict:
    done = subprocess.run([nativebuild.build("roofs.c", ["-O3", "-march=native", "-ffast-math", "-fopenmp"]),
                           str(threads), str(mib)], capture_output=True, text=True,
                          timeout=300)
    if done.returncode != 0:
        raise ProfinferError(f"roofline microbenchmark failed (exit {done.returncode})")
    result = json.loads(done.stdout)
    result.pop("sink", None)
    return result


def _load() -> dict:
    try:
        with open(os.path.join(nativebuild.cache_dir(), "roofs.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def calibrate(threads: int | None = None, force: bool = False) -> dict:
    threads = threads or os.cpu_count() or 1
    cache = _load()
    key = _key(threads)
    if key in cache and not force:
        return cache[key]
    result = measure(threads)
    cache[key] = result
    os.makedirs(nativebuild.cache_dir(), exist_ok=True)
    with open(os.path.join(nativebuild.cache_dir(), "roofs.json"), "w") as f:
        json.dump(cache, f, indent=2)
    return result


def cached_roofs(threads: int) -> Roofs | None:
    """The calibrated roofs for `threads` threads (or the nearest count measured), if any."""
    cache = _load()
    prefix = f"{cpu_model()}|{os.cpu_count()} cpus|"
    mine = {int(k[len(prefix):].split()[0]): v for k, v in cache.items() if k.startswith(prefix)}
    if not mine:
        return None
    best = min(mine, key=lambda t: (abs(t - threads), -t))
    r = mine[best]
    return Roofs(peak_gflops=r["fma_gflops"], peak_gbps=r["read_gbps"])
