"""Raw event records into profile objects (pure: numpy records built here in events.h's layout)."""
from __future__ import annotations

import numpy as np

from profinfer import assemble, layout
from profinfer.model import GraphCall

CONSTS, DT = layout.parse()


def ops(*rows) -> np.ndarray:
    a = np.zeros(len(rows), DT["pi_op_event"])
    for r, fields in zip(a, rows):
        r["src0_type"] = r["src1_type"] = -1
        r["fused_op"] = -1
        for k, v in fields.items():
            r[k] = v
    return a


def test_open_ends_are_capped_by_the_graph():
    a = ops({"start_ns": 100, "end_ns": 150, "barrier_end_ns": 0, "tid": 1, "op": 1, "name": b"a-0"},
            {"start_ns": 200, "end_ns": 0, "barrier_end_ns": 0, "tid": 1, "op": 2, "name": b"b-0"},
            {"start_ns": 120, "end_ns": 130, "barrier_end_ns": 900, "tid": 2, "op": 1, "name": b"a-0"})
    a.sort(order="start_ns")
    out = assemble.op_slices(a, [GraphCall(1, 50, 500, "CPU", 2)], ["NONE", "MUL_MAT", "ADD"])
    assert [(o.start_ns, o.end_ns, o.barrier_end_ns, o.op) for o in out] == [
        (100, 150, 500, "MUL_MAT"),     # no next node: its wait ends with the graph
        (120, 130, 500, "MUL_MAT"),     # a later "next node" is cut to the graph's end
        (200, 500, 500, "ADD")]         # still running at the end: ran until the graph ended
    assert out[0].name is out[1].name and out[0].ne is out[1].ne   # repeated values are shared


def test_sources_views_and_fused():
    a = ops({"start_ns": 1, "end_ns": 2, "op": 1, "fused_op": 2, "fused_tensor": 0xF, "src": [0xA, 0xB, 0],
             "src_view": [0, 0xC, 0], "src0_type": 1, "src0_ne": [4, 8, 1, 1], "name": b"n"})
    (o,) = assemble.op_slices(a, [], ["NONE", "RMS_NORM", "MUL"])
    assert o.op == "RMS_NORM+MUL" and o.fused_tensor == 0xF
    assert o.srcs == (0xA, 0xB) and o.src_views == (0, 0xC)
    assert o.src_ne == ((4, 8, 1, 1),) and o.src_dtypes == ("f16",)


def test_counter_values_scale_and_drop():
    a = ops({"ctr": [100, 10, 0, 0], "ctr_enabled": [1000, 1000, 0, 0], "ctr_running": [1000, 500, 0, 0]},
            {"flags": CONSTS["PI_OP_MIGRATED"], "ctr": [5, 5, 0, 0]},
            {"flags": CONSTS["PI_OP_UNFINISHED"]},
            {"ctr": [7, 7, 0, 0], "ctr_enabled": [100, 100, 0, 0], "ctr_running": [100, 0, 0, 0]})
    values, dropped = assemble.counter_values(a, 2, CONSTS)
    assert values == [(100.0, 20.0), None, None, None]     # 10 counted in half the time: 20
    assert dropped == {"migrated": 1, "unreadable": 0, "not running": 1, "unfinished": 1}
