"""Raw BPF event records (numpy arrays in llamacpp.h's layouts) into profile objects.

Functions of the arrays and a few facts from the target (op names, graph calls): the
collector hands records over as they arrive (ops, kept compact) or when collection ends.
"""
from __future__ import annotations

import numpy as np

from profinfer.engines.llamacpp.probes import ggml
from profinfer.core.profile.model import GraphCall
from profinfer.core.profile.opcolumns import NodeDesc, OpColumns

OP_CHUNK = 8192          # raw op records turned into columns at a time
_NO_CAP = np.iinfo(np.int64).max
# the fields of pi_node_desc
DESC_FIELDS = ("tensor", "ne", "src", "src_view", "fused_tensor", "src0_ne", "src1_ne",
               "op", "fused_op", "type", "src0_type", "src1_type", "name")


def op_name(names: list[str], op: int, fused: int) -> str:
    """An op's name in this build's numbering; a fused pair's as FIRST+SECOND."""
    n = len(names)
    base = names[op] if 0 <= op < n else f"OP{op}"
    if fused >= 0:
        return base + "+" + (names[fused] if fused < n else f"OP{fused}")
    return base


class OpAssembler:
    """Takes pi_node_event and pi_op_event arrays as they arrive and keeps them compact
    (OpColumns' layout): each distinct node's descriptor once, its runs as rows of numbers
    (~50 bytes an op). BPF describes a node once per thread (and again when it changes) and
    numbers it; op events carry (thread, number), resolved to descriptors as they arrive
    (a thread that exits frees its numbering in BPF, and a later thread with its TID starts
    again from 0: the numbers mean what the latest description says)."""

    def __init__(self, op_names: list[str], n_counters: int = 0, consts: dict | None = None):
        self.names = op_names
        self.n_counters = n_counters
        self.consts = consts or {}
        self.pending: list[tuple[np.ndarray, np.ndarray]] = []   # (ops, their descriptor ids)
        self.n_pending = 0
        self.descs: list[NodeDesc] = []
        self.index: dict[bytes, int] = {}        # descriptor bytes -> index in descs
        # Descriptions are turned into NodeDescs when collection ends, not while the target
        # runs, where they would take the collector's CPU from it (bench/results.md).
        self.undescribed: list[np.ndarray | None] = []   # raw pi_node_desc rows in index
        # order; None: a node whose description was lost
        self.n_descs = 0
        # per thread, its node numbers' descriptor indices (-1: not described): op events
        # are resolved with one indexing per thread and drain
        self.numbers: dict[int, np.ndarray] = {}
        self.told: set[int] = set()              # (tid << 32 | index): descriptions sent
        self.n_described = 0                     # node descriptions received
        self.redescribed = 0                     # of them, ones the thread had sent before
        self.shared: dict = {}               # equal tuples and strings shared between descs
        self.chunks: list[tuple] = []
        self.dropped = {"migrated": 0, "unreadable": 0, "not running": 0, "unfinished": 0}

    def add_nodes(self, events: np.ndarray) -> None:
        """pi_node_event records: a thread's number for a node, and what the node is."""
        desc = np.ascontiguousarray(events["desc"])
        rows = desc.view(np.dtype((np.void, desc.dtype.itemsize))).ravel().tolist()
        new: dict[bytes, int] = {}
        for i, key in enumerate(rows):
            if key not in self.index and key not in new:
                new[key] = i
        if new:
            self.undescribed.append(desc[list(new.values())])
            for key in new:
                self.index[key] = self.n_descs
                self.n_descs += 1
        for tid, node, key in zip(events["tid"].tolist(), events["node"].tolist(), rows):
            d = self.index[key]
            self._numbering(tid, node)[node] = d
            # BPF describes a node again when its description changed (a new descriptor
            # here), or when its entry in the thread's table was taken by other tensors:
            # a description the thread had sent before is the table's miss, counted.
            told = (tid << 32) | d
            if told in self.told:
                self.redescribed += 1
            else:
                self.told.add(told)
        self.n_described += len(rows)

    def _numbering(self, tid: int, node: int) -> np.ndarray:
        """Thread tid's table of node numbers, with room for `node`."""
        table = self.numbers.get(tid)
        if table is None or node >= len(table):
            grown = np.full(max(256, 2 * (node + 1)), -1, np.int32)
            if table is not None:
                grown[: len(table)] = table
            table = self.numbers[tid] = grown
        return table

    def add(self, ops: np.ndarray) -> None:
        # only the columns kept are copied out of the events (each is 112 bytes or more)
        counters = None
        if self.n_counters:
            counters, dropped = counter_values(ops, self.n_counters, self.consts)
            for k, v in dropped.items():
                self.dropped[k] += v
        self.pending.append((ops["tid"].astype(np.int64), ops["cpu"].astype(np.int32),
                             ops["start_ns"].astype(np.int64), ops["end_ns"].astype(np.int64),
                             ops["barrier_end_ns"].astype(np.int64),
                             self._desc_ids(ops["tid"], ops["node"]), counters))
        self.n_pending += len(ops)
        if self.n_pending >= OP_CHUNK:
            self._compact()

    def _compact(self) -> None:
        if not self.pending:
            return
        columns = list(zip(*self.pending))
        self.pending, self.n_pending = [], 0
        self.chunks.append(tuple(None if col[0] is None else np.concatenate(col)
                                 for col in columns))

    def _desc_ids(self, tids: np.ndarray, nodes: np.ndarray) -> np.ndarray:
        """Descriptor index per op, as its node's latest description says; a node whose
        description was lost (counted in lost events) gets a descriptor that says so."""
        ids = np.full(len(tids), -1, np.int32)
        # (not np.unique: its first call imports numpy.ma, CPU the collector would take from
        # the running target; bench/results.md)
        for tid in set(tids.tolist()):
            table = self.numbers.get(tid)
            if table is None:
                continue
            sel = tids == tid
            n = nodes[sel]
            ids[sel] = np.where(n < len(table), table[np.minimum(n, len(table) - 1)], -1)
        for i in np.flatnonzero(ids < 0).tolist():
            tid, node = int(tids[i]), int(nodes[i])
            table = self._numbering(tid, node)
            if table[node] < 0:
                table[node] = self.n_descs
                self.n_descs += 1
                self.undescribed.append(None)
            ids[i] = table[node]
        return ids

    def _build_descs(self) -> None:
        for rows in self.undescribed:
            if rows is None:
                self.descs.append(NodeDesc("UNKNOWN", "(description lost)", (0, 0, 0, 0), "?",
                                           0, (), (), 0, (), ()))
            else:
                self.descs += self._describe(rows)
        self.undescribed = []

    def _share(self, x):
        return self.shared.setdefault(x, x)

    def _op_name(self, op: int, fused: int) -> str:
        return op_name(self.names, op, fused)

    def _describe(self, rows: np.ndarray) -> list[NodeDesc]:
        """NodeDescs of raw op records (columns converted at once: this runs per new node)."""
        share, types = self._share, ggml.GGML_TYPES
        col = {f: rows[f].tolist() for f in DESC_FIELDS}
        out = []
        for i in range(len(rows)):
            srcs = col["src"][i]
            n_src = next((k for k in range(3, 0, -1) if srcs[k - 1]), 0)
            t0, t1 = col["src0_type"][i], col["src1_type"][i]
            src_ne = share(tuple(share(tuple(x)) for x, t in ((col["src0_ne"][i], t0),
                                                              (col["src1_ne"][i], t1)) if t >= 0))
            src_dtypes = share(tuple(types.get(t, f"type{t}") for t in (t0, t1) if t >= 0))
            t = col["type"][i]
            out.append(NodeDesc(
                share(self._op_name(col["op"][i], col["fused_op"][i])),
                share(col["name"][i].split(b"\0", 1)[0].decode("utf-8", "replace")),
                share(tuple(col["ne"][i])), types.get(t, f"type{t}"), col["tensor"][i],
                share(tuple(srcs[:n_src])), share(tuple(col["src_view"][i][:n_src])),
                col["fused_tensor"][i], src_ne, src_dtypes))
        return out

    def take_totals(self) -> dict[str, tuple[int, int]]:
        """Per op name, (ops, ns in them) of the ops received since the last take, which are
        then forgotten (a daemon's always-on op level keeps totals, not ops). An op whose end
        is not known yet counts, without time."""
        self._compact()
        chunks, self.chunks = self.chunks, []
        if not chunks:
            return {}
        self._build_descs()
        ids = np.concatenate([c[5] for c in chunks])
        start = np.concatenate([c[2] for c in chunks])
        end = np.concatenate([c[3] for c in chunks])
        dur = np.where(end > start, end - start, 0)
        n = np.bincount(ids, minlength=len(self.descs))
        ns = np.bincount(ids, weights=dur, minlength=len(self.descs))
        out: dict[str, tuple[int, int]] = {}
        for i in np.flatnonzero(n).tolist():
            name = self.descs[i].op
            a, b = out.get(name, (0, 0))
            out[name] = (a + int(n[i]), b + int(ns[i]))
        return out

    def finish(self, graphs: list[GraphCall], experts: dict | None = None) -> OpColumns:
        """All ops as OpColumns sorted by start, with open ends closed against `graphs`."""
        self._compact()
        if not self.chunks:
            return OpColumns.empty()
        cols = [np.concatenate([c[k] for c in self.chunks]) for k in range(6)]
        counters = (np.concatenate([c[6] for c in self.chunks])
                    if self.chunks[0][6] is not None else None)
        self.chunks = []
        order = np.argsort(cols[2], kind="stable")
        tid, cpu, start, end, bend, ids = (c[order] for c in cols)
        if counters is not None:
            counters = counters[order]
        end, bend = close_ends(start, end, bend, graphs)
        self._build_descs()
        return OpColumns(tid, cpu, start, end, bend, ids, self.descs, counters, experts)


def close_ends(start: np.ndarray, end: np.ndarray, bend: np.ndarray, graphs: list[GraphCall]
               ) -> tuple[np.ndarray, np.ndarray]:
    """Ends of ops still open when collection stopped (0), and barrier ends bounded by the
    graph that contains the op."""
    # A thread's last node of a graph is completed only when its next graph starts:
    # its barrier wait ends, at the latest, when the graph that contains it ends.
    backend_graphs = [g for g in graphs if g.backend != "sched"] or graphs
    if backend_graphs:
        gs = np.array([g.start_ns for g in backend_graphs], dtype=np.int64)
        ge = np.array([g.end_ns for g in backend_graphs], dtype=np.int64)
        idx = np.searchsorted(gs, start, side="right") - 1
        inside = (idx >= 0) & (start <= ge[np.clip(idx, 0, None)])
        cap = np.where(inside, ge[np.clip(idx, 0, None)], _NO_CAP)
    else:
        cap = np.full(len(start), _NO_CAP, dtype=np.int64)
    has_cap = cap != _NO_CAP
    # Still in progress when we stopped (no barrier yet): it ran until its graph ended.
    end = np.where(end == 0, np.where(has_cap, cap, start), end)
    # Completed by the thread's next node, or drained at the end: bounded by the graph.
    bend = np.where(bend == 0, np.where(has_cap, cap, end), np.minimum(bend, cap))
    return end, np.maximum(bend, end)


def counter_values(ops: np.ndarray, n_counters: int, consts: dict[str, int]
                   ) -> tuple[np.ndarray, dict[str, int]]:
    """Per op, the counter deltas scaled for multiplexing (a NaN row where dropped); and
    the number of dropped ops by reason."""
    n = n_counters
    ctr = ops["ctr"][:, :n].astype(np.float64)
    en = ops["ctr_enabled"][:, :n].astype(np.float64)
    run = ops["ctr_running"][:, :n].astype(np.float64)
    scaled = np.where(run > 0, ctr * np.where(run > 0, en / np.maximum(run, 1), 0), 0)
    flags = ops["flags"]
    migrated = (flags & consts["PI_OP_MIGRATED"]) != 0
    failed = ((flags & consts["PI_OP_CTR_FAILED"]) != 0) & ~migrated
    unfinished = ((flags & consts["PI_OP_UNFINISHED"]) != 0) & ~migrated & ~failed
    # A counter that did not run at all during the op (multiplexed out) has no value.
    idle = ~migrated & ~failed & ~unfinished & (run == 0).any(axis=1) & (en > 0).any(axis=1)
    dropped = {"migrated": int(migrated.sum()), "unreadable": int(failed.sum()),
               "not running": int(idle.sum()), "unfinished": int(unfinished.sum())}
    scaled[migrated | failed | idle | unfinished] = np.nan
    return scaled, dropped


