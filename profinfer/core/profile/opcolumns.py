"""Op slices stored as columns: how a Profile holds millions of ops in little memory.

The same graph nodes are computed token after token, so what describes a node (op, tensor
name, shapes, types, edges) is kept once per distinct node in `descs`, and each op is a row
of numbers: thread, CPU, times, the index of its descriptor, its counter values. That is
~50 bytes an op instead of ~1 KB of Python objects. Analyses read the columns; code that
wants objects iterates and gets OpSlices made on the fly.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import NamedTuple

import numpy as np

from profinfer.core.profile.model import OpSlice

ITER_CHUNK = 4096


class NodeDesc(NamedTuple):
    """What an OpSlice says about its node (its fields from op to src_dtypes)."""
    op: str
    name: str
    ne: tuple[int, ...]
    dtype: str
    tensor: int
    srcs: tuple[int, ...]
    src_views: tuple[int, ...]
    fused_tensor: int
    src_ne: tuple[tuple[int, ...], ...]
    src_dtypes: tuple[str, ...]


def desc_of(o: OpSlice) -> NodeDesc:
    return NodeDesc(o.op, o.name, o.ne, o.dtype, o.tensor, o.srcs, o.src_views, o.fused_tensor,
                    o.src_ne, o.src_dtypes)


class OpColumns(Sequence):
    """A sequence of OpSlice kept as columns (row i is op i; order as built, by start in a
    collected profile).

    `counters`: (n, len(counter_names)) scaled deltas, a NaN row where the op was not
    counted; None when no counters were asked for. `experts`: MUL_MAT_ID routing by
    (tid, start_ns).
    """

    __slots__ = ("tid", "cpu", "start", "end", "barrier_end", "desc", "descs", "counters",
                 "experts")

    def __init__(self, tid, cpu, start, end, barrier_end, desc, descs: list[NodeDesc],
                 counters: np.ndarray | None = None, experts: dict | None = None):
        self.tid = np.asarray(tid, np.int64)
        self.cpu = np.asarray(cpu, np.int32)
        self.start = np.asarray(start, np.int64)
        self.end = np.asarray(end, np.int64)
        self.barrier_end = np.asarray(barrier_end, np.int64)
        self.desc = np.asarray(desc, np.int32)
        self.descs = descs
        self.counters = counters
        self.experts = experts or {}

    @classmethod
    def empty(cls) -> OpColumns:
        z = np.zeros(0, np.int64)
        return cls(z, z, z, z, z, z, [])

    @classmethod
    def from_slices(cls, slices: Iterable[OpSlice]) -> OpColumns:
        slices = list(slices)
        n = len(slices)
        index: dict[NodeDesc, int] = {}
        desc = np.fromiter((index.setdefault(desc_of(o), len(index)) for o in slices), np.int32, n)

        def col(attr: str) -> np.ndarray:
            return np.fromiter((getattr(o, attr) for o in slices), np.int64, n)

        widths = {len(o.counters) for o in slices if o.counters is not None}
        counters = None
        if widths:
            counters = np.full((n, max(widths)), np.nan)
            for i, o in enumerate(slices):
                if o.counters is not None:
                    counters[i, :len(o.counters)] = o.counters
        experts = {(o.tid, o.start_ns): o.experts for o in slices if o.experts}
        return cls(col("tid"), col("cpu"), col("start_ns"), col("end_ns"), col("barrier_end_ns"),
                   desc, list(index), counters, experts)

    # ---- sequence of OpSlice ----

    def __len__(self) -> int:
        return len(self.start)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return self.take(np.arange(len(self))[i])
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        return self._slices(i, i + 1)[0]

    def __iter__(self) -> Iterator[OpSlice]:
        for lo in range(0, len(self), ITER_CHUNK):
            yield from self._slices(lo, lo + ITER_CHUNK)

    def __eq__(self, other) -> bool:
        """Equal to any sequence of the same OpSlices (a list, other columns)."""
        if not isinstance(other, Sequence) or isinstance(other, (str, bytes)):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other))

    __hash__ = None

    def __repr__(self) -> str:
        return f"OpColumns({len(self)} ops, {len(self.descs)} distinct nodes)"

    def _slices(self, lo: int, hi: int) -> list[OpSlice]:
        descs, experts = self.descs, self.experts
        tid, start = self.tid[lo:hi].tolist(), self.start[lo:hi].tolist()
        rows = zip(tid, self.cpu[lo:hi].tolist(), start, self.end[lo:hi].tolist(),
                   self.barrier_end[lo:hi].tolist(), self.desc[lo:hi].tolist(),
                   self.counter_tuples(lo, hi))
        return [OpSlice(t, c, s, e, b, *descs[d], ctr,
                        experts.get((t, s)) if experts else None)
                for t, c, s, e, b, d, ctr in rows]

    def counter_tuples(self, lo: int = 0, hi: int | None = None) -> list[tuple | None]:
        """Per op, its counter values as a tuple, or None where not counted."""
        hi = len(self) if hi is None else hi
        if self.counters is None:
            return [None] * (min(hi, len(self)) - lo)
        block = self.counters[lo:hi]
        ok = ~np.isnan(block).any(axis=1)
        return [tuple(v) if k else None for v, k in zip(block.tolist(), ok.tolist())]

    def take(self, idx: np.ndarray) -> OpColumns:
        """The ops at `idx`, in that order (sharing the descriptors)."""
        return OpColumns(self.tid[idx], self.cpu[idx], self.start[idx], self.end[idx],
                         self.barrier_end[idx], self.desc[idx], self.descs,
                         None if self.counters is None else self.counters[idx], self.experts)

    # ---- what the descriptors say, per op ----

    def op_codes(self) -> tuple[np.ndarray, list[str]]:
        """Per op, a code indexing the returned op names (in order of first descriptor)."""
        index: dict[str, int] = {}
        per_desc = np.fromiter((index.setdefault(d.op, len(index)) for d in self.descs),
                               np.int64, len(self.descs))
        return per_desc[self.desc] if len(self.desc) else np.zeros(0, np.int64), list(index)

    def counted(self) -> np.ndarray:
        """Per op: were its counters read."""
        if self.counters is None:
            return np.zeros(len(self), bool)
        return ~np.isnan(self.counters).any(axis=1)

    def thread_ids(self) -> list[int]:
        return np.unique(self.tid).tolist()


def as_columns(ops: Sequence[OpSlice]) -> OpColumns:
    """`ops` as columns: itself when it already is, else converted (slices made by hand or
    read from a trace)."""
    return ops if isinstance(ops, OpColumns) else OpColumns.from_slices(ops)
