"""Raw BPF event records (numpy arrays in events.h's layouts) into profile objects.

Pure functions of the arrays and a few facts from the target (op names, graph calls): the
collector gathers records and calls these when collection ends.
"""
from __future__ import annotations

import numpy as np

from . import ggml
from .model import GraphCall, OpSlice, SchedSwitch, SchedWakeup

OP_CHUNK = 8192          # ops turned into OpSlices at a time
_NO_CAP = np.iinfo(np.int64).max


def op_slices(ops: np.ndarray, graphs: list[GraphCall], op_names: list[str],
              counted: list | None = None,
              experts: dict[tuple[int, int], tuple] | None = None) -> list[OpSlice]:
    """OpSlices, one per pi_op_event record of `ops`, which the caller sorted by start_ns
    (counter_values() must see the same order).

    `counted`: per op, counter values or None (counter_values()).
    `experts`: MoE routing by (tid, op start).
    """
    start = ops["start_ns"].astype(np.int64)
    end = ops["end_ns"].astype(np.int64)
    bend = ops["barrier_end_ns"].astype(np.int64)
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
        cap = np.full(len(ops), _NO_CAP, dtype=np.int64)
    has_cap = cap != _NO_CAP
    # Still in progress when we stopped (no barrier yet): it ran until its graph ended.
    end = np.where(end == 0, np.where(has_cap, cap, start), end)
    # Completed by the thread's next node, or drained at the end: bounded by the graph.
    bend = np.where(bend == 0, np.where(has_cap, cap, end), np.minimum(bend, cap))
    bend = np.maximum(bend, end)
    builder = _SliceBuilder(op_names, experts or {})
    out: list[OpSlice] = []
    # In chunks: the Python lists of one chunk's columns are transient, not the whole run's.
    for lo in range(0, len(ops), OP_CHUNK):
        hi = lo + OP_CHUNK
        builder.add(ops[lo:hi], start[lo:hi], end[lo:hi], bend[lo:hi],
                    counted[lo:hi] if counted is not None else None, out)
    return out


class _SliceBuilder:
    """Equal tuples and strings are shared between slices: the same nodes repeat token after
    token, so a long run holds few distinct values."""

    def __init__(self, op_names: list[str], experts: dict):
        self.names, self.experts = op_names, experts
        self.shared: dict = {}

    def share(self, x):
        return self.shared.setdefault(x, x)

    def op_name(self, op: int, fused: int) -> str:
        names, n = self.names, len(self.names)
        base = names[op] if 0 <= op < n else f"OP{op}"
        if fused >= 0:
            return base + "+" + (names[fused] if fused < n else f"OP{fused}")
        return base

    def add(self, ops, start, end, bend, counted, out: list[OpSlice]) -> None:
        share, types, shared, experts = self.share, ggml.GGML_TYPES, self.shared, self.experts
        cols = {k: ops[k].tolist() for k in ("tid", "cpu", "op", "fused_op", "type", "tensor",
                                             "fused_tensor", "src0_type", "src1_type")}
        ne, src, src_view = ops["ne"].tolist(), ops["src"].tolist(), ops["src_view"].tolist()
        src0_ne, src1_ne = ops["src0_ne"].tolist(), ops["src1_ne"].tolist()
        names_raw = ops["name"].tolist()
        start_l, end_l, bend_l = start.tolist(), end.tolist(), bend.tolist()
        for i in range(len(ops)):
            tname = shared.get(names_raw[i])
            if tname is None:
                tname = shared[names_raw[i]] = names_raw[i].split(b"\0", 1)[0].decode("utf-8", "replace")
            srcs_i = src[i]
            n_src = next((k for k in range(3, 0, -1) if srcs_i[k - 1]), 0)
            t0, t1 = cols["src0_type"][i], cols["src1_type"][i]
            src_ne = share(tuple(share(tuple(x)) for x, t in ((src0_ne[i], t0), (src1_ne[i], t1)) if t >= 0))
            src_dtypes = share(tuple(types.get(t, f"type{t}") for t in (t0, t1) if t >= 0))
            t = cols["type"][i]
            out.append(OpSlice(cols["tid"][i], cols["cpu"][i], start_l[i], end_l[i], bend_l[i],
                               share(self.op_name(cols["op"][i], cols["fused_op"][i])), tname,
                               share(tuple(ne[i])), types.get(t, f"type{t}"),
                               cols["tensor"][i], share(tuple(srcs_i[:n_src])),
                               share(tuple(src_view[i][:n_src])), cols["fused_tensor"][i],
                               src_ne, src_dtypes,
                               counted[i] if counted is not None else None,
                               experts.get((cols["tid"][i], start_l[i]))))


def counter_values(ops: np.ndarray, n_counters: int, consts: dict[str, int]
                   ) -> tuple[list, dict[str, int]]:
    """Per op, the counter deltas scaled for multiplexing, or None where dropped; and the
    number of dropped ops by reason. `ops` must already be in the order op_slices uses."""
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
    keep = ~(migrated | failed | idle | unfinished)
    return [tuple(v) if k else None for v, k in zip(scaled.tolist(), keep.tolist())], dropped


def sched_events(evs: np.ndarray, pid: int, kind_switch: int
                 ) -> tuple[list[SchedSwitch], list[SchedWakeup]]:
    """pi_sched_event records (sorted by time) as switches and wakeups."""
    def text(b) -> str:
        return bytes(b).split(b"\0", 1)[0].decode("utf-8", "replace")

    def ours(tgid) -> int:
        return pid if int(tgid) == pid else 0

    switches, wakeups = [], []
    for e in evs:
        if int(e["kind"]) == kind_switch:
            switches.append(SchedSwitch(
                int(e["ts_ns"]), int(e["cpu"]), int(e["prev_tid"]), text(e["prev_comm"]),
                int(e["prev_state"]), int(e["next_tid"]), text(e["next_comm"]),
                ours(e["prev_tgid"]), ours(e["next_tgid"])))
        else:
            wakeups.append(SchedWakeup(int(e["ts_ns"]), int(e["cpu"]), int(e["next_tid"]),
                                       text(e["next_comm"]), int(e["prev_tid"])))
    return switches, wakeups
