"""`profinfer calibrate`: measure this machine's roofs, check the measurement, cache it.

A small C microbenchmark (profinfer/core/native/roofs.c, built with the system's gcc and OpenMP)
measures read bandwidth, triad bandwidth (shown, not judged) and f32 FMA throughput with N
threads, 7 times each. The memory roof is the read bandwidth (LLM weights are read, not written); the compute roof
is f32 FMA, which is what ggml's CPU matmuls run on (f16 and quantized weights are widened
to it, or to integer dot products of similar width).

A busy machine gives low roofs, and so flattering verdicts for every later recording. So a
measurement is checked before it is kept: other processes' CPU use during it (loadcheck), each
repetition's share of time our threads were on a CPU (roofs.c), and the spread of the best
undisturbed repetitions; and at least two runs must pass (loadcheck.settle). The roofs are
the best undisturbed repetition of the runs that passed. When fewer than two pass in
ATTEMPTS, nothing is cached and UnreliableMeasurement says why. Checked results
are cached per CPU model and thread count in $PROFINFER_CACHE/roofs.json
(~/.cache/profinfer); entries without a check are ignored.
"""
from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import dataclass

from profinfer.core import buildcache, loadcheck, nativebuild
from profinfer.core.errors import ProfinferError
from profinfer.core.loadcheck import UnreliableMeasurement
from profinfer.core.roofline import Roofs

ATTEMPTS = 4            # runs, of which two must pass
MIN_CPU_SHARE = 0.9     # a repetition whose threads ran less than this of its time was disturbed
MIN_STABLE_REPS = 3
SPREAD_LIMIT = 0.10     # the best MIN_STABLE_REPS undisturbed repetitions agree within 10%
FIGURES = ("read_gbps", "triad_gbps", "fma_gflops")
ROOFS = ("read_gbps", "fma_gflops")      # the figures verdicts use, and the check judges


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


def _cache_path() -> str:
    return os.path.join(nativebuild.cache_dir(), "roofs.json")


def run_benchmark(threads: int, mib: int = 256) -> dict:
    """One run of roofs.c: every repetition's figures and CPU shares."""
    binary = nativebuild.build("roofs.c", ["-O3", "-march=native", "-ffast-math", "-fopenmp"])
    # waiting threads spin, so a repetition's CPU share is below 1 only when we were preempted
    env = {**os.environ, "OMP_WAIT_POLICY": "active", "OMP_PROC_BIND": "false"}
    done = subprocess.run([binary, str(threads), str(mib)], capture_output=True, text=True,
                          timeout=300, env=env)
    if done.returncode != 0:
        raise ProfinferError(f"roofline microbenchmark failed (exit {done.returncode})")
    result = json.loads(done.stdout)
    result.pop("sink", None)
    return result


@dataclass
class Measurement:
    roofs: dict[str, float]          # best undisturbed repetition of each figure
    repetitions: int
    undisturbed: dict[str, int]      # per figure: repetitions our threads held their CPUs
    spread: dict[str, float]         # per figure: spread of the best undisturbed repetitions
    load: loadcheck.Load

    @property
    def problems(self) -> list[str]:
        out = [f"the machine was busy: {self.load.describe()}"] if self.load.busy else []
        short = {name: name.split("_")[0] for name in self.roofs}
        preempted = [f"{short[n]} {self.repetitions - self.undisturbed[n]}/{self.repetitions}"
                     for n in ROOFS if self.undisturbed[n] < MIN_STABLE_REPS]
        if preempted:
            out.append(f"our threads were preempted in {', '.join(preempted)} repetitions")
        out += [f"the best {short[n]} repetitions differ by {self.spread[n]:.0%}" for n in ROOFS
                if self.undisturbed[n] >= MIN_STABLE_REPS and self.spread[n] > SPREAD_LIMIT]
        return out

    def describe_check(self) -> str:
        worst = max(self.spread[n] for n in ROOFS)
        return (f"{min(self.undisturbed[n] for n in ROOFS)}/{self.repetitions} repetitions undisturbed, "
                f"best {MIN_STABLE_REPS} within {worst:.1%}, {self.load.describe()}")


def measure(threads: int, mib: int = 256) -> Measurement:
    """One checked run (see `problems` for whether it passed)."""
    with loadcheck.LoadWindow() as window:
        raw = run_benchmark(threads, mib)
    roofs, undisturbed, spread = {}, {}, {}
    for name in FIGURES:
        share = raw[name.split("_")[0] + "_cpu_share"]
        ok = [v for v, s in zip(raw[name], share) if s >= MIN_CPU_SHARE]
        undisturbed[name] = len(ok)
        roofs[name] = max(ok) if ok else max(raw[name])
        spread[name] = loadcheck.spread(ok, MIN_STABLE_REPS)
    return Measurement(roofs, len(raw["read_gbps"]), undisturbed, spread, window.load)


def describe(r: dict) -> str:
    return (f"threads {r['threads']}: read {r['read_gbps']:.1f} GB/s, triad {r['triad_gbps']:.1f} GB/s, "
            f"f32 FMA {r['fma_gflops']:.1f} GFLOP/s (ridge {r['fma_gflops'] / r['read_gbps']:.1f} FLOP/byte)")


def _load() -> dict:
    """The cache, if nobody but root or this user could have written it (else {})."""
    try:
        found = buildcache.load_trusted_json(_cache_path())
    except OSError:
        return {}
    return found if isinstance(found, dict) else {}


def _checked(cache: dict) -> dict:
    return {k: v for k, v in cache.items() if isinstance(v, dict) and "check" in v}


def calibrate(threads: int | None = None, force: bool = False, attempts: int = ATTEMPTS,
              note=lambda msg: None) -> dict:
    """This machine's checked roofs for `threads` threads, measured unless cached (or forced).

    Raises UnreliableMeasurement, caching nothing, when fewer than two runs pass."""
    threads = threads or os.cpu_count() or 1
    cache = _load()
    key = _key(threads)
    if key in _checked(cache) and not force:
        return cache[key]
    runs: list[Measurement] = []

    def run_once():
        runs.append(measure(threads))
        return runs[-1].roofs, runs[-1].problems

    roofs, problems, agreement = loadcheck.settle(run_once, attempts, True, note, "roofs", judged=ROOFS)
    if problems:
        raise UnreliableMeasurement(
            f"roofs not cached after {len(runs)} runs: {'; '.join(problems)}. "
            f"Measured (maybe too low) {describe({'threads': threads, **roofs})}; "
            f"run `profinfer calibrate` again when the machine is idle")
    passed = [m for m in runs if not m.problems]
    entry = {"threads": threads, **{k: round(v, 3) for k, v in roofs.items()},
             "check": f"best of {agreement}; last: {passed[-1].describe_check()}",
             "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    cache[key] = entry
    os.makedirs(nativebuild.cache_dir(), exist_ok=True)
    tmp = f"{_cache_path()}.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(cache, f, indent=2)
    os.replace(tmp, _cache_path())
    return entry


def cached(threads: int) -> dict | None:
    """The checked cache entry for `threads` threads (or the nearest count measured), if any."""
    prefix = f"{cpu_model()}|{os.cpu_count()} cpus|"
    mine = {int(k[len(prefix):].split()[0]): v for k, v in _checked(_load()).items()
            if k.startswith(prefix)}
    if not mine:
        return None
    return mine[min(mine, key=lambda t: (abs(t - threads), -t))]


def cached_roofs(threads: int) -> Roofs | None:
    """The calibrated roofs for `threads` threads (or the nearest count measured), if any."""
    r = cached(threads)
    return None if r is None else Roofs(peak_gflops=r["fma_gflops"], peak_gbps=r["read_gbps"])
