"""A log-linear histogram of durations, as BPF keeps one where calls are counted, not sent
(an engine's op level without a timeline): below SUB ns one bucket a nanosecond, then SUB
buckets for each power of two up to 2^MAX_LOG2 ns, so a bucket's midpoint is within
1 / (2 SUB) of any duration in it. Percentiles are read from the counts."""
from __future__ import annotations

import numpy as np

SUB = 8
MAX_LOG2 = 40
BUCKETS = SUB * (MAX_LOG2 - 2) + SUB
SUB_BITS = SUB.bit_length() - 1
# the largest relative error of a percentile read at a bucket's midpoint
PRECISION = 1 / (2 * SUB)


def lower_bounds() -> np.ndarray:
    """Each bucket's smallest duration (ns)."""
    b = np.arange(BUCKETS)
    exp = b // SUB + SUB_BITS - 1
    low = (SUB + b % SUB) << np.maximum(exp - SUB_BITS, 0)
    return np.where(b < SUB, b, low).astype(np.float64)


def midpoints() -> np.ndarray:
    low = lower_bounds()
    high = np.append(low[1:], low[-1] * (1 + 1 / SUB))
    return np.where(np.arange(BUCKETS) < SUB, low, (low + high) / 2)


def bucket_of(ns: np.ndarray) -> np.ndarray:
    """The bucket of each duration, as BPF chooses it."""
    ns = np.maximum(np.asarray(ns, dtype=np.int64), 0)
    exp = np.zeros(len(ns), np.int64)
    big = ns >= SUB
    exp[big] = np.floor(np.log2(ns[big].astype(np.float64))).astype(np.int64)
    # float log2 can round up just below a power of two
    over = big & ((np.int64(1) << exp) > ns)
    exp[over] -= 1
    out = ns.copy()
    sub = (ns[big] >> (exp[big] - SUB_BITS)) & (SUB - 1)
    out[big] = SUB * (exp[big] - SUB_BITS + 1) + sub
    out[big & (exp > MAX_LOG2)] = BUCKETS - 1
    return out


def add(counts: np.ndarray, ns: np.ndarray) -> np.ndarray:
    """counts with these durations added."""
    return counts + np.bincount(bucket_of(ns), minlength=BUCKETS)[:BUCKETS]


def percentiles(counts: np.ndarray, qs: list[float]) -> list[float]:
    """The q-th percentiles (0-100) of the durations counted, at their buckets' midpoints."""
    total = int(counts.sum())
    if not total:
        return [float("nan")] * len(qs)
    cum = np.cumsum(counts)
    mids = midpoints()
    return [float(mids[min(int(np.searchsorted(cum, max(q / 100 * total, 1), side="left")), BUCKETS - 1)])
            for q in qs]
