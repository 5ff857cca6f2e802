"""`profinfer calibrate`: measure this machine's roofs, check the measurement, cache it.

A small C microbenchmark (profinfer/core/calibration/native/roofs.c, built with the system's gcc and OpenMP)
measures read bandwidth, triad bandwidth (shown, not judged) and f32 FMA throughput with N
threads, 7 times each. The memory roof is the read bandwidth (LLM weights are read, not written); the compute roof
is f32 FMA, which is what ggml's CPU matmuls run on (f16 and quantized weights are widened
to it, or to integer dot products of similar width).

It also measures each data cache level's read bandwidth (the roofs of a hierarchical
roofline): every thread reads its own working set of WORKING_SET_SHARE of its share of the
level (sizes and sharing from sysfs), so that the reads hit that level. An entry cached
before these were measured has no "caches"; its verdicts use the DRAM roof alone.

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
from pathlib import Path

from profinfer.core.target import buildcache
from profinfer.core.calibration import loadcheck, nativebuild
from profinfer.core.base.errors import ProfinferError
from profinfer.core.calibration.loadcheck import UnreliableMeasurement
from profinfer.core.calibration.roofline import CacheRoof, Roofs

ATTEMPTS = 4            # runs, of which two must pass
MIN_CPU_SHARE = 0.9     # a repetition whose threads ran less than this of its time was disturbed
MIN_STABLE_REPS = 3
SPREAD_LIMIT = 0.10     # the best MIN_STABLE_REPS undisturbed repetitions agree within 10%
FIGURES = ("read_gbps", "triad_gbps", "fma_gflops")
ROOFS = ("read_gbps", "fma_gflops")      # the figures verdicts use, and the check judges
# A level's working set per thread: this share of what one thread has of it, so that the
# thread's stack, code and the other threads' lines do not push the set out to the next level.
WORKING_SET_SHARE = 0.5
CPU_CACHES = "/sys/devices/system/cpu/cpu0/cache"


@dataclass(frozen=True)
class CacheLevel:
    """A data (or unified) cache level of this machine, as sysfs describes it."""
    name: str            # "L1", "L2", "L3"
    size: int            # bytes of one instance
    sharing: int         # CPUs that share one instance

    def working_set(self, threads: int) -> int:
        """Bytes each of `threads` threads reads to measure this level."""
        return int(WORKING_SET_SHARE * self.size / max(1, min(threads, self.sharing)))

    def capacity(self, threads: int) -> int:
        """Bytes of this level `threads` threads have between them (spread over the CPUs)."""
        cpus = min(threads, os.cpu_count() or 1)
        return self.size * max(1, -(-cpus // self.sharing))


def _cpu_count_of(cpu_list: str) -> int:
    """How many CPUs a sysfs list names ("0-3,8,10-11" -> 7)."""
    n = 0
    for part in filter(None, cpu_list.strip().split(",")):
        lo, _, hi = part.partition("-")
        n += int(hi or lo) - int(lo) + 1
    return n


def _size_bytes(text: str) -> int:
    text = text.strip()
    unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:].upper(), 1)
    return int(text.rstrip("KkMmGg")) * unit


def cache_levels(root: str = CPU_CACHES) -> list[CacheLevel]:
    """This machine's data cache levels, L1 first ([] where sysfs does not say)."""
    found: dict[int, CacheLevel] = {}
    for index in sorted(Path(root).glob("index*")):
        try:
            kind = (index / "type").read_text().strip()
            level = int((index / "level").read_text())
            size = _size_bytes((index / "size").read_text())
            sharing = _cpu_count_of((index / "shared_cpu_list").read_text())
        except (OSError, ValueError):
            continue
        if kind in ("Data", "Unified") and size > 0:
            found[level] = CacheLevel(f"L{level}", size, max(sharing, 1))
    return [found[k] for k in sorted(found)]


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


def run_benchmark(threads: int, mib: int = 256, levels: list[CacheLevel] = ()) -> dict:
    """One run of roofs.c: every repetition's figures and CPU shares (with each of `levels`'
    read bandwidth as "<level>_gbps")."""
    binary = nativebuild.build("roofs.c", ["-O3", "-march=native", "-ffast-math", "-fopenmp"])
    # waiting threads spin, so a repetition's CPU share is below 1 only when we were preempted
    env = {**os.environ, "OMP_WAIT_POLICY": "active", "OMP_PROC_BIND": "false"}
    sets = [f"{c.name}:{c.working_set(threads)}" for c in levels]
    done = subprocess.run([binary, str(threads), str(mib), *sets], capture_output=True, text=True,
                          timeout=300, env=env)
    if done.returncode != 0:
        raise ProfinferError(f"roofline microbenchmark failed (exit {done.returncode})")
    result = json.loads(done.stdout)
    result.pop("sink", None)
    return result


def cache_figures(levels: list[CacheLevel]) -> tuple[str, ...]:
    return tuple(f"{c.name}_gbps" for c in levels)


@dataclass
class Measurement:
    roofs: dict[str, float]          # best undisturbed repetition of each figure
    repetitions: int
    undisturbed: dict[str, int]      # per figure: repetitions our threads held their CPUs
    spread: dict[str, float]         # per figure: spread of the best undisturbed repetitions
    load: loadcheck.Load
    judged: tuple[str, ...] = ROOFS  # the figures the check judges (ROOFS and the caches')

    @property
    def problems(self) -> list[str]:
        out = [f"the machine was busy: {self.load.describe()}"] if self.load.busy else []
        short = {name: name.split("_")[0] for name in self.roofs}
        preempted = [f"{short[n]} {self.repetitions - self.undisturbed[n]}/{self.repetitions}"
                     for n in self.judged if self.undisturbed[n] < MIN_STABLE_REPS]
        if preempted:
            out.append(f"our threads were preempted in {', '.join(preempted)} repetitions")
        out += [f"the best {short[n]} repetitions differ by {self.spread[n]:.0%}" for n in self.judged
                if self.undisturbed[n] >= MIN_STABLE_REPS and self.spread[n] > SPREAD_LIMIT]
        return out

    def describe_check(self) -> str:
        worst = max(self.spread[n] for n in self.judged)
        return (f"{min(self.undisturbed[n] for n in self.judged)}/{self.repetitions} repetitions undisturbed, "
                f"best {MIN_STABLE_REPS} within {worst:.1%}, {self.load.describe()}")


def measure(threads: int, mib: int = 256, levels: list[CacheLevel] = ()) -> Measurement:
    """One checked run (see `problems` for whether it passed)."""
    with loadcheck.LoadWindow() as window:
        raw = run_benchmark(threads, mib, levels)
    roofs, undisturbed, spread = {}, {}, {}
    for name in FIGURES + cache_figures(levels):
        share = raw[name.split("_")[0] + "_cpu_share"]
        ok = [v for v, s in zip(raw[name], share) if s >= MIN_CPU_SHARE]
        undisturbed[name] = len(ok)
        roofs[name] = max(ok) if ok else max(raw[name])
        spread[name] = loadcheck.spread(ok, MIN_STABLE_REPS)
    return Measurement(roofs, len(raw["read_gbps"]), undisturbed, spread, window.load,
                       ROOFS + cache_figures(levels))


def describe(r: dict) -> str:
    caches = ", ".join(f"{c['level']} {c['gbps']:.1f} GB/s" for c in r.get("caches", ()))
    return (f"threads {r['threads']}: read {r['read_gbps']:.1f} GB/s, triad {r['triad_gbps']:.1f} GB/s, "
            f"f32 FMA {r['fma_gflops']:.1f} GFLOP/s (ridge {r['fma_gflops'] / r['read_gbps']:.1f} FLOP/byte); "
            + (f"cache reads {caches}" if caches else "cache roofs not measured"))


def _load() -> dict:
    """The cache, if nobody but root or this user could have written it (else {})."""
    return buildcache.load_trusted_dict(_cache_path())


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
    levels = cache_levels()

    def run_once():
        runs.append(measure(threads, levels=levels))
        return runs[-1].roofs, runs[-1].problems

    roofs, problems, agreement = loadcheck.settle(run_once, attempts, True, note, "roofs",
                                                  judged=ROOFS + cache_figures(levels))
    figures = {k: round(roofs.pop(k), 3) for k in FIGURES}
    caches = [{"level": c.name, "gbps": round(roofs[f"{c.name}_gbps"], 3), "bytes": c.capacity(threads),
               "working_set_bytes": c.working_set(threads)} for c in levels]
    if problems:
        raise UnreliableMeasurement(
            f"roofs not cached after {len(runs)} runs: {'; '.join(problems)}. "
            f"Measured (maybe too low) {describe({'threads': threads, **figures, 'caches': caches})}; "
            f"run `profinfer calibrate` again when the machine is idle")
    passed = [m for m in runs if not m.problems]
    entry = {"threads": threads, **figures, "caches": caches,
             "check": f"best of {agreement}; last: {passed[-1].describe_check()}",
             "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    buildcache.store_entry(_cache_path(), key, entry)
    return entry


def cached(threads: int) -> dict | None:
    """The checked cache entry for `threads` threads (or the nearest count measured), if any."""
    prefix = f"{cpu_model()}|{os.cpu_count()} cpus|"
    mine = {int(k[len(prefix):].split()[0]): v for k, v in _checked(_load()).items()
            if k.startswith(prefix)}
    if not mine:
        return None
    return mine[min(mine, key=lambda t: (abs(t - threads), -t))]


def entry_roofs(entry: dict) -> Roofs:
    """The roofs of a cached entry (one cached before the caches were measured: DRAM only)."""
    caches = tuple(CacheRoof(c["level"], float(c["gbps"]), int(c["bytes"])) for c in entry.get("caches", ()))
    return Roofs(peak_gflops=entry["fma_gflops"], peak_gbps=entry["read_gbps"], caches=caches)


def cached_roofs(threads: int) -> Roofs | None:
    """The calibrated roofs for `threads` threads (or the nearest count measured), if any."""
    r = cached(threads)
    return None if r is None else entry_roofs(r)
