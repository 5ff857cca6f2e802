"""A probe hit's trap as the target pays it, measured in the target.

`profinfer calibrate` times traps in a tight loop, where the kernel's uprobe path stays warm;
inside an engine the same trap costs more. So a probe that does nothing (bpf/bare.bpf.c) is
put, for a few alternate windows, at an emulated instruction inside calls the collector
already times (after the entry probe's instruction, in the entry block: on every path to the
return). The calls' time with it, against the same kind of call's time without, is one trap
as the target pays it, and the bare program's run, which the kernel counts. Only short
calls are compared (their time varies least), each against calls of the same kind (op and
argument shapes), by medians.
"""
from __future__ import annotations

import time

import numpy as np

from profinfer.core.ebpf import bpfobj, libbpf
from profinfer.core.base.errors import ProfinferError

PROGRAM = "bare_hit"
WINDOW_S = 0.5          # each window, with the bare probe and without, in turn
WINDOWS = 4             # windows with it; then it is gone for good
SHORT_CALL_NS = 50_000  # calls longer than this vary too much to show a trap
MIN_CALLS = 30          # of one kind, in the windows with it and in those without
EDGE_NS = 20_000_000    # calls this close to an attach or detach are left out


class TrapSampler:
    """The bare probe at `sites` ([(path, file_id, file offsets)]) of process `pid`, attached
    and detached in alternate windows by tick(); `on` holds the windows it was attached
    (CLOCK_MONOTONIC ns, as bpf_ktime_get_ns), `off` those it was not."""

    def __init__(self, sites: list[tuple[str, tuple[int, int] | None, list[int]]], pid: int,
                 variant: str = "ring", windows: int = WINDOWS, window_s: float = WINDOW_S):
        self.windows, self.window_ns = windows, int(window_s * 1e9)
        self.sites = [s for s in sites if s[2]]
        self.pid = pid
        self.obj = libbpf.BpfObject(bpfobj.object_path("bare.bpf.c", variant))
        self.obj.load({PROGRAM})
        self.links: list = []
        self.on: list[tuple[int, int]] = []
        self.off: list[tuple[int, int]] = []
        self._since = time.monotonic_ns()      # the current window's start
        self.error: str | None = None

    @property
    def done(self) -> bool:
        return len(self.on) >= self.windows and not self.links

    def tick(self) -> None:
        """Called as the collector polls: ends the current window once WINDOW_S is past."""
        now = time.monotonic_ns()
        if self.done or self.error or now - self._since < self.window_ns:
            return
        if self.links:
            self.obj.detach_links(self.links)
            self.links = []
            self.on.append((self._since, now))
        else:
            self.off.append((self._since, now))
            try:
                for path, file_id, offsets in self.sites:
                    self.links.append(self.obj.attach_uprobe_multi(
                        PROGRAM, path, offsets, [0] * len(offsets), self.pid, file_id=file_id))
            except ProfinferError as e:          # the file went: no measurement, said
                self.error = str(e)
                self.obj.detach_links(self.links)
                self.links = []
        self._since = time.monotonic_ns()

    def cost(self) -> tuple[int, int]:
        """(runs, ns) of the bare program: its hits, each an emulated trap, are charged."""
        ns, runs = self.obj.program_stats().get(PROGRAM, (0, 0))
        return runs, ns

    def close(self) -> None:
        self.obj.close()
        self.links = []

    def trap_ns(self, start: np.ndarray, end: np.ndarray, kind: np.ndarray,
                bare: tuple[int, int] | None = None) -> tuple[float, int] | None:
        """One trap in the target (ns, less the bare program's run), and the calls it rests
        on; None when too few short calls of one kind fell both in and out of the windows.
        bare: the program's (runs, ns), where they were read before it was closed."""
        runs, ns = bare or self.cost()
        delta = trap_from_windows(start, end, kind, self.on, self.off)
        if delta is None:
            return None
        return max(0.0, delta[0] - (ns / runs if runs else 0.0)), delta[1]


def _inside(start: np.ndarray, end: np.ndarray, windows: list[tuple[int, int]]) -> np.ndarray:
    """Calls wholly inside one of the windows, away from its edges."""
    if not windows:
        return np.zeros(len(start), bool)
    lo = np.array([a for a, _ in windows]) + EDGE_NS
    hi = np.array([b for _, b in windows]) - EDGE_NS
    i = np.searchsorted(lo, start, side="right") - 1
    ok = i >= 0
    i = np.clip(i, 0, None)
    return ok & (start >= lo[i]) & (end <= hi[i])


def trap_from_windows(start: np.ndarray, end: np.ndarray, kind: np.ndarray,
                      on: list[tuple[int, int]], off: list[tuple[int, int]]) -> tuple[float, int] | None:
    """The median short call's time with the bare probe less without it, per kind of call,
    averaged over kinds by the calls behind each (pure logic)."""
    dur = end - start
    short = dur < SHORT_CALL_NS
    with_probe = short & _inside(start, end, on)
    without = short & _inside(start, end, off)
    total, weight = 0.0, 0
    for k in np.unique(kind[with_probe]):
        a, b = dur[with_probe & (kind == k)], dur[without & (kind == k)]
        n = min(len(a), len(b))
        if n < MIN_CALLS:
            continue
        total += (float(np.median(a)) - float(np.median(b))) * n
        weight += n
    return (total / weight, weight) if weight else None
