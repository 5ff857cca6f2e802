"""llama.cpp's tracks in a Perfetto trace: its decode calls, graph computes and ggml ops.

On each thread's track, by category: llama_decode (name prefill/decode/mixed; n_tokens,
decode_tokens and sequences "seq:first_pos+tokens ..." where the batch was read, ret when
nonzero) > graph (name graph_compute; backend, n_nodes, function when set) > op (name = op
type; tensor, shape "ne0×ne1×ne2×ne3", dtype, cpu, addr when set; src0..src2 addresses,
srcN_view_of for sources that are views, fused_tensor, src0/src1 shape and dtype when known),
each op followed on the same track by a "barrier" slice (op end to barrier end) unless that
wait is zero. A MUL_MAT_ID op's END carries "experts" = "e,e|e,e|..." (per token: MoE
routing). A thread that reached a graph compute after another thread had started it has a
"thread arrival" slice (category arrival) from that first start to its own first op; it is
derived from the ops, and the reader skips it.
llama-server's request marks (decode/requests.py) are empty slices (category request, name
"posted" or "launched") on the thread that made them: tasks "id:type ..." (n_tasks when a
post carried more than were read), and for a launch its slot and parent (when it has one).
"""
from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from profinfer.core.profile.model import GraphCall, OpSlice, TokenCall
from profinfer.core.profile.opcolumns import OpColumns, as_columns
from profinfer.core.profile.stats import arrivals
from profinfer.engines.llamacpp.decode.requests import MARKS, RequestMark
from profinfer.core.plugin.timeline import (
    INT, LEVEL_BATCH, LEVEL_GRAPH, LEVEL_OP, PTR, STR, SliceKind, Timeline, TraceFormatError,
)

CAT_TOKEN, CAT_GRAPH, CAT_OP, CAT_BARRIER = "llama_decode", "graph", "op", "barrier"
CAT_ARRIVAL, CAT_REQUEST = "arrival", "request"
GRAPH_NAME, BARRIER_NAME, ARRIVAL_NAME = "graph_compute", "barrier", "thread arrival"
SHAPE_SEP = "×"


def shape_str(ne) -> str:
    return SHAPE_SEP.join(str(n) for n in ne)


def experts_str(experts: tuple[tuple[int, ...], ...]) -> str:
    """MoE routing as an argument: tokens separated by "|", a token's experts by ","."""
    return "|".join(",".join(str(e) for e in row) for row in experts)


def parse_experts(text: str) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(int(e) for e in row.split(",")) for row in text.split("|")) if text else ()


def _parse_runs(text: str) -> tuple[tuple[int, int, int], ...]:
    """The token slices' "sequences" argument: "seq:first_pos+tokens ..."."""
    try:
        return tuple((int(q), int(p), int(n)) for q, rest in (r.split(":") for r in text.split())
                     for p, n in (rest.split("+"),))
    except ValueError:
        raise TraceFormatError(f"bad sequences argument {text!r}") from None


class TokenKind(SliceKind):
    category, field = CAT_TOKEN, "tokens"

    def begin(self, obj: TokenCall):
        args = (("n_tokens", INT, obj.n_tokens),)
        if obj.runs:     # the batch's sequences: "seq:first_pos+tokens ..."
            args += (("decode_tokens", INT, obj.decode_tokens),
                     ("sequences", STR, " ".join(f"{q}:{p}+{n}" for q, p, n in obj.runs)))
        if obj.ret:
            args += (("ret", INT, obj.ret),)
        return CAT_TOKEN, obj.phase, args

    def read(self, reader, seq, start, ts, tid, name, begin_args, end_args):
        end = end_args.get("end_ns", ts)
        runs = begin_args.get("sequences")
        if runs:
            return TokenCall.of_batch(tid, start, end, begin_args["n_tokens"],
                                      begin_args.get("ret", 0), _parse_runs(runs))
        return TokenCall(tid=tid, start_ns=start, end_ns=end, n_tokens=begin_args["n_tokens"],
                         prefill=name == "prefill", ret=begin_args.get("ret", 0))


class GraphKind(SliceKind):
    category, field = CAT_GRAPH, "graphs"

    def begin(self, obj: GraphCall):
        args = (("backend", STR, obj.backend), ("n_nodes", INT, obj.n_nodes))
        if obj.function:
            args += (("function", STR, obj.function),)
        return CAT_GRAPH, GRAPH_NAME, args

    def read(self, reader, seq, start, ts, tid, name, begin_args, end_args):
        return GraphCall(tid=tid, start_ns=start, end_ns=end_args.get("end_ns", ts),
                         backend=begin_args["backend"], n_nodes=begin_args["n_nodes"],
                         function=begin_args.get("function", ""))


class OpKind(SliceKind):
    """A graph node, and its barrier wait after it as a slice of its own."""
    category, field = CAT_OP, "ops"

    def __init__(self):
        self.shapes: dict[tuple, str] = {}   # ne -> "ne0×ne1×ne2×ne3"; few distinct shapes, many ops

    def _shape(self, ne) -> str:
        shape = self.shapes.get(ne)
        if shape is None:
            shape = self.shapes[ne] = shape_str(ne)
        return shape

    def begin(self, obj: OpSlice):
        args = (("tensor", STR, obj.name), ("shape", STR, self._shape(obj.ne)),
                ("dtype", STR, obj.dtype), ("cpu", INT, obj.cpu))
        if obj.tensor:
            args += (("addr", PTR, obj.tensor),)
        for i, src in enumerate(obj.srcs):
            args += ((f"src{i}", PTR, src),)
        for i, view in enumerate(obj.src_views):
            if view:
                args += ((f"src{i}_view_of", PTR, view),)
        if obj.fused_tensor:
            args += (("fused_tensor", PTR, obj.fused_tensor),)
        for i, (ne, dtype) in enumerate(zip(obj.src_ne, obj.src_dtypes)):
            args += ((f"src{i}_shape", STR, self._shape(ne)), (f"src{i}_dtype", STR, dtype))
        return CAT_OP, obj.op, args

    def extent(self, obj: OpSlice) -> int:
        return max(obj.end_ns, obj.barrier_end_ns)

    def close(self, obj: OpSlice, at: int) -> Iterator[tuple]:
        op_end = min(max(obj.end_ns, obj.start_ns), at)
        barrier_end = min(max(obj.barrier_end_ns, op_end), at)
        raw = {}
        if op_end != obj.end_ns:
            raw["end_ns"] = obj.end_ns
        if barrier_end != obj.barrier_end_ns:
            raw["barrier_end_ns"] = obj.barrier_end_ns
        yield ("E", op_end, obj, self, raw or None)
        if barrier_end > op_end:
            yield ("b", op_end, CAT_BARRIER, BARRIER_NAME)
            yield ("e", barrier_end)

    def end_args(self, obj: OpSlice) -> tuple:
        return (("experts", STR, experts_str(obj.experts)),) if obj.experts is not None else ()

    def parse_begin(self, args: dict) -> None:
        """Once per distinct event body, not per op."""
        args["ne"] = tuple(int(x) for x in args["shape"].split(SHAPE_SEP))
        args["srcs"] = tuple(args[f"src{i}"] for i in range(3) if f"src{i}" in args)
        args["src_views"] = tuple(args.get(f"src{i}_view_of", 0) for i in range(len(args["srcs"])))
        args["src_ne"] = tuple(tuple(int(x) for x in args[f"src{i}_shape"].split(SHAPE_SEP))
                               for i in range(2) if f"src{i}_shape" in args)
        args["src_dtypes"] = tuple(args[f"src{i}_dtype"] for i in range(2) if f"src{i}_dtype" in args)

    def read(self, reader, seq, start, ts, tid, name, begin_args, end_args):
        op = OpSlice(tid=tid, cpu=begin_args["cpu"], start_ns=start, end_ns=end_args.get("end_ns", ts),
                     barrier_end_ns=end_args.get("barrier_end_ns", ts), op=name,
                     name=begin_args["tensor"], ne=begin_args["ne"],
                     dtype=begin_args["dtype"], tensor=begin_args.get("addr", 0),
                     srcs=begin_args["srcs"], src_views=begin_args["src_views"],
                     fused_tensor=begin_args.get("fused_tensor", 0), src_ne=begin_args["src_ne"],
                     src_dtypes=begin_args["src_dtypes"])
        if "experts" in end_args:
            op.experts = parse_experts(end_args["experts"])
        # the barrier slice that may follow ends it, unless its END already said where
        seq.state["last_op"] = op, "barrier_end_ns" in end_args
        return op

    def collect(self, records: list) -> OpColumns:
        return OpColumns.from_slices(super().collect(records))


class BarrierKind(SliceKind):
    """An op's barrier wait, written by OpKind.close; read back as the op's barrier end."""
    category = CAT_BARRIER

    def read(self, reader, seq, start, ts, tid, name, begin_args, end_args):
        last = seq.state.get("last_op")
        if last is None:
            raise TraceFormatError("barrier slice without an op")
        op, fixed = last
        if not fixed:
            op.barrier_end_ns = ts


class ArrivalKind(SliceKind):
    """Derived from the ops (core.stats.arrivals): written, and skipped when read."""
    category = CAT_ARRIVAL

    def begin(self, obj):
        return CAT_ARRIVAL, ARRIVAL_NAME, ()


class RequestKind(SliceKind):
    """A llama-server request mark: an empty slice where it was made."""
    category, field = CAT_REQUEST, MARKS

    def begin(self, obj: RequestMark):
        args = (("tasks", STR, " ".join(f"{t}:{k}" for t, k in zip(obj.tasks, obj.types))),)
        if obj.n_tasks != len(obj.tasks):
            args += (("n_tasks", INT, obj.n_tasks),)
        if obj.slot >= 0:
            args += (("slot", INT, obj.slot),)
        if obj.parent >= 0:
            args += (("parent", INT, obj.parent),)
        return CAT_REQUEST, obj.what, args

    def read(self, reader, seq, start, ts, tid, name, begin_args, end_args):
        try:
            pairs = [p.split(":") for p in begin_args.get("tasks", "").split()]
            tasks = tuple(int(t) for t, _ in pairs)
        except ValueError:
            raise TraceFormatError(f"bad request tasks {begin_args.get('tasks')!r}") from None
        return RequestMark(reader.pid_of(tid), tid, start, name, tasks, tuple(k for _, k in pairs),
                           begin_args.get("slot", -1), begin_args.get("parent", -1),
                           begin_args.get("n_tasks", len(tasks)))


class _OpRun:
    """One thread's ops (columns), made into OpSlice objects one at a time as they are written."""

    def __init__(self, ops: OpColumns, kind: OpKind):
        self.ops, self.kind = ops, kind
        self.first_ns = int(ops.start[0]) if len(ops) else 0

    def __len__(self) -> int:
        return len(self.ops)

    def items(self, seq0: int) -> Iterator[tuple]:
        kind = self.kind
        return ((o.start_ns, LEVEL_OP, seq0 + k, o, kind) for k, o in enumerate(self.ops))


class LlamaTimeline(Timeline):
    def __init__(self):
        self.token, self.graph, self.op = TokenKind(), GraphKind(), OpKind()
        self.arrival = ArrivalKind()
        self.request = RequestKind()
        self.kinds = (self.token, self.graph, self.op, BarrierKind(), self.arrival, self.request)

    def slices(self, profile):
        for t in profile.tokens:
            yield self.token, t, LEVEL_BATCH
        for g in profile.graphs:
            yield self.graph, g, LEVEL_GRAPH
        for m in profile.records.get(MARKS, ()):
            yield self.request, m, LEVEL_BATCH
        # an arrival sits where an op would, on the thread that arrived late
        for a in arrivals(profile):
            if a.dur_ns > 0:
                yield self.arrival, a, LEVEL_OP

    def runs(self, profile):
        cols = as_columns(profile.ops)
        # each thread's ops by start; equal starts in the profile's order
        order = np.lexsort((np.arange(len(cols)), cols.start, cols.tid))
        tids = cols.tid[order]
        bounds = np.flatnonzero(np.r_[True, tids[1:] != tids[:-1]]) if len(order) else []
        return {int(tids[lo]): _OpRun(cols.take(order[lo:hi]), self.op)
                for lo, hi in zip(bounds, list(bounds[1:]) + [len(order)])}


TIMELINE = LlamaTimeline()
