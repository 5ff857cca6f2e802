"""A quantity's samples of one process, as the triggers read them: in bins of a second, each
bin's newest WINDOW_MAX_SAMPLES while a window may read it, then an even sample of it (what
a baseline reads), as far back as a baseline and its window reach."""
from __future__ import annotations

from collections import deque

import numpy as np

WINDOW_MAX_SAMPLES = 500
BIN_S = 1.0                 # samples are kept in bins of this long
# A bin keeps its newest WINDOW_MAX_SAMPLES (a bound whatever the rate); a baseline reads an
# even sample of at most BASELINE_BIN_SAMPLES of each (its percentile, cheaply, every few s)
BASELINE_BIN_SAMPLES = 100


class Bin:
    """A second's samples: its newest WINDOW_MAX_SAMPLES while the window may read them, then
    an even sample of BASELINE_BIN_SAMPLES (what a baseline reads), and how many came."""
    __slots__ = ("start", "values", "seen")

    def __init__(self, start: float):
        self.start = start
        self.values: deque[float] | np.ndarray = deque(maxlen=WINDOW_MAX_SAMPLES)
        self.seen = 0

    def compact(self) -> None:
        if isinstance(self.values, deque):
            v = np.asarray(self.values, dtype=np.float32)
            self.values = v[::max(1, len(v) // BASELINE_BIN_SAMPLES)][:BASELINE_BIN_SAMPLES]


class Series:
    """One quantity's samples (seconds) of one process, in bins of BIN_S, as far back as a
    baseline and its window reach (horizon_s); a bin older than `recent_s` (the widest a
    window reaches) keeps an even sample of its values."""

    def __init__(self, horizon_s: float, recent_s: float):
        self.horizon_s = horizon_s
        self.recent_s = recent_s
        self.bins: deque[Bin] = deque()

    def add(self, now: float, values: list[float]) -> None:
        start = (now // BIN_S) * BIN_S
        if not self.bins or self.bins[-1].start != start:
            for old in reversed(self.bins):        # out of the window's reach: compacted
                if old.start >= start - self.recent_s - BIN_S:
                    continue
                if not isinstance(old.values, deque):
                    break
                old.compact()
            while self.bins and self.bins[0].start < start - self.horizon_s - BIN_S:
                self.bins.popleft()
            self.bins.append(Bin(start))
        self.bins[-1].values.extend(values)
        self.bins[-1].seen += len(values)

    def since(self, t: float) -> np.ndarray:
        """The samples from the bin that holds t on, oldest first: an even sample of each bin,
        WINDOW_MAX_SAMPLES at most in all (a busy server's whole hold, not its newest moment)."""
        inside = [b for b in self.bins if b.start > t - BIN_S and b.seen]
        if not inside:
            return np.zeros(0)
        each = max(1, WINDOW_MAX_SAMPLES // len(inside))
        return np.concatenate([np.asarray(b.values)[::max(1, -(-len(b.values) // each))] for b in inside])

    def chunks(self, lo: float, hi: float, chunk_s: float,
               left_out: list[tuple[float, float]] = ()) -> tuple[list[np.ndarray], float]:
        """An even sample of the samples of the bins that begin inside [lo, hi) and meet none
        of the spans left out, in chunks of chunk_s back from hi; and how far back the first
        of those bins begins (s before hi)."""
        inside = [b for b in self.bins if lo <= b.start < hi and b.seen
                  and not any(a - BIN_S < b.start < z for a, z in left_out)]
        if not inside:
            return [], 0.0
        chunks: dict[int, list] = {}
        for b in inside:
            chunks.setdefault(int((hi - b.start - 1e-9) // chunk_s), []).append(
                np.asarray(b.values)[::max(1, len(b.values) // BASELINE_BIN_SAMPLES)])
        return [np.concatenate(parts) for _, parts in sorted(chunks.items())], hi - inside[0].start

    def newest(self, since: float, at_least: int = 0, widest: float | None = None) -> tuple[np.ndarray, float]:
        """The samples of the bins from `since` on, WINDOW_MAX_SAMPLES at most, the newest;
        where they are fewer than `at_least`, bins from further back (from `widest` on) until
        they are not. And where the oldest bin read begins."""
        parts, n, oldest = [], 0, since
        for b in reversed(self.bins):
            if n >= WINDOW_MAX_SAMPLES or b.start < since and (n >= at_least or widest is None or b.start < widest):
                break
            if b.seen:
                parts.append(list(b.values)[-(WINDOW_MAX_SAMPLES - n):])
                n += len(parts[-1])
            oldest = min(oldest, b.start)
        return (np.concatenate([np.asarray(p) for p in parts]) if parts else np.zeros(0)), oldest

    def per_bin(self, lo: float, stat: float) -> list[tuple[float, float, int]]:
        """(bin start, the statistic, samples that came) of each bin from lo on (a firing's
        series; an older bin's statistic is its even sample's)."""
        return [(b.start, float(np.percentile(b.values, stat)), b.seen) for b in self.bins
                if b.start >= lo and b.seen]
