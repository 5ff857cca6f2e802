"""What a plug-in (a level, or an engine) adds to the daemon's metrics of each process it
watches (the plug-in's `daemon_metrics` contribution): its counts, kept in one object per
process, fed the plug-in's records by the daemon, copied at each scrape into Prometheus families, and sampled by
the flight recorder. Only the level reads its record kinds: the daemon passes them on."""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Callable, Iterable


@dataclass(frozen=True)
class Added:
    """What a counter gained since the last observation, for an OTLP export: the counter's
    OpenTelemetry name, unit and description, and the attributes besides the process's."""
    name: str
    unit: str
    description: str
    count: int
    attributes: tuple[tuple[str, str], ...] = ()


class ProcessMetrics:
    """One process's counts of a level."""

    def observe(self, counted: list, sent: list) -> None:
        """counted: BPF's cumulative counts of the process, which replace the last ones (empty:
        none were read this time); sent: the records sent since."""
        raise NotImplementedError

    def added(self) -> list[Added]:
        """What its counters gained at the last observe (asked only by an OTLP export)."""
        return []

    def close(self) -> None:
        """The process exited: what it still holds open is counted now (e.g. its requests in
        flight)."""

    def copy(self) -> "ProcessMetrics":
        """A copy to expose at a scrape while the daemon goes on."""
        raise NotImplementedError

    def totals(self) -> dict[str, dict[str, tuple[float, float]]]:
        """Cumulative counts as the flight recorder's baseline samples them: family -> item ->
        (count, seconds)."""
        return {}

    def samples(self) -> dict[str, tuple[int, int]]:
        """Cumulative (calls, ns) of each trigger quantity this level gives (e.g. "sync"): the
        mean of the calls made since the last read is one sample."""
        return {}

    @staticmethod
    def families(processes: list[tuple[list[str], "ProcessMetrics"]], labels: list[str], minimal: bool,
                 printable: Callable[[str], str]) -> Iterable:
        """The level's Prometheus families over the processes (each with its label values):
        every family, with or without samples. `minimal`: no names a tenant chose; a name
        that is the tenant's goes through `printable`."""
        raise NotImplementedError


@dataclass
class Histogram:
    """A Prometheus histogram's counts, kept cheaply: per bucket of `bounds` (the last: over
    them all), and the sum; buckets() gives them cumulative, as the text format has them."""
    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0

    def __post_init__(self):
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, v: float, n: int = 1) -> None:
        self.counts[bisect.bisect_left(self.bounds, v)] += n
        self.total += v * n

    def copy(self) -> "Histogram":
        h = Histogram(self.bounds)
        h.counts, h.total = list(self.counts), self.total
        return h

    def buckets(self) -> list[tuple[str, int]]:
        out, acc = [], 0
        for le, c in zip(list(self.bounds) + [float("inf")], self.counts):
            acc += c
            out.append(("+Inf" if le == float("inf") else repr(float(le)), acc))
        return out
