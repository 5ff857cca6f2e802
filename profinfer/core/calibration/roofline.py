"""Roofline without a PMU: verdicts from FLOPs and bytes an engine's cost model gives each op
run (pure logic).

With the runs' measured time this gives achieved GFLOP/s and GB/s, and against the
machine's calibrated roofs (profinfer calibrate) a verdict:
- memory-bound: arithmetic intensity below the ridge point and at least MIN_ROOF_SHARE of
  the bandwidth roof reached;
- compute-bound: intensity above the ridge and at least MIN_ROOF_SHARE of the compute roof;
- neither (latency/overhead-bound): far from the roof its intensity points at (synchronisation,
  dispatch, too little work per thread).

An engine's cost model counts the bytes an op must move at least once (sources read, result
written); re-reads of data that does not stay in cache are not in them, so achieved GB/s is
a lower bound and a memory-bound verdict is conservative.

The roofline is hierarchical: an op whose data stays in a cache reads it faster than DRAM
can deliver, so its achieved GB/s can pass the DRAM roof. Such an op is judged against the
roof that bounds it: the lowest cache roof at or above its GB/s among the caches that can
hold its data (usually the outermost level that can deliver it, L3 before L2 before L1),
with its share of that roof and a note "above the DRAM roof: cache-resident (L3)". A share
above 100% is shown only when the op beats every roof that could hold its data, and the
note says so.

Which caches can hold an op's data: where the engine knows which tensors each op reads
and when they were last touched (SourceReuse), each cache where at least RESIDENT_SHARE of
the bytes it reads have a reuse distance within the cache's capacity; an op past the DRAM
roof, however far, whose data no cache holds (a model's weights, read once a token) is
judged against DRAM, with a note. Where the engine does not know, every cache, and an op
within DRAM_MARGIN past the DRAM roof is judged against it, with a note saying so.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

MIN_ROOF_SHARE = 0.4
# The DRAM roof is one benchmark's read pattern: an engine's streaming reads may pass it a
# little (a 1.5B model's 3 GB of weights, that no cache holds, read at 101.5% of this host's
# read roof, where its triad reached 122%). Where an op's sources are not known, one up to
# this far past it is at that roof.
DRAM_MARGIN = 0.10
# A cache serves an op when at least this share of the bytes it reads were touched within the
# cache's capacity before.
RESIDENT_SHARE = 0.5


@dataclass(frozen=True, slots=True)
class Cost:
    flops: float
    bytes: float

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes if self.bytes else 0.0


@dataclass(frozen=True, slots=True)
class CacheRoof:
    level: str               # "L1", "L2", "L3"
    gbps: float              # read bandwidth of a working set held in this level, all threads
    bytes: int               # the level's capacity the measuring threads had between them


@dataclass(frozen=True, slots=True)
class SourceReuse:
    """The bytes a scope's op runs read from sources touched before, each with its reuse
    distance: about the bytes that passed through the caches since. The engine's estimate
    (e.g. from its cost model's moves): an approximation, not a bound."""
    distances: np.ndarray    # float64
    bytes: np.ndarray        # float64

    def share_within(self, capacity: float) -> float:
        total = float(self.bytes.sum())
        return float(self.bytes[self.distances <= capacity].sum()) / total if total else 0.0


@dataclass(slots=True)
class Roofs:
    peak_gflops: float       # compute roof (f32 FMA, all threads)
    peak_gbps: float         # memory roof (DRAM read bandwidth, all threads)
    caches: tuple[CacheRoof, ...] = ()    # lowest level first; () when not measured

    @property
    def ridge(self) -> float:
        return self.peak_gflops / self.peak_gbps


@dataclass(slots=True)
class Verdict:
    scope: str
    nodes: int
    time_ns: int
    flops: float
    bytes: float
    gflops: float
    gbps: float
    intensity: float
    bound: str               # "memory", "compute" or "neither"
    roof_share: float        # achieved / the roof it is judged against
    roof: str                # that roof: "DRAM", a cache level ("L2"), or "compute"
    roof_gbps: float | None  # its bandwidth (None for the compute roof)
    # cross-check where the PMU counts LLC load misses: DRAM read bandwidth they imply
    # (lines × 64 B over the counted nodes' time); None without that counter
    measured_gbps: float | None = None
    notes: list[str] = field(default_factory=list)


LINE_BYTES = 64

# One op run as the verdicts take it: its cost (None: unknown), duration, counter values;
# or runs counted together (their summed cost and duration, no counters, and how many).
CostedRun = tuple[Cost | None, int, tuple | None] | tuple[Cost | None, int, None, int]


def judge_costs(scope: str, items: Iterable[CostedRun], roofs: Roofs, llc_miss_index: int | None = None,
                reuse: SourceReuse | None = None) -> Verdict | None:
    """One verdict for a set of op runs (e.g. decode MUL_MAT): totals, then the roof.
    `llc_miss_index`: position of LLC-load-misses in the runs' counters, for the cross-check;
    `reuse`: where the runs' sources were last touched, when the engine knows."""
    flops = bytes_ = 0.0
    time_ns = 0
    counted = 0
    miss_lines, miss_ns = 0.0, 0
    for cost, dur_ns, counters, *runs in items:
        if cost is None or dur_ns <= 0:
            continue
        flops += cost.flops
        bytes_ += cost.bytes
        time_ns += dur_ns
        counted += runs[0] if runs else 1
        if llc_miss_index is not None and counters is not None:
            miss_lines += counters[llc_miss_index]
            miss_ns += dur_ns
    if not counted or not time_ns:
        return None
    gflops, gbps = flops / time_ns, bytes_ / time_ns       # per ns = G per s
    intensity = flops / bytes_ if bytes_ else float("inf")
    notes: list[str] = []
    if intensity < roofs.ridge:
        side, (roof, roof_gbps) = "memory", memory_roof(gbps, roofs, notes, reuse)
        share = gbps / roof_gbps
    else:
        side, roof, roof_gbps, share = "compute", "compute", None, gflops / roofs.peak_gflops
    bound = side if share >= MIN_ROOF_SHARE else "neither"
    measured = miss_lines * LINE_BYTES / miss_ns if miss_ns else None
    return Verdict(scope, counted, time_ns, flops, bytes_, gflops, gbps, intensity, bound, share,
                   roof, roof_gbps, measured, notes)


def memory_roof(gbps: float, roofs: Roofs, notes: list[str], reuse: SourceReuse | None = None
                ) -> tuple[str, float]:
    """The bandwidth roof that bounds an op reading at `gbps` (its name and GB/s): DRAM's
    when it is at or below it; past it, a cache's where `reuse` says the data could stay in
    one (the lowest cache roof at or above its GB/s among those), DRAM's where `reuse` says no
    cache measured holds it; without `reuse`, DRAM's within DRAM_MARGIN past it, else the
    lowest cache roof at or above it; else (above every roof measured) the highest. Appends to
    `notes` why, when not DRAM's or past it."""
    if gbps <= roofs.peak_gbps:
        return "DRAM", roofs.peak_gbps
    past = gbps / roofs.peak_gbps - 1
    if not roofs.caches:
        notes.append("above the DRAM roof: its data stays in cache, but the cache roofs were not "
                     "measured (`profinfer calibrate --force` measures them)")
        return "DRAM", roofs.peak_gbps
    if reuse is None:
        if past <= DRAM_MARGIN:
            notes.append(f"at the DRAM roof: past it by {past:.1%}, within "
                         f"{DRAM_MARGIN:.0%} of the read benchmark")
            return "DRAM", roofs.peak_gbps
        held = list(roofs.caches)
    else:
        held = [c for c in roofs.caches if reuse.share_within(c.bytes) >= RESIDENT_SHARE]
        if not held:
            largest = max(roofs.caches, key=lambda c: c.bytes)
            notes.append(f"at the DRAM roof: past it by {past:.1%}, yet "
                         f"{1 - reuse.share_within(largest.bytes):.0%} of the bytes it reads were "
                         f"last touched more than {largest.level}'s {largest.bytes / 2**20:g} MiB "
                         f"before: no cache measured holds them")
            return "DRAM", roofs.peak_gbps
    above = [c for c in held if c.gbps >= gbps]
    if above:
        c = min(above, key=lambda c: c.gbps)
        notes.append(f"above the DRAM roof: cache-resident ({c.level})")
        return c.level, c.gbps
    c = max(held, key=lambda c: c.gbps)
    notes.append(f"above every measured roof that could hold its data, {c.level}'s {c.gbps:,.1f} GB/s "
                 f"included: the cost model's bytes or the roofs are wrong")
    return c.level, c.gbps


def llc_miss_index(counter_names: list[str]) -> int | None:
    """Where LLC-load-misses is among a recording's counters (the cross-check), if it is."""
    return counter_names.index("LLC-load-misses") if "LLC-load-misses" in counter_names else None


def judge_groups(groups: dict[str, list[CostedRun]], roofs: Roofs, counter_names: list[str],
                 reuse: dict[str, SourceReuse] | None = None) -> list[Verdict]:
    """A verdict per scope ("decode MUL_MAT": phase and op), largest time first; `reuse`: the
    scopes' sources' reuse distances, where the engine knows them."""
    llc = llc_miss_index(counter_names)
    reuse = reuse or {}
    out = [v for scope, items in groups.items()
           if (v := judge_costs(scope, items, roofs, llc, reuse.get(scope))) is not None]
    out.sort(key=lambda v: -v.time_ns)
    return out
