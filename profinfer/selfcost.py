"""What profiling cost the target, from what the kernel counted (pure logic).

The probes' cost lands in the target's own threads: each hit traps into the kernel (a cost
`profinfer calibrate` measures per kind of probe, see probecost) and runs our BPF program
(the kernel counts that time while run-time statistics are on). The collector's CPU time is
the other part: on a machine whose cores the inference threads fill, it is taken from them.
Both are reported as shares of the CPU time the target used meanwhile. This resolves a
fraction of a percent where a timed A/B comparison on a noisy machine cannot.
"""
from __future__ import annotations

from dataclasses import dataclass

from .model import Profile


@dataclass(slots=True)
class SelfCost:
    bpf_ns: int                    # our BPF programs' run time (kernel's count)
    bpf_runs: int
    hits: dict[str, int]           # probe hits: "emulated", "stepped", "return" (uretprobe)
    trap_ns: float | None          # hits x their measured cost; None: probe costs not measured
    hit_costs_ns: dict[str, float] | None
    collector_cpu_ns: int | None   # the collector's CPU time, from the target's first decode
    target_cpu_ns: int | None      # the target's, from its first decode (probes included)

    @property
    def in_target_ns(self) -> float | None:
        """CPU time the probes added to the target's threads."""
        return None if self.trap_ns is None else self.trap_ns + self.bpf_ns

    @property
    def in_target_share(self) -> float | None:
        """The probes' added time over the target's CPU time without it."""
        added = self.in_target_ns
        if added is None or not self.target_cpu_ns or self.target_cpu_ns <= added:
            return None
        return added / (self.target_cpu_ns - added)

    @property
    def collector_share(self) -> float | None:
        if self.collector_cpu_ns is None or not self.target_cpu_ns:
            return None
        base = self.target_cpu_ns - (self.in_target_ns or 0)
        return self.collector_cpu_ns / base if base > 0 else None


def compute(profile: Profile, hit_costs_ns: dict[str, float] | None) -> SelfCost | None:
    """None when the kernel did not count our programs (statistics refused, or an old trace).

    hit_costs_ns: probecost's measurement ("emulated_ns", "stepped_ns", "uretprobe_extra_ns")."""
    meta = profile.meta
    if "cost:bpf_ns" not in meta:
        return None

    def num(key: str) -> int | None:
        try:
            return int(round(float(meta[key])))
        except (KeyError, ValueError):
            return None

    hits = {k: num(f"cost:hits_{k}") or 0 for k in ("emulated", "stepped", "return")}
    costs = None
    trap = None
    if hit_costs_ns:
        costs = {"emulated": hit_costs_ns["emulated_ns"], "stepped": hit_costs_ns["stepped_ns"],
                 "return": hit_costs_ns["uretprobe_extra_ns"]}
        trap = sum(hits[k] * costs[k] for k in hits)
    def seconds_as_ns(key: str) -> int | None:
        try:
            return int(float(meta[key]) * 1e9)
        except (KeyError, ValueError):
            return None

    return SelfCost(num("cost:bpf_ns") or 0, num("cost:bpf_runs") or 0, hits, trap, costs,
                    seconds_as_ns("collector_cpu_decoding_s"), seconds_as_ns("target_cpu_s"))
