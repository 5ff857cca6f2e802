"""Raw event records into profile objects (pure: numpy records built here in llamacpp.h's layout)."""
from __future__ import annotations

import numpy as np

from profinfer.core.ebpf import layout
from profinfer.engines.llamacpp.decode import assemble
from profinfer.core.profile.model import GraphCall

CONSTS, DT = layout.parse(header="llamacpp.h")


DESC_FIELDS = set(DT["pi_node_desc"].names)


def records(*rows) -> tuple[np.ndarray, np.ndarray]:
    """(pi_node_event, pi_op_event) arrays for rows mixing both kinds of fields: each row's
    node is numbered per thread by its description, as BPF does."""
    ops = np.zeros(len(rows), DT["pi_op_event"])
    nodes, numbers = [], {}
    for r, fields in zip(ops, rows):
        desc = np.zeros(1, DT["pi_node_desc"])[0]
        desc["src0_type"] = desc["src1_type"] = -1
        desc["fused_op"] = -1
        for k, v in fields.items():
            (desc if k in DESC_FIELDS else r)[k] = v
        key = (int(r["tid"]), desc.tobytes())
        if key not in numbers:
            numbers[key] = len([k for k in numbers if k[0] == key[0]])
            ev = np.zeros(1, DT["pi_node_event"])[0]
            ev["kind"], ev["tid"], ev["node"], ev["desc"] = CONSTS["PI_EV_NODE"], r["tid"], numbers[key], desc
            nodes.append(ev)
        r["node"] = numbers[key]
    return np.array(nodes, DT["pi_node_event"]), ops


def ops(*rows) -> np.ndarray:
    """pi_op_event records only (counter fields)."""
    return records(*rows)[1]


def assembled(names, rows_in_batches, graphs=(), **kw):
    asm = assemble.OpAssembler(names, **kw)
    for rows in rows_in_batches:
        nodes, evs = records(*rows)
        asm.add_nodes(nodes)
        asm.add(evs)
    return asm, asm.finish(list(graphs))


def test_open_ends_are_capped_by_the_graph():
    rows = ({"start_ns": 100, "end_ns": 150, "barrier_end_ns": 0, "tid": 1, "op": 1, "name": b"a-0"},
            {"start_ns": 200, "end_ns": 0, "barrier_end_ns": 0, "tid": 1, "op": 2, "name": b"b-0"},
            {"start_ns": 120, "end_ns": 130, "barrier_end_ns": 900, "tid": 2, "op": 1, "name": b"a-0"})
    _, cols = assembled(["NONE", "MUL_MAT", "ADD"], [rows], [GraphCall(1, 50, 500, "CPU", 2)])
    out = list(cols)
    assert [(o.start_ns, o.end_ns, o.barrier_end_ns, o.op) for o in out] == [
        (100, 150, 500, "MUL_MAT"),     # no next node: its wait ends with the graph
        (120, 130, 500, "MUL_MAT"),     # a later "next node" is cut to the graph's end
        (200, 500, 500, "ADD")]         # still running at the end: ran until the graph ended
    assert out[0].name is out[1].name and out[0].ne is out[1].ne   # repeated values are shared


def test_sources_views_and_fused():
    rows = ({"start_ns": 1, "end_ns": 2, "op": 1, "fused_op": 2, "fused_tensor": 0xF, "src": [0xA, 0xB, 0],
             "src_view": [0, 0xC, 0], "src0_type": 1, "src0_ne": [4, 8, 1, 1], "name": b"n"},)
    _, cols = assembled(["NONE", "RMS_NORM", "MUL"], [rows])
    (o,) = cols
    assert o.op == "RMS_NORM+MUL" and o.fused_tensor == 0xF
    assert o.srcs == (0xA, 0xB) and o.src_views == (0, 0xC)
    assert o.src_ne == ((4, 8, 1, 1),) and o.src_dtypes == ("f16",)


def test_a_node_described_by_two_threads_is_one_node_and_a_lost_one_says_so():
    asm = assemble.OpAssembler(["NONE", "MUL_MAT"])
    nodes, evs = records({"start_ns": 1, "tid": 1, "op": 1, "tensor": 0xA, "name": b"a"},
                         {"start_ns": 2, "tid": 2, "op": 1, "tensor": 0xA, "name": b"a"})
    asm.add_nodes(nodes)
    asm.add(evs)
    orphan = ops({"start_ns": 3, "tid": 3})
    orphan["node"] = 7                   # its description never arrived
    asm.add(orphan)
    out = list(asm.finish([]))
    assert out[0].op == out[1].op == "MUL_MAT" and len({id(o.name) for o in out[:2]}) == 1
    assert out[2].op == "UNKNOWN"


def test_a_description_a_thread_sent_before_is_counted_as_repeated():
    asm = assemble.OpAssembler(["NONE", "MUL_MAT"])
    a, b = {"tid": 1, "op": 1, "tensor": 0xA, "ne": [4, 1, 1, 1]}, {"tid": 1, "op": 1, "tensor": 0xB}
    first = records(a, b, {**a, "tid": 2})[0]                 # two nodes; the first, by two threads
    changed = records({**a, "ne": [4, 2, 1, 1]})[0]            # a's shape changed: new, not repeated
    again = records(a)[0]                                     # a as sent before: evicted, repeated
    for nodes in (first, changed, again):
        asm.add_nodes(nodes)
    assert asm.n_described == 5 and asm.redescribed == 1
    assert asm.n_descs == 3 and not asm.descs           # described when collection ends


def test_a_reused_thread_number_means_its_latest_description():
    """A thread that exits frees its numbering in BPF; a later thread with the same TID numbers
    its nodes from 0 again. Ops are resolved as they arrive, so each keeps its own node."""
    asm = assemble.OpAssembler(["NONE", "MUL_MAT", "ADD"])
    for op, start in ((1, 10), (2, 20)):       # two lives of thread 5, each with its node 0
        nodes, evs = records({"start_ns": start, "tid": 5, "op": op, "tensor": 0xA})
        asm.add_nodes(nodes)
        asm.add(evs)
    assert [o.op for o in asm.finish([])] == ["MUL_MAT", "ADD"]


def test_counter_values_scale_and_drop():
    a = ops({"ctr": [100, 10, 0, 0], "ctr_enabled": [1000, 1000, 0, 0], "ctr_running": [1000, 500, 0, 0]},
            {"flags": CONSTS["PI_OP_MIGRATED"], "ctr": [5, 5, 0, 0]},
            {"flags": CONSTS["PI_OP_UNFINISHED"]},
            {"ctr": [7, 7, 0, 0], "ctr_enabled": [100, 100, 0, 0], "ctr_running": [100, 0, 0, 0]})
    values, dropped = assemble.counter_values(a, 2, CONSTS)
    assert values[0].tolist() == [100.0, 20.0]             # 10 counted in half the time: 20
    assert np.isnan(values[1:]).all()                      # dropped: not counted
    assert dropped == {"migrated": 1, "unreadable": 0, "not running": 1, "unfinished": 1}


def test_ops_arriving_in_chunks_share_descriptors_and_come_out_sorted(monkeypatch):
    monkeypatch.setattr(assemble, "OP_CHUNK", 4)
    rows = []
    for tok in range(5):            # five tokens of the same two nodes on two threads, shuffled
        for tid in (1, 2):
            for k, (op, name) in enumerate(((1, b"mm-0"), (2, b"add-0"))):
                t = 1000 * tok + 100 * k + tid
                rows.append({"start_ns": t, "end_ns": t + 50, "barrier_end_ns": t + 60, "tid": tid,
                             "op": op, "name": name, "tensor": 0xA0 + k, "ne": [4, 2, 1, 1],
                             "ctr": [tid], "ctr_enabled": [1], "ctr_running": [1]})
    rng = np.random.default_rng(0)
    rng.shuffle(rows)
    nodes, evs = records(*rows)
    asm = assemble.OpAssembler(["NONE", "MUL_MAT", "ADD"], n_counters=1, consts=CONSTS)
    asm.add_nodes(nodes)
    for lo in range(0, len(evs), 3):
        asm.add(evs[lo:lo + 3])
    cols = asm.finish([])
    assert len(cols) == 20 and len(cols.descs) == 2          # two distinct nodes, 20 runs
    assert cols.start.tolist() == sorted(r["start_ns"] for r in rows)
    out = list(cols)
    assert [o.op for o in out[:4]] == ["MUL_MAT", "MUL_MAT", "ADD", "ADD"]
    assert all(o.counters == (float(o.tid),) for o in out)
    assert out[0].ne is out[4].ne and out[0].name is out[4].name


def test_columns_round_trip_slices():
    from profinfer.core.profile.model import OpSlice
    from profinfer.core.profile.opcolumns import OpColumns
    slices = [OpSlice(1, 0, 10, 20, 25, "MUL_MAT", "a-0", (4, 2, 1, 1), "f32", 0xA, (0xB,), (0,),
                      0, ((4, 4, 1, 1),), ("f16",), (1.0, 2.0), None),
              OpSlice(2, 1, 11, 19, 25, "MUL_MAT_ID", "m-0", (4, 2, 1, 1), "f32", 0xC, (0xB,), (0,),
                      0, (), (), None, ((1, 3),))]
    cols = OpColumns.from_slices(slices)
    assert list(cols) == slices and cols[1] == slices[1] and cols[-1] == slices[1]
    assert list(cols[1:]) == slices[1:]
    assert cols.counted().tolist() == [True, False]

