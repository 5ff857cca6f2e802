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

import numpy as np

from profinfer.core.base import registry
from profinfer.core.calibration.hits import Hit, no_hits, trap_ns
from profinfer.core.profile.model import Profile
from profinfer.core.profile.opcolumns import OpColumns, as_columns


@dataclass(slots=True)
class SelfCost:
    bpf_ns: int                    # our BPF programs' run time (kernel's count)
    bpf_runs: int
    hits: dict[str, int]           # probe hits: "emulated", "stepped", "return" (uretprobe)
    trap_ns: float | None          # hits x their measured cost; None: probe costs not measured
    hit_costs_ns: dict[str, float] | None
    collector_cpu_ns: int | None   # the collector's CPU time, from the target's first decode
    target_cpu_ns: int | None      # the target's, from its first decode (probes included)
    trap_in_situ_ns: float | None = None   # a hit's trap as the target's own timeline shows it
    collector_critical: bool = False       # no CPU free of the target's compute threads
    compute_threads: int = 1
    in_graphs: float = 1.0                 # share of the decoding time inside graph computes
    # each thread's CPU time while probed, and its share of the hits: the probes' time is
    # borne by the threads that take them (None: not known; the whole target's CPU is used)
    thread_cpu_ns: dict[int, int] | None = None
    hit_shares: dict[int, float] | None = None
    thread_waited_ns: dict[int, int] | None = None    # each thread's wait for a CPU meanwhile
    # where trap_in_situ_ns was measured (the recording's meta trap_priced: the engine's own
    # steps, enginetrap.py); None: in the recording itself
    trap_priced: str | None = None

    def _bearers(self) -> dict[int, tuple[float, int]] | None:
        """{tid: (its share of the hits, its CPU ns)} of the threads that took the hits, when
        the recording knows them all (nine tenths of the hits at least); else None."""
        if not self.thread_cpu_ns or not self.hit_shares:
            return None
        known = {t: (w, self.thread_cpu_ns[t]) for t, w in self.hit_shares.items()
                 if t in self.thread_cpu_ns}
        return known if sum(w for w, _ in known.values()) >= 0.9 else None

    def _share(self, added: float) -> float | None:
        """`added` ns of probe time as a share of the time it delayed: each thread that took
        hits bears its part of them against its own CPU time; the shares are averaged by
        the hits (threads that meet at barriers bear alike; a thread that took a few hits
        in little time does not set the figure); the whole target's CPU time where those
        threads are not known."""
        bearers = self._bearers()
        if bearers is None:
            if not self.target_cpu_ns or self.target_cpu_ns <= added:
                return None
            return added / (self.target_cpu_ns - added)
        total = sum(w for w, _ in bearers.values())
        share = 0.0
        for w, cpu in bearers.values():
            if cpu <= added * w:
                return None
            share += w / total * (added * w / (cpu - added * w))
        return share

    @property
    def bearer_threads(self) -> int | None:
        """How many threads took the hits and are charged them (None: not known)."""
        bearers = self._bearers()
        return None if bearers is None else len(bearers)

    def _bearers_cpu_ns(self) -> int | None:
        bearers = self._bearers()
        return None if bearers is None else sum(cpu for _, cpu in bearers.values())

    @property
    def collector_factor(self) -> float:
        """How many threads' time the collector's CPU time costs: with no CPU free, it takes
        a compute thread's CPU, and inside a graph compute every other thread then waits for
        that one at the next barrier; outside one (sampling, batch set-up) nobody else does."""
        if not self.collector_critical:
            return 0.0
        return 1.0 + (self.compute_threads - 1) * self.in_graphs

    @property
    def slowdown(self) -> float | None:
        """What profiling added to the target's time, over its time without: the probes'
        added CPU time, and the collector's where it runs in the target's time
        (collector_factor). Both over the target's CPU time: its threads spin at barriers, so
        a thread's delay inside a graph is every thread's. The traps are costed as measured in the target when the recording shows it
        (trap_in_situ_ns): in a tight calibration loop the kernel's path is warm."""
        probes = self.in_target_share_in_situ
        if probes is None:
            return None
        collector = self.collector_share or 0.0
        return probes + collector * self.collector_factor

    @property
    def in_target_share_in_situ(self) -> float | None:
        if self.trap_in_situ_ns is None or self.hit_costs_ns is None:
            return self.in_target_share
        trap = sum(n * (self.trap_in_situ_ns if kind == "emulated" else self.hit_costs_ns[kind])
                   for kind, n in self.hits.items())
        return self._share(trap + self.bpf_ns)

    @property
    def in_target_ns(self) -> float | None:
        """CPU time the probes added to the target's threads."""
        return None if self.trap_ns is None else self.trap_ns + self.bpf_ns

    @property
    def in_target_share(self) -> float | None:
        """The probes' added time over the target's CPU time without it."""
        added = self.in_target_ns
        return None if added is None else self._share(added)

    @property
    def collector_share(self) -> float | None:
        """The collector's CPU time over that of the threads it delays: those that took the
        hits where known (collector_factor says how many of them wait for it), else the
        whole target's."""
        cpu = self._bearers_cpu_ns() or self.target_cpu_ns
        if self.collector_cpu_ns is None or not cpu:
            return None
        base = cpu - (self.in_target_ns or 0)
        return self._collector_delay_ns() / base if base > 0 else None

    def _collector_delay_ns(self) -> int:
        """The collector's CPU time, or, where the threads that took the hits are known with
        their waits for a CPU, no more than those waits: the collector delays the target
        only where it keeps one of those threads from running (an OpenMP pool's spinning
        worker gives its CPU up for nothing)."""
        bearers = self._bearers()
        if bearers is None or not self.thread_waited_ns:
            return self.collector_cpu_ns
        waited = sum(self.thread_waited_ns.get(t, 0) for t in bearers)
        return min(self.collector_cpu_ns, waited)

    @property
    def collector_delay_bounded(self) -> bool:
        return self._bearers() is not None and bool(self.thread_waited_ns)


def added_ns(counts: dict, trap_costs: dict) -> float:
    """What probes added to their targets' threads, in ns: the kernel-counted BPF run time
    plus each hit's trap by kind. counts: as a collector's cost_counts() gives them (bpf_ns,
    hits_emulated, hits_stepped, hits_return, and trap_in_situ_ns where the collector has
    measured an emulated trap in its target: that prices the emulated hits); trap_costs: as
    probecost gives them (emulated_ns, stepped_ns, uretprobe_extra_ns)."""
    prices = dict(trap_costs)
    prices[Hit.EMULATED.price_key] = counts.get("trap_in_situ_ns") or trap_costs[Hit.EMULATED.price_key]
    return counts.get("bpf_ns", 0) + trap_ns({h.value: counts.get(h.count_key, 0) for h in Hit}, prices)


def program_totals(stats: dict[str, tuple[int, int]]) -> dict[str, int]:
    """The kernel's count of an engine's BPF programs ({program: (ns run, runs)}) as the
    recording's cost:* meta: totals, and runs and ns per run for each program; the hits
    (hits_emulated, hits_stepped, hits_return), which depend on where the engine placed
    its probes, start at 0 for the engine to add."""
    out = {"bpf_ns": sum(ns for ns, _ in stats.values()),
           "bpf_runs": sum(n for _, n in stats.values()),
           **no_hits()}
    for prog, (ns, runs) in sorted(stats.items()):      # as bpftool prog show has them
        out[f"runs:{prog}"] = runs
        if runs:
            out[f"ns_per_run:{prog}"] = ns // runs
    return out


def compute(profile: Profile, hit_costs_ns: dict[str, float] | None) -> SelfCost | None:
    """None when the kernel did not count our programs (statistics refused, or an old trace).
    Computed once per profile and costs (the JSON summary and the report both state it).

    hit_costs_ns: probecost's measurement ("emulated_ns", "stepped_ns", "uretprobe_extra_ns")."""
    key = (len(profile.ops), len(profile.graphs), tuple(sorted(profile.meta.items())),
           tuple(sorted((hit_costs_ns or {}).items())))
    return profile.derived("self_cost", key, lambda: _compute(profile, hit_costs_ns))


def _compute(profile: Profile, hit_costs_ns: dict[str, float] | None) -> SelfCost | None:
    meta = profile.meta
    if "cost:bpf_ns" not in meta:
        return None

    def num(key: str) -> int | None:
        try:
            return int(round(float(meta[key])))
        except (KeyError, ValueError):
            return None

    hits = {h.value: num(f"cost:{h.count_key}") or 0 for h in Hit}
    costs = None
    trap = None
    if hit_costs_ns:
        costs = {h.value: hit_costs_ns[h.price_key] for h in Hit}
        trap = trap_ns(hits, hit_costs_ns)
    def seconds_as_ns(key: str) -> int | None:
        try:
            return int(float(meta[key]) * 1e9)
        except (KeyError, ValueError):
            return None

    cols = as_columns(profile.ops)
    threads = len(cols.thread_ids())
    cpus = num("cpus_online") or 0
    # without the op level the compute threads are not known: the collector's CPU counts
    # once, as if it took a CPU the target needed
    critical = bool(cpus) and threads >= cpus if threads else True
    return SelfCost(num("cost:bpf_ns") or 0, num("cost:bpf_runs") or 0, hits, trap, costs,
                    seconds_as_ns("collector_cpu_decoding_s"), seconds_as_ns("target_cpu_s"),
                    num("trap_in_situ_ns") if "trap_in_situ_ns" in meta else
                    _engines_reading(profile, num("cost:barrier_ns_per_run") or 0, cols),
                    critical, threads or 1, graph_share(profile),
                    threads_cpu_ns(meta.get("threads_cpu_s", "")), hit_shares(profile, cols),
                    threads_cpu_ns(meta.get("threads_waited_s", "")), meta.get("trap_priced"))


def _engines_reading(profile: Profile, barrier_handler_ns: int, cols: OpColumns) -> float | None:
    """One trap's price as the engine's plugin reads it from a recording that does not hold
    it (its `accounting` module), or None."""
    engine = profile.meta.get("engine")
    plugin = next((p for p in registry.engines() if p.title == engine and p.accounting), None)
    return plugin.part("accounting").trap_in_situ_ns(profile, barrier_handler_ns, cols) if plugin else None


def threads_cpu_ns(text: str) -> dict[int, int] | None:
    """The recording's threads_cpu_s ("tid:seconds ..."), as ns by thread."""
    out = {}
    for part in text.split():
        tid, _, secs = part.partition(":")
        try:
            out[int(tid)] = int(float(secs) * 1e9)
        except ValueError:
            return None
    return out or None


def hit_shares(profile: Profile, cols: OpColumns) -> dict[int, float] | None:
    """Each thread's share of the recorded probe hits: its ops (graph nodes) and its calls
    (an engine's native ops, sent or counted), each a hit of its probes; None when neither
    was recorded."""
    counts: dict[int, int] = {}
    if len(cols):
        tids, n = np.unique(cols.tid, return_counts=True)
        counts.update(zip(tids.tolist(), n.tolist()))
    for c in profile.calls:
        counts[c.tid] = counts.get(c.tid, 0) + 1
    for t in profile.call_totals:       # counted, not sent
        counts[t.tid] = counts.get(t.tid, 0) + t.calls
    total = sum(counts.values())
    return {t: n / total for t, n in counts.items()} if total else None


def graph_share(profile: Profile) -> float:
    """The share of the time from the first llama_decode to the last one's end that the
    issuing thread spent inside graph computes (1.0 when graphs were not recorded)."""
    from profinfer.core.profile.stats import innermost_graphs
    if not profile.tokens or not profile.graphs:
        return 1.0
    lo = min(t.start_ns for t in profile.tokens)
    hi = max(t.end_ns for t in profile.tokens)
    inside = sum(min(g.end_ns, hi) - max(g.start_ns, lo) for g in innermost_graphs(profile.graphs)
                 if g.end_ns > lo and g.start_ns < hi)
    return min(1.0, inside / (hi - lo)) if hi > lo else 1.0
