"""The records the llama.cpp collector takes from its event buffer, parsed between polls.

Op events are batched per thread in BPF and reach user space PI_OP_BATCH at a time, and a
node's description is sent once per thread (op events carry its number): each op batch is
only copied when it arrives (transport.RecordSlots) and parsed in bulk with numpy, a drain's
records of one kind together; the other records are few.
"""
from __future__ import annotations

import ctypes

import numpy as np

from profinfer.core.base.errors import ProfinferError
from profinfer.core.profile.model import TokenCall, decode_tokens
from profinfer.core.ebpf.transport import RecordSlots
from profinfer.engines.llamacpp.decode import assemble, requests
from profinfer.engines.llamacpp.probes import barrier, ggml
from profinfer.levels.sched import probe as schedprobe

VALIDATE_NODES = 64   # node descriptions checked before a table layout is trusted
MAX_BATCH = 1 << 20
_U32_P = ctypes.POINTER(ctypes.c_uint32)


def _runs(ev: np.void) -> tuple[tuple[int, int, int], ...]:
    """A token event's batch runs (sequence, first position, tokens)."""
    return tuple((int(r["seq"]), int(r["pos0"]), int(r["n_tokens"]))
                 for r in ev["runs"][: int(ev["n_runs"])])


class LlamaRecords:
    """Tokens, graphs, node descriptions, ops, experts and the sched level's records, as
    they arrive; `ops` assembles the ops (made once the first node or op comes)."""

    def __init__(self, consts: dict[str, int], dt: dict[str, np.dtype], op_names: list[str],
                 n_counters: int, layout: ggml.TensorLayout, layout_trusted: bool, batch_trusted: bool):
        self.consts, self.dt = consts, dt
        self.op_names = op_names
        self.n_counters = n_counters
        self.layout = layout
        self.layout_trusted = layout_trusted
        self.batch_trusted = batch_trusted
        self._raw: list[bytes] = []      # records other than op batches, until parsed
        self._batches = RecordSlots(dt["pi_op_batch"])   # op batches, until parsed
        self.tokens: list[np.ndarray] = []
        self.graphs: list[np.ndarray] = []
        self.ops: assemble.OpAssembler | None = None
        self.entry_gaps: list[np.ndarray] = []   # (release, entry_gap_ns) of fused ops
        self._first_nodes: list[np.ndarray] = []   # node descriptions checked before a table layout is trusted
        self.experts: dict[tuple[int, int], tuple[tuple[int, ...], ...]] = {}
        self.experts_truncated = 0   # MUL_MAT_ID reads with more rows or slots than BPF keeps
        self.sched = schedprobe.SchedRecords()
        self.request_marks: list[requests.RequestMark] = []   # llama-server's (decode/requests.py)
        self.task_types: dict[int, str] = {}   # their task types' names, by value
        self.n_events = 0
        self.n_decode_tokens = 0
        self.decoding = False          # the target's first llama_decode has begun

    def on_record(self, data, size) -> None:
        # op batches, most of the bytes, are copied once, into one buffer that numpy reads
        # without another copy; other records are few
        if ctypes.cast(data, _U32_P)[0] != self.consts["PI_EV_OPS"]:
            self._raw.append(ctypes.string_at(data, size))
            return
        self._batches.add(data, size)   # perf-buffer records may carry padding after it

    def parse(self) -> None:
        """The records copied since the last parse."""
        raw, self._raw = self._raw, []
        c = self.consts
        by_kind: dict[int, list[bytes]] = {}
        for rec in raw:
            kind = int.from_bytes(rec[:4], "little")
            if kind == c["PI_EV_DECODING"]:
                self.decoding = True
            elif kind == c["PI_EV_EXPERTS"]:
                self._add_experts(rec)
            elif kind == c["PI_EV_SWITCH"] or kind == c["PI_EV_WAKEUP"]:
                self.sched.add(rec)
                self.n_events += 1
            else:
                by_kind.setdefault(kind, []).append(rec)
        # records of one kind parsed together (one numpy call a kind and drain, not a record)
        tokens = self._array(by_kind.get(c["PI_EV_TOKEN"]), "pi_token_event")
        if tokens is not None:
            self._add_tokens(tokens)
        marks = self._array(by_kind.get(c["PI_EV_REQUEST"]), "pi_request_event")
        if marks is not None:
            self.request_marks.extend(requests.marks_of(marks, c, self.task_types))
            self.n_events += len(marks)
        graphs = self._array(by_kind.get(c["PI_EV_GRAPH"]), "pi_graph_event")
        if graphs is not None:
            self.graphs.append(graphs)
            self.n_events += len(graphs)
        nodes = self._array(by_kind.get(c["PI_EV_NODE"]), "pi_node_event")
        if nodes is not None:      # before the ops: a node is described before its first op is sent
            if not self.layout_trusted:
                self._validate(nodes)
            self.assembler().add_nodes(nodes)
        self._parse_batches()

    def _array(self, records: list[bytes] | None, dtype: str) -> np.ndarray | None:
        if not records:
            return None
        size = self.dt[dtype].itemsize
        return np.frombuffer(b"".join(r[:size] for r in records), self.dt[dtype])

    def _parse_batches(self) -> None:
        # all batches of this drain parsed at once: one array of batches, the filled slots
        # of each taken with one mask (the buffer is reused once the assembler has copied
        # out what it keeps)
        batches = self._batches.take()
        if batches is None:
            return
        if (batches["count"] == batches["ev"].shape[1]).all():    # full: no copy
            ops = batches["ev"].reshape(-1)
        else:
            filled = np.arange(batches["ev"].shape[1]) < batches["count"][:, None]
            ops = batches["ev"][filled]
        self.add_ops(ops)
        self.n_events += len(ops)

    def _add_tokens(self, ev: np.ndarray) -> None:
        n_tokens = ev["n_tokens"]
        if not self.batch_trusted and ((n_tokens < 1) | (n_tokens > MAX_BATCH)).any():
            bad = int(n_tokens[(n_tokens < 1) | (n_tokens > MAX_BATCH)][0])
            raise ProfinferError("unknown llama_batch_ext layout: a batch decodes as "
                                 f"{bad} tokens; this build needs DWARF")
        self.tokens.append(ev)
        self.n_decode_tokens += decode_tokens(n_tokens, ev["n_runs"], ev["runs"]["pos0"],
                                              ev["runs"]["n_tokens"])
        self.n_events += len(ev)

    def take_token_rows(self) -> list[tuple[int, TokenCall]]:
        """The llama_decode calls parsed since the last take, in start order, with their
        process: handed over and forgotten."""
        parts, self.tokens = self.tokens, []
        if not parts:
            return []
        t = np.sort(np.concatenate(parts), order="start_ns")
        return [(int(r["tgid"]), TokenCall.of_batch(int(r["tid"]), int(r["start_ns"]), int(r["end_ns"]),
                                                    int(r["n_tokens"]), int(r["ret"]), _runs(r)))
                for r in t]

    def _add_experts(self, rec: bytes) -> None:
        dt = self.dt["pi_experts_event"]
        ev = np.frombuffer(rec.ljust(dt.itemsize, b"\0"), dt, count=1)[0]
        slots = self.consts["PI_EXPERT_SLOTS"]
        n_used, n_tokens = int(ev["n_used"]), int(ev["n_tokens"])
        rows = min(n_tokens, self.consts["PI_MAX_EXPERT_ROWS"])
        if not 0 < n_used <= slots or rows <= 0:
            self.experts_truncated += 1
            return
        if rows < n_tokens:
            self.experts_truncated += 1
        ids = ev["ids"][: rows * slots].reshape(rows, slots)[:, :n_used]
        self.experts[(int(ev["tid"]), int(ev["start_ns"]))] = tuple(map(tuple, ids.tolist()))
        self.n_events += 1

    def assembler(self) -> assemble.OpAssembler:
        if self.ops is None:
            self.ops = assemble.OpAssembler(self.op_names, self.n_counters, self.consts)
        return self.ops

    def add_ops(self, ops: np.ndarray) -> None:
        self.assembler().add(ops)
        gap = ops["entry_gap_ns"]
        if gap.any():
            at = gap > 0
            gaps = gap[at].astype(np.int64)     # a fused op starts this long after its release
            self.entry_gaps.append(np.stack([ops["start_ns"][at].astype(np.int64) - gaps, gaps]))

    def trap_in_situ_ns(self) -> int | None:
        """The trap's cost as fused ops' entry gaps show it (barrier.py), if any were seen."""
        if not self.entry_gaps:
            return None
        return barrier.trap_at_fused_entries(*np.concatenate(self.entry_gaps, axis=1))

    def _validate(self, nodes: np.ndarray) -> None:
        """Check a table layout on the first node descriptions BPF read with it: every field
        the op table, the DAG and the MoE reads use (ggml.layout_faults). A tenth of
        VALIDATE_NODES may fail (an op whose inputs profinfer has no rule for), even in a
        first drain that holds a few nodes; more refuses it."""
        self._first_nodes.append(nodes)
        seen = np.concatenate(self._first_nodes)[:VALIDATE_NODES]
        for what, bad, checked in ggml.layout_faults(seen, self.op_names):
            if bad > 0.1 * max(checked, VALIDATE_NODES):
                raise ProfinferError(
                    f"unknown ggml_tensor layout: with the {self.layout.name} layout, {what} "
                    f"in {bad} of {checked} nodes; this build needs DWARF (build with -g) or "
                    "a newer profinfer")
        if len(seen) >= VALIDATE_NODES:
            self.layout_trusted = True
            self._first_nodes = []
