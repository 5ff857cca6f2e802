"""A probe hit's price as a running engine pays it, from the engine's own steps
(`profinfer calibrate --pid`).

In a loop, and inside the calls the collector times (insitu.py), a trap costs what the
kernel's warm path costs. An engine pays more: the trap after its work between two probed
calls comes back to a path its work has evicted (bench/results.md, "Why the engine pays more
than a loop for a trap"), and a probe placed beside the op level's own traps only shows the
warm price. So the price is measured the one way that sees it all: a probe that does
nothing (bpf/bare.bpf.c) at every site of the level priced, for alternate windows, while the
engine's floor level times its steps; the steps' period with the probes against without,
over the probes' hits a step, less the bare program's run, is one hit as the engine pays it.

Steps are compared by their kind (tokens scheduled) against the windows without, each
window's median by kind, each window with the probes against those without beside it; the
pairs' spread gives the figure's standard error. The price is cached (engineprice.py).
"""
from __future__ import annotations

import os
import statistics
import threading
import time

import numpy as np

from profinfer.core.calibration import insitu
from profinfer.core.ebpf import kernel, libbpf
from profinfer.core.base.errors import ProfinferError
from profinfer.core.calibration.loadcheck import UnreliableMeasurement
from profinfer.core.profile.model import Step

EDGE_NS = insitu.EDGE_NS       # steps this close to an attach or detach are left out
MIN_STEPS = 20                 # of one window, to stand for it
MIN_WINDOWS = 3                # with the probes, and without
TICK_S = 0.02


def price(steps: list[Step], on: list[tuple[int, int]], off: list[tuple[int, int]],
          bare_runs: int, bare_ns: int) -> tuple[float, float, int, float, float]:
    """(ns a hit, its standard error, steps compared, hits a step, a step's ns) from the
    engine's steps and the windows with (`on`) and without (`off`) the bare probes (pure
    logic). A step's period runs from its start to the next step's on the same thread."""
    periods: list[tuple[int, int, int]] = []       # (start, period, kind)
    by_tid: dict[int, list[Step]] = {}
    for s in steps:
        by_tid.setdefault(s.tid, []).append(s)
    for mine in by_tid.values():
        mine.sort(key=lambda s: s.start_ns)
        periods += [(a.start_ns, b.start_ns - a.start_ns, a.n_tokens) for a, b in zip(mine, mine[1:])]
    if not periods:
        raise ProfinferError("the engine made no steps meanwhile: price its traps while it serves")
    start = np.array([p[0] for p in periods], np.int64)
    period = np.array([p[1] for p in periods], np.int64)
    kind = np.array([p[2] for p in periods], np.int64)

    def window_of(windows: list[tuple[int, int]]) -> np.ndarray:
        """The window each period lies wholly in, away from its edges (-1: none)."""
        out = np.full(len(start), -1)
        for i, (a, b) in enumerate(windows):
            out[(start >= a + EDGE_NS) & (start + period <= b - EDGE_NS)] = i
        return out

    w_on, w_off = window_of(on), window_of(off)
    base = {k: float(np.median(period[(w_off >= 0) & (kind == k)]))
            for k in np.unique(kind[w_off >= 0])}
    known = np.isin(kind, list(base))
    ratio = np.array([period[i] / base[kind[i]] if known[i] else np.nan for i in range(len(period))])

    def per_window(w: np.ndarray, n: int) -> list[float | None]:
        return [float(np.median(ratio[(w == i) & known]))
                if np.count_nonzero((w == i) & known) >= MIN_STEPS else None for i in range(n)]

    # each window with the probes against the windows without beside it (off[i] came just
    # before on[i], off[i + 1] just after; the last has one): the machine's slow drifts cancel
    r_on, r_off = per_window(w_on, len(on)), per_window(w_off, len(off))
    paired = []
    for i, r in enumerate(r_on):
        around = [x for x in r_off[i:i + 2] if x is not None]
        if r is not None and around:
            paired.append(r - statistics.fmean(around))
    if len(paired) < MIN_WINDOWS:
        raise UnreliableMeasurement(f"too few busy windows ({len(paired)} with the probes beside one without, "
                             f"each of {MIN_STEPS} steps at least; {MIN_WINDOWS} needed): "
                             "price the traps while the engine serves steadily")
    # the hits counted include those while the probes were being placed and removed: the
    # steps they fell in are counted from the placing's start (the window before's end) to
    # the removal's end (the window after's start)
    in_on = np.zeros(len(start), bool)
    for i, (a, b) in enumerate(on):
        lo = off[i][1] if i < len(off) else a
        hi = off[i + 1][0] if i + 1 < len(off) else b
        in_on |= (start >= lo) & (start < hi)
    steps_on = int(np.count_nonzero(in_on))
    if not bare_runs or not steps_on:
        raise ProfinferError("the probes were never hit: the engine made no calls at the sites priced")
    hits_per_step = bare_runs / steps_on
    step_ns = float(np.mean(period[(w_off >= 0) & known]))     # hits_per_step is a mean too
    # the median pair, robust to a window the machine stalled in; its standard error as a
    # normal sample's median's
    slower = statistics.median(paired)
    se = 1.2533 * statistics.stdev(paired) / len(paired) ** 0.5
    per_hit = step_ns / hits_per_step
    compared = int(np.count_nonzero((w_on >= 0) & known) + np.count_nonzero((w_off >= 0) & known))
    return slower * per_hit - bare_ns / bare_runs, se * per_hit, compared, hits_per_step, step_ns


def measure(pid: int, sites: list[tuple[str, tuple[int, int] | None, list[int]]],
            record_steps, windows: int, window_s: float) -> tuple:
    """Bare probes at `sites` of process `pid` in `windows` alternate windows of `window_s`,
    while `record_steps(seconds, on_attached)` records the engine's steps (returns them):
    the windows begin at on_attached(stop), which is given what ends the recording once they
    are done (`seconds` is a backstop). Then price() of what they saw. The probes are gone
    when this returns."""
    stats_fd = libbpf.enable_run_time_stats()     # the bare program's runs are its hits
    if stats_fd < 0:
        raise ProfinferError("the kernel does not count BPF programs' runs here (Linux 5.8+, "
                             "CAP_SYS_ADMIN or sysctl kernel.bpf_stats_enabled=1): no hits to price by")
    stop, started = threading.Event(), {}

    def ticking(sampler: insitu.TrapSampler, end_recording) -> None:
        while not stop.is_set() and not sampler.done and not sampler.error:
            try:
                sampler.tick()
            except Exception as e:            # said by the caller, with the probes detached
                sampler.error = str(e) or type(e).__name__
            time.sleep(TICK_S)
        end_recording()

    def begin(end_recording) -> None:
        sampler = insitu.TrapSampler(sites, pid, kernel.event_buffer_kind("auto"), windows=windows,
                                     window_s=window_s)
        started["sampler"] = sampler
        started["ticker"] = threading.Thread(target=ticking, args=(sampler, end_recording),
                                             name="bare probes", daemon=True)
        started["ticker"].start()

    sampler = None
    try:
        # each window also takes its probes' placing or removal, and a tick's lateness
        steps = record_steps(2 * windows * (window_s + 0.5) + 30, begin)
    finally:
        try:
            stop.set()
            if "ticker" in started:
                started["ticker"].join()
            sampler = started.get("sampler")
            if sampler is not None:
                try:
                    runs, ns = sampler.cost()
                    if sampler.links:     # stopped early: what is still attached, detached
                        sampler.obj.detach_links(sampler.links)
                        sampler.links = []
                finally:
                    sampler.close()
        finally:
            os.close(stats_fd)
    if sampler is None:
        raise ProfinferError("the engine's steps were never recorded: nothing priced")
    if sampler.error:
        raise ProfinferError(f"the bare probes failed: {sampler.error}")
    if len(sampler.on) < windows:
        raise UnreliableMeasurement(f"stopped after {len(sampler.on)} of {windows} windows with the probes: nothing cached")
    return price(steps, sampler.on, sampler.off, runs, ns)
