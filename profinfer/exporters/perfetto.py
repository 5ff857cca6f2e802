"""Timeline export: native Perfetto protobuf trace, and Chrome trace-event JSON as a fallback.

Protobuf layout (trace_reader.py reads exactly this back into a Profile):
- sequence 1: a ClockSnapshot making CLOCK_MONOTONIC the trace clock (our timestamps are
  bpf_ktime_get_ns), the process and thread TrackDescriptors, and as the very last packet a
  TraceAttributes packet (profinfer.format, profinfer.lost_events, meta.<key> per Profile.meta).
  trace_processor lists those in its metadata table as trace_attribute.*; the UI shows them in
  the trace overview. Being last, it also tells the reader the file was not cut short.
- one sequence per thread (2, 3, ...): its first packet clears incremental state, sets packet
  defaults (track = the thread's track, clock = sequence clock 64) and snapshots clock 64 as an
  incremental nanosecond clock equal to MONOTONIC. Then TrackEvent slice BEGIN/END packets in
  time order whose timestamps are deltas, with interned names, categories, argument names and
  string values. This keeps an op (4 packets with its barrier) to a few dozen bytes.
- slices, by category: llama_decode (name prefill/decode; n_tokens, ret when nonzero) >
  graph (name graph_compute; backend, n_nodes, function when set) > op (name = op type;
  tensor, shape "ne0×ne1×ne2×ne3", dtype, cpu, addr when set; src0..src2 addresses,
  srcN_view_of for sources that are views, fused_tensor, src0/src1 shape and dtype when known), each op followed on the same track by a "barrier"
  slice (op end to barrier end) unless that wait is zero. A thread that reached a graph
  compute after another thread had started it has a "thread arrival" slice (category
  arrival) from that first start to its own first op; it is derived from the ops, and
  the reader skips it.
- perf counters (Profile.counter_names, attribute profinfer.counters): an op's scaled deltas
  are "ctr:<name>" double arguments of its END event, and each thread has one counter track
  per counter (child of the thread track) holding the op's delta from its start to its end,
  and one per derived metric the counters allow (IPC, miss rates, CPU util %).
  The attributes profinfer.counter_dropped.<reason> carry the dropped-op counts.
- engines whose ops are calls (vLLM): step (name = phase; tokens, calls, query_lens "1,1,4")
  > native_op (name = op; "arg:<name>" = "dtype[s0,s1,...]" per tensor argument, "-" for an
  empty optional; library, depth, step (the thread's step number), values where read);
  nested calls one level deeper. Each
  process whose threads ran ops has its descriptor; the profiled process's comes first.
- MoE routing: a MUL_MAT_ID op's END carries "experts" = "e,e|e,e|..." (per token).
- scheduler events (sched level) as ftrace sched_switch / sched_wakeup events in
  FtraceEventBundles per CPU on sequence 1, so trace_processor builds thread states and
  CPU tracks from them as from a kernel trace. Ftrace timestamps are BOOTTIME: the header's
  clock snapshot relates it to MONOTONIC (offset Profile.meta["boottime_offset_ns"]).
- slices on one track must nest strictly; where the data overlaps (clock rounding, a next op
  starting before the previous barrier ended) the slice is cut short and its END carries the
  true end_ns / barrier_end_ns, so nothing is lost.
"""
from __future__ import annotations

import heapq
import json
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from perfetto.protos.perfetto.trace.perfetto_trace_pb2 import (
    BuiltinClock, InternedData, TracePacket, TrackEvent,
)
from perfetto.trace_builder.proto_builder import TraceProtoBuilder

from profinfer.levels.counters.stats import derived_tracks, derived_values
from profinfer.core.model import CudaCall, GraphCall, OpCall, OpSlice, Profile, Step, TokenCall
from profinfer.core.opcolumns import OpColumns, as_columns
from profinfer.core.stats import Arrival, arrivals

FORMAT_VERSION = 1
MAIN_SEQUENCE = 1
SEQ_CLOCK = 64                       # first sequence-scoped clock id
MONOTONIC = BuiltinClock.BUILTIN_CLOCK_MONOTONIC
BOOTTIME = BuiltinClock.BUILTIN_CLOCK_BOOTTIME
META_BOOT_OFFSET = "boottime_offset_ns"
DEFAULT_PRIO = 120
_FTRACE_BUNDLE = 1000                # events per FtraceEventBundle
CAT_TOKEN, CAT_GRAPH, CAT_OP, CAT_BARRIER = "llama_decode", "graph", "op", "barrier"
CAT_ARRIVAL = "arrival"
# engines whose ops are calls (vLLM): step > native op (nested calls one level deeper)
CAT_STEP, CAT_CALL = "step", "native_op"
# the cuda level: each call a slice on its thread, under the op it was made in; each stream a
# track of its launches in order; live device memory a counter track
CAT_CUDA, CAT_CUDA_STREAM = "cuda", "cuda_stream"
LIVE_MEMORY_TRACK = "CUDA live device memory (bytes)"
CALL_ARG_PREFIX = "arg:"      # a tensor argument: "dtype[s0,s1,...]", "-" for an empty optional
GRAPH_NAME, BARRIER_NAME, ARRIVAL_NAME = "graph_compute", "barrier", "thread arrival"
SHAPE_SEP = "×"
ATTR_FORMAT, ATTR_LOST, ATTR_META_PREFIX = "profinfer.format", "profinfer.lost_events", "meta."
ATTR_COUNTERS, ATTR_DROPPED_PREFIX = "profinfer.counters", "profinfer.counter_dropped."
COUNTER_ARG_PREFIX = "ctr:"

# interned-data table per kind of string
INTERN_TABLES = {"cat": "event_categories", "name": "event_names",
                 "arg": "debug_annotation_names", "str": "debug_annotation_string_values"}

_TOKEN, _GRAPH, _OP = 0, 1, 2        # nesting levels on a thread track
_CUDA = 50                           # deeper than any op (an op calling another is one deeper)
_INT, _STR, _PTR, _DBL = 0, 1, 2, 3  # argument value kinds


def process_uuid(pid: int) -> int:
    return (2 << 40) | pid


def thread_uuid(tid: int) -> int:
    return (1 << 40) | tid


def counter_track_uuid(tid: int, index: int) -> int:
    return (3 << 48) | (index << 40) | tid


def shape_str(ne) -> str:
    return SHAPE_SEP.join(str(n) for n in ne)


def experts_str(experts: tuple[tuple[int, ...], ...]) -> str:
    """MoE routing as an argument: tokens separated by "|", a token's experts by ","."""
    return "|".join(",".join(str(e) for e in row) for row in experts)


def parse_experts(text: str) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(int(e) for e in row.split(",")) for row in text.split("|")) if text else ()


# --------------------------------------------------------------------------- slice planning

class ThreadItems:
    """One thread's slices as (start, level, seq, obj), sorted so parents precede children at
    equal starts. Its ops are made one at a time as they are written (a profile's ops are
    columns; a whole run of them as objects would not fit in the collector's memory)."""

    def __init__(self, calls: list[tuple], ops: OpColumns, seq0: int):
        self.calls = sorted(calls)          # tokens and graphs: few
        self.ops = ops
        self.seq0 = seq0
        firsts = [self.calls[0][0]] if self.calls else []
        if len(ops):
            firsts.append(int(ops.start[0]))
        self.first_ns = min(firsts)

    def __iter__(self) -> Iterator[tuple]:
        ops = ((o.start_ns, _OP, self.seq0 + k, o) for k, o in enumerate(self.ops))
        return heapq.merge(self.calls, ops)


def thread_items(profile: Profile) -> dict[int, ThreadItems]:
    calls: dict[int, list[tuple]] = defaultdict(list)
    seq = 0
    late = [a for a in arrivals(profile) if a.dur_ns > 0]
    # an arrival sits where an op would, on the thread that arrived late
    for level, objs in ((_TOKEN, profile.tokens), (_GRAPH, profile.graphs), (_OP, late),
                        (_TOKEN, profile.steps)):
        for o in objs:
            calls[o.tid].append((o.start_ns, level, seq, o))
            seq += 1
    for c in profile.calls:
        calls[c.tid].append((c.start_ns, _GRAPH + c.depth, seq, c))
        seq += 1
    for c in profile.cuda_calls:
        if c.count == 1 and c.start_ns:      # counted in BPF (no timeline): not slices
            calls[c.tid].append((c.start_ns, _CUDA, seq, c))
            seq += 1
    cols = as_columns(profile.ops)
    # each thread's ops by start; equal starts in the profile's order
    order = np.lexsort((np.arange(len(cols)), cols.start, cols.tid))
    tids = cols.tid[order]
    bounds = np.flatnonzero(np.r_[True, tids[1:] != tids[:-1]]) if len(order) else []
    op_runs = {int(tids[lo]): order[lo:hi] for lo, hi in zip(bounds, list(bounds[1:]) + [len(order)])}
    empty = cols.take(np.zeros(0, np.int64))
    return {tid: ThreadItems(calls.get(tid, []),
                             cols.take(op_runs[tid]) if tid in op_runs else empty, seq)
            for tid in sorted(set(calls) | set(op_runs))}


def plan(items: list[tuple]) -> Iterator[tuple]:
    """Turn one thread's items into a strictly nested, time-ordered slice event stream.

    Yields ("B", ts, obj), ("E", ts, obj, raw) with raw = {field: true value} for ends that had
    to be cut (or None), and ("b", ts, op) / ("e", ts, op) for an op's barrier slice.
    Starts are never moved; only ends are clamped, to the parent's end or the next sibling's start.
    """
    stack: list[list] = []           # [level, obj, latest allowed end]
    for start, level, _, obj in items:
        while stack and (stack[-1][2] <= start or stack[-1][0] >= level):
            top = stack.pop()
            yield from _close(top[1], min(top[2], start))
        extent = max(obj.end_ns, obj.barrier_end_ns) if isinstance(obj, OpSlice) else obj.end_ns
        if stack:
            extent = min(extent, stack[-1][2])
        yield ("B", start, obj)
        stack.append([level, obj, max(start, extent)])
    while stack:
        top = stack.pop()
        yield from _close(top[1], top[2])


def _close(obj, at: int) -> Iterator[tuple]:
    if not isinstance(obj, OpSlice):
        yield ("E", at, obj, None if at == obj.end_ns else {"end_ns": obj.end_ns})
        return
    op_end = min(max(obj.end_ns, obj.start_ns), at)
    barrier_end = min(max(obj.barrier_end_ns, op_end), at)
    raw = {}
    if op_end != obj.end_ns:
        raw["end_ns"] = obj.end_ns
    if barrier_end != obj.barrier_end_ns:
        raw["barrier_end_ns"] = obj.barrier_end_ns
    yield ("E", op_end, obj, raw or None)
    if barrier_end > op_end:
        yield ("b", op_end, obj)
        yield ("e", barrier_end, obj)


def begin_fields(obj) -> tuple[str, str, tuple]:
    """(category, name, args) of the slice for a model object; args are (key, kind, value)."""
    if isinstance(obj, OpSlice):
        shape = _shapes.get(obj.ne)
        if shape is None:
            shape = _shapes[obj.ne] = shape_str(obj.ne)
        args = (("tensor", _STR, obj.name), ("shape", _STR, shape),
                ("dtype", _STR, obj.dtype), ("cpu", _INT, obj.cpu))
        if obj.tensor:
            args += (("addr", _PTR, obj.tensor),)
        for i, src in enumerate(obj.srcs):
            args += ((f"src{i}", _PTR, src),)
        for i, view in enumerate(obj.src_views):
            if view:
                args += ((f"src{i}_view_of", _PTR, view),)
        if obj.fused_tensor:
            args += (("fused_tensor", _PTR, obj.fused_tensor),)
        for i, (ne, dtype) in enumerate(zip(obj.src_ne, obj.src_dtypes)):
            shape = _shapes.get(ne)
            if shape is None:
                shape = _shapes[ne] = shape_str(ne)
            args += ((f"src{i}_shape", _STR, shape), (f"src{i}_dtype", _STR, dtype))
        return CAT_OP, obj.op, args
    if isinstance(obj, GraphCall):
        args = (("backend", _STR, obj.backend), ("n_nodes", _INT, obj.n_nodes))
        if obj.function:
            args += (("function", _STR, obj.function),)
        return CAT_GRAPH, GRAPH_NAME, args
    if isinstance(obj, TokenCall):
        args = (("n_tokens", _INT, obj.n_tokens),)
        if obj.runs:     # the batch's sequences: "seq:first_pos+tokens ..."
            args += (("decode_tokens", _INT, obj.decode_tokens),
                     ("sequences", _STR, " ".join(f"{q}:{p}+{n}" for q, p, n in obj.runs)))
        if obj.ret:
            args += (("ret", _INT, obj.ret),)
        return CAT_TOKEN, obj.phase, args
    if isinstance(obj, Arrival):
        return CAT_ARRIVAL, ARRIVAL_NAME, ()
    if isinstance(obj, OpCall):
        args = tuple((CALL_ARG_PREFIX + a.name, _STR, tensor_str(a.dtype, a.shape)) for a in obj.args)
        args += (("library", _STR, obj.library), ("depth", _INT, obj.depth), ("step", _INT, obj.step))
        if obj.values:
            args += (("values", _STR, ",".join(map(str, obj.values))),)
        return CAT_CALL, obj.op, args
    if isinstance(obj, CudaCall):
        return CAT_CUDA, obj.api, cuda_args(obj)
    if isinstance(obj, Step):
        return CAT_STEP, obj.phase, (("tokens", _INT, obj.n_tokens), ("calls", _INT, obj.n_calls),
                                     ("query_lens", _STR, ",".join(map(str, obj.query_lens))))
    raise TypeError(f"not a profile slice: {obj!r}")


_shapes: dict[tuple, str] = {}       # ne -> "ne0×ne1×ne2×ne3"; few distinct shapes, many ops
_CUDA_INTS = ("shmem", "stream", "bytes", "ptr", "handle", "ret", "step")
_CUDA_STRS = ("what", "kernel", "copy_kind", "caller", "op")


def cuda_args(c: CudaCall) -> tuple:
    args = tuple((k, _STR, getattr(c, k)) for k in _CUDA_STRS if getattr(c, k))
    args += tuple((k, _INT, getattr(c, k)) for k in _CUDA_INTS if getattr(c, k))
    if c.what == "launch":
        args += (("grid", _STR, "x".join(map(str, c.grid))), ("block", _STR, "x".join(map(str, c.block))))
    if c.captured:
        args += (("captured", _INT, 1),)
    return args


def cuda_call_from(pid: int, tid: int, start: int, end: int, api: str, args: dict) -> CudaCall:
    def dims(k):
        return tuple(int(x) for x in args[k].split("x")) if k in args else (0, 0, 0)
    return CudaCall(pid, tid, api, args.get("what", ""), start, end, 1, end - start if end else 0,
                    args.get("kernel", ""), dims("grid"), dims("block"),
                    *(args.get(k, 0) for k in ("shmem", "stream", "bytes")), args.get("copy_kind", ""),
                    args.get("ptr", 0), args.get("handle", 0), args.get("ret", 0), args.get("caller", ""),
                    bool(args.get("captured", 0)), args.get("step", 0), args.get("op", ""))


# the cuda level's tracks that belong to a process, not a thread: kind in the top bits, then
# the pid, then the track's number in that process
STREAM_TRACKS, MEMORY_TRACKS = 5, 6


def process_track_uuid(kind: int, pid: int, index: int = 0) -> int:
    return (kind << 60) | ((pid & 0xFFFFFFFF) << 24) | (index & 0xFFFFFF)


def process_track_of(uuid: int) -> tuple[int, int] | None:
    """(kind, pid) of a process track's uuid; None for any other track."""
    kind = uuid >> 60
    return (kind, (uuid >> 24) & 0xFFFFFFFF) if kind in (STREAM_TRACKS, MEMORY_TRACKS) else None


def _cuda_tracks(profile: Profile, seq_id: int) -> bytes:
    """One track per (process, stream) with its launches in order (graph launches too), and a
    counter track of each process's live device memory."""
    from profinfer.levels.cuda.stats import live_memory
    timed = [c for c in profile.cuda_calls if c.count == 1 and c.start_ns]
    if not timed:
        return b""
    b = TraceProtoBuilder()

    def packet():
        pkt = b.add_packet()
        pkt.trusted_packet_sequence_id = seq_id
        return pkt

    # what ran on each stream: launches and graph launches (a launch captured into a graph
    # is not run then: its graph's launches are)
    ran = [c for c in sorted(timed, key=lambda c: c.start_ns)
           if (c.what == "launch" or "GraphLaunch" in c.api) and not c.captured]
    streams: dict[tuple[int, int], int] = {}
    for c in ran:
        if (c.pid, c.stream) not in streams:
            streams[(c.pid, c.stream)] = uuid = process_track_uuid(
                STREAM_TRACKS, c.pid, sum(1 for p, _ in streams if p == c.pid))
            d = packet().track_descriptor
            d.uuid, d.parent_uuid = uuid, process_uuid(c.pid)
            d.name = f"CUDA stream 0x{c.stream:x}" + (" (default)" if c.stream == 0 else "")
    for c in ran:
        for etype, extra in ((TrackEvent.TYPE_SLICE_BEGIN, True), (TrackEvent.TYPE_SLICE_END, False)):
            pkt = packet()
            pkt.timestamp, pkt.timestamp_clock_id = c.start_ns, MONOTONIC
            te = pkt.track_event
            te.type, te.track_uuid = etype, streams[(c.pid, c.stream)]
            if extra:
                te.categories.append(CAT_CUDA_STREAM)
                te.name = c.kernel or f"graph 0x{c.handle:x}"
    series_by_pid = {}
    for pid in sorted({c.pid for c in timed}):
        series, _, _ = live_memory([c for c in timed if c.pid == pid])
        if series:
            series_by_pid[pid] = series
            d = packet().track_descriptor
            d.uuid, d.parent_uuid = process_track_uuid(MEMORY_TRACKS, pid), process_uuid(pid)
            d.name = LIVE_MEMORY_TRACK
            d.counter.SetInParent()
    first = min(c.start_ns for c in timed)
    for pid, series in series_by_pid.items():
        for ts, value in [(first, 0)] + series:
            pkt = packet()
            pkt.timestamp, pkt.timestamp_clock_id = ts, MONOTONIC
            pkt.track_event.type = TrackEvent.TYPE_COUNTER
            pkt.track_event.track_uuid = process_track_uuid(MEMORY_TRACKS, pid)
            pkt.track_event.counter_value = value
    return b.serialize()


def tensor_str(dtype: str, shape: tuple[int, ...] | None) -> str:
    return "-" if shape is None else f"{dtype}[{','.join(map(str, shape))}]"


def parse_tensor(text: str) -> tuple[str, tuple[int, ...] | None]:
    if text == "-":
        return "", None
    dtype, _, dims = text.partition("[")
    dims = dims.rstrip("]")
    return dtype, tuple(int(d) for d in dims.split(",")) if dims else ()


# --------------------------------------------------------------------------- protobuf writer
#
# Structural packets are built with TraceProtoBuilder. The millions of slice packets are framed
# by hand around TrackEvent bodies that protobuf serialized once and that are reused from a cache:
# a thread repeats the same nodes token after token, and building a message per packet made
# export take ~35 µs per op.

_SMALL_VARINTS = [bytes([i]) for i in range(128)]


def varint(v: int) -> bytes:
    if 0 <= v < 128:
        return _SMALL_VARINTS[v]
    v &= (1 << 64) - 1               # negative int64: ten-byte two's complement, as protobuf does
    out = bytearray()
    while v >= 0x80:
        out.append((v & 0x7F) | 0x80)
        v >>= 7
    out.append(v)
    return bytes(out)


# TracePacket / TrackEvent wire tags used on the hot path
TAG_PACKET = b"\x0a"                 # Trace.packet = 1, length-delimited
TAG_TIMESTAMP = b"\x40"              # TracePacket.timestamp = 8, varint
TAG_SEQUENCE_ID = b"\x50"            # TracePacket.trusted_packet_sequence_id = 10, varint
TAG_TRACK_EVENT = b"\x5a"            # TracePacket.track_event = 11, length-delimited
TAG_INTERNED_DATA = b"\x62"          # TracePacket.interned_data = 12, length-delimited
_END_BODY = TrackEvent(type=TrackEvent.TYPE_SLICE_END).SerializeToString()
_CACHE_LIMIT = 200_000               # distinct BEGIN bodies kept per thread (shapes can grow with the KV cache)
_FLUSH_PARTS = 65_536


class _ThreadSequence:
    """One packet sequence = one thread track, with its own interning and delta clock."""

    def __init__(self, parts: list[bytes], flush, seq_id: int, tid: int, t0: int):
        self.parts, self.flush, self.last_ts = parts, flush, t0
        self.seq_field = TAG_SEQUENCE_ID + varint(seq_id)
        self.iids: dict[str, dict[str, int]] = {k: {} for k in INTERN_TABLES}
        self.begin_cache: dict[tuple, bytes] = {}     # (cat, name, args) -> framed track_event field
        builder = TraceProtoBuilder()
        pkt = builder.add_packet()
        pkt.trusted_packet_sequence_id = seq_id
        pkt.sequence_flags = TracePacket.SEQ_INCREMENTAL_STATE_CLEARED
        pkt.first_packet_on_sequence = True
        pkt.trace_packet_defaults.timestamp_clock_id = SEQ_CLOCK
        pkt.trace_packet_defaults.track_event_defaults.track_uuid = thread_uuid(tid)
        mono = pkt.clock_snapshot.clocks.add()
        mono.clock_id, mono.timestamp = MONOTONIC, t0
        seq_clock = pkt.clock_snapshot.clocks.add()
        seq_clock.clock_id, seq_clock.timestamp, seq_clock.is_incremental = SEQ_CLOCK, t0, True
        parts.append(builder.serialize())

    def _iid(self, interned: InternedData, table: str, s: str) -> int:
        ids = self.iids[table]
        iid = ids.get(s)
        if iid is None:
            iid = ids[s] = len(ids) + 1
            entry = getattr(interned, INTERN_TABLES[table]).add()
            entry.iid = iid
            if table == "str":
                entry.str = s.encode()
            else:
                entry.name = s
        return iid

    def _track_event(self, etype: int, cat: str | None, name: str | None,
                     args: tuple) -> tuple[bytes, bytes]:
        """Framed track_event field, and the framed interned_data field its new strings need (or b"")."""
        interned = InternedData()
        te = TrackEvent(type=etype)
        if cat is not None:
            te.category_iids.append(self._iid(interned, "cat", cat))
            te.name_iid = self._iid(interned, "name", name)
        for key, kind, value in args:
            ann = te.debug_annotations.add()
            ann.name_iid = self._iid(interned, "arg", key)
            if kind == _STR:
                ann.string_value_iid = self._iid(interned, "str", value)
            elif kind == _PTR:
                ann.pointer_value = value
            elif kind == _DBL:
                ann.double_value = value
            else:
                ann.int_value = value
        body, extra = te.SerializeToString(), interned.SerializeToString()
        return (TAG_TRACK_EVENT + varint(len(body)) + body,
                TAG_INTERNED_DATA + varint(len(extra)) + extra if extra else b"")

    def _packet(self, ts: int, fields: bytes) -> None:
        delta = ts - self.last_ts
        assert delta >= 0, "slice planner emitted events out of time order"
        self.last_ts = ts
        # timestamp always present, even 0: a packet without one is not a delta on our clock
        body = self.seq_field + TAG_TIMESTAMP + (_SMALL_VARINTS[delta] if delta < 128 else varint(delta)) \
            + fields
        n = len(body)
        self.parts.append(TAG_PACKET + (_SMALL_VARINTS[n] if n < 128 else varint(n)) + body)

    def _begin(self, ts: int, cat: str, name: str, args: tuple) -> None:
        key = (cat, name, args)
        fields = self.begin_cache.get(key)
        if fields is None:
            fields, interned = self._track_event(TrackEvent.TYPE_SLICE_BEGIN, cat, name, args)
            if len(self.begin_cache) >= _CACHE_LIMIT:
                self.begin_cache.clear()
            self.begin_cache[key] = fields
            fields += interned
        self._packet(ts, fields)

    def _counter(self, ts: int, uuid: int, value: float) -> None:
        body = TrackEvent(type=TrackEvent.TYPE_COUNTER, track_uuid=uuid,
                          double_counter_value=value).SerializeToString()
        self._packet(ts, TAG_TRACK_EVENT + varint(len(body)) + body)

    def write(self, items: ThreadItems, counter_names: list[str], tid: int) -> None:
        end_plain = TAG_TRACK_EVENT + varint(len(_END_BODY)) + _END_BODY
        derived = derived_tracks(counter_names)
        tracks = [counter_track_uuid(tid, i) for i in range(len(counter_names) + len(derived))]
        arg_names = [COUNTER_ARG_PREFIX + n for n in counter_names]
        for ev in plan(items):
            kind, ts = ev[0], ev[1]
            if kind == "B":
                obj = ev[2]
                self._begin(ts, *begin_fields(obj))
                if tracks and isinstance(obj, OpSlice) and obj.counters is not None:
                    values = list(obj.counters) + derived_values(obj.counters, obj.dur_ns, derived)
                    for uuid, v in zip(tracks, values):
                        self._counter(ts, uuid, v)
            elif kind == "E":
                obj, args = ev[2], tuple((k, _INT, v) for k, v in (ev[3] or {}).items())
                counted = tracks and isinstance(obj, OpSlice) and obj.counters is not None
                if counted:
                    args += tuple((n, _DBL, float(v)) for n, v in zip(arg_names, obj.counters))
                if isinstance(obj, OpSlice) and obj.experts is not None:
                    args += (("experts", _STR, experts_str(obj.experts)),)
                if args:
                    self._packet(ts, b"".join(self._track_event(TrackEvent.TYPE_SLICE_END, None, None, args)))
                else:
                    self._packet(ts, end_plain)
                if counted:
                    for uuid in tracks:
                        self._counter(ts, uuid, 0.0)
            elif kind == "b":
                self._begin(ts, CAT_BARRIER, BARRIER_NAME, ())
            else:
                self._packet(ts, end_plain)
            if len(self.parts) >= _FLUSH_PARTS:
                self.flush()


def write_perfetto(profile: Profile, path: str | Path) -> None:
    """Write `profile` as a native Perfetto trace (open it in ui.perfetto.dev or trace_processor)."""
    by_tid = thread_items(profile)
    t_min = min((items.first_ns for items in by_tid.values()), default=0)

    header = TraceProtoBuilder()
    pkt = header.add_packet()
    pkt.trusted_packet_sequence_id = MAIN_SEQUENCE
    pkt.sequence_flags = TracePacket.SEQ_INCREMENTAL_STATE_CLEARED
    pkt.first_packet_on_sequence = True
    clock = pkt.clock_snapshot.clocks.add()
    clock.clock_id, clock.timestamp = MONOTONIC, t_min
    boot = pkt.clock_snapshot.clocks.add()
    boot_offset = int(profile.meta.get(META_BOOT_OFFSET, 0))
    boot.clock_id, boot.timestamp = BOOTTIME, max(0, t_min + boot_offset)   # an unsigned field
    pkt.clock_snapshot.primary_trace_clock = MONOTONIC   # trace time = our timestamps, unconverted
    # the profiled process first (the reader's Profile.pid), then others whose threads ran
    # ops (vLLM's workers)
    pid_of = {c.tid: c.pid for c in profile.calls}
    pid_of.update((c.tid, c.pid) for c in profile.cuda_calls if c.tid and c.pid != profile.pid)
    for pid in [profile.pid] + sorted(set(pid_of.values()) - {profile.pid}):
        pkt = header.add_packet()
        pkt.trusted_packet_sequence_id = MAIN_SEQUENCE
        pkt.track_descriptor.uuid = process_uuid(pid)
        pkt.track_descriptor.process.pid = pid
        if pid == profile.pid:
            pkt.track_descriptor.process.process_name = profile.process_name
    for tid in sorted(set(by_tid) | set(profile.thread_names)):
        pkt = header.add_packet()
        pkt.trusted_packet_sequence_id = MAIN_SEQUENCE
        desc = pkt.track_descriptor
        desc.uuid = thread_uuid(tid)
        desc.thread.pid = pid_of.get(tid, profile.pid)
        desc.thread.tid = tid
        if tid in profile.thread_names:
            desc.thread.thread_name = profile.thread_names[tid]
    op_tids = as_columns(profile.ops).thread_ids() if profile.counter_names else []
    track_names = profile.counter_names + [m for m, *_ in derived_tracks(profile.counter_names)]
    for tid in op_tids:
        for i, name in enumerate(track_names):
            pkt = header.add_packet()
            pkt.trusted_packet_sequence_id = MAIN_SEQUENCE
            desc = pkt.track_descriptor
            desc.uuid = counter_track_uuid(tid, i)
            desc.parent_uuid = thread_uuid(tid)
            desc.name = name
            desc.counter.SetInParent()

    footer = TraceProtoBuilder()
    pkt = footer.add_packet()
    pkt.trusted_packet_sequence_id = MAIN_SEQUENCE
    counter_attrs = [(ATTR_COUNTERS, ",".join(profile.counter_names))] if profile.counter_names else []
    counter_attrs += [(ATTR_DROPPED_PREFIX + k, v) for k, v in profile.counter_dropped.items()]
    for key, value in [(ATTR_FORMAT, FORMAT_VERSION), (ATTR_LOST, profile.lost_events),
                       *counter_attrs,
                       *((ATTR_META_PREFIX + k, str(v)) for k, v in profile.meta.items())]:
        attr = pkt.trace_attributes.attribute.add()
        attr.key = key
        if isinstance(value, str):
            attr.string_value = value
        else:
            attr.long_value = value

    with open(path, "wb") as f:
        parts: list[bytes] = [header.serialize()]

        def flush() -> None:
            f.write(b"".join(parts))
            parts.clear()

        for bundle in _ftrace_packets(profile, boot_offset):
            parts.append(bundle)
        for seq_id, tid in enumerate(sorted(by_tid), start=MAIN_SEQUENCE + 1):
            items = by_tid[tid]
            _ThreadSequence(parts, flush, seq_id, tid, items.first_ns).write(
                items, profile.counter_names, tid)
        parts.append(_cuda_tracks(profile, MAIN_SEQUENCE + 1 + len(by_tid)))
        parts.append(footer.serialize())
        flush()


def _ftrace_packets(profile: Profile, boot_offset: int) -> Iterator[bytes]:
    """Serialized packets of FtraceEventBundles (one CPU each, time-ordered) for the sched events."""
    by_cpu: dict[int, list[tuple]] = defaultdict(list)
    for sw in profile.switches:
        by_cpu[sw.cpu].append((sw.ts_ns, 0, sw))
    for w in profile.wakeups:
        by_cpu[w.cpu].append((w.ts_ns, 1, w))
    for cpu in sorted(by_cpu):
        evs = sorted(by_cpu[cpu], key=lambda e: (e[0], e[1]))
        for i in range(0, len(evs), _FTRACE_BUNDLE):
            builder = TraceProtoBuilder()
            pkt = builder.add_packet()
            pkt.trusted_packet_sequence_id = MAIN_SEQUENCE
            pkt.ftrace_events.cpu = cpu
            for ts, kind, obj in evs[i:i + _FTRACE_BUNDLE]:
                ev = pkt.ftrace_events.event.add()
                ev.timestamp = ts + boot_offset
                if kind == 0:
                    ev.pid = obj.prev_tid
                    sw = ev.sched_switch
                    sw.prev_comm, sw.prev_pid, sw.prev_prio, sw.prev_state = (
                        obj.prev_comm, obj.prev_tid, DEFAULT_PRIO, obj.prev_state)
                    sw.next_comm, sw.next_pid, sw.next_prio = obj.next_comm, obj.next_tid, DEFAULT_PRIO
                else:
                    ev.pid = obj.waker_tid
                    wk = ev.sched_wakeup
                    wk.comm, wk.pid, wk.prio, wk.success, wk.target_cpu = (
                        obj.comm, obj.tid, DEFAULT_PRIO, 1, cpu)
            yield builder.serialize()


# --------------------------------------------------------------------------- Chrome JSON

def _chrome_args(args: list[tuple]) -> dict:
    return {k: (hex(v) if kind == _PTR else v) for k, kind, v in args}


def chrome_events(profile: Profile) -> Iterator[dict]:
    """Chrome trace events: process/thread name metadata, then one "X" event per slice (ts in µs)."""
    pid = profile.pid
    pid_of = {c.tid: c.pid for c in profile.calls}
    pid_of.update((c.tid, c.pid) for c in profile.cuda_calls if c.tid and c.pid != profile.pid)
    yield {"ph": "M", "pid": pid, "tid": pid, "name": "process_name",
           "args": {"name": profile.process_name}}
    for tid, name in sorted(profile.thread_names.items()):
        yield {"ph": "M", "pid": pid_of.get(tid, pid), "tid": tid, "name": "thread_name", "args": {"name": name}}
    for tid, items in sorted(thread_items(profile).items()):
        pid = pid_of.get(tid, profile.pid)
        open_begins: list[int] = []
        for ev in plan(items):
            kind, ts, obj = ev[0], ev[1], ev[2]
            if kind in ("B", "b"):
                open_begins.append(ts)
                continue
            start = open_begins.pop()
            if kind == "E":
                cat, name, args = begin_fields(obj)
                args = _chrome_args(args)
                if ev[3]:
                    args.update(ev[3])
                if isinstance(obj, OpSlice) and obj.counters is not None:
                    args.update((COUNTER_ARG_PREFIX + n, v) for n, v in zip(profile.counter_names, obj.counters))
                if isinstance(obj, OpSlice) and obj.experts is not None:
                    args["experts"] = experts_str(obj.experts)
            else:
                cat, name, args = CAT_BARRIER, BARRIER_NAME, {}
            yield {"ph": "X", "pid": pid, "tid": tid, "name": name, "cat": cat,
                   "ts": start / 1000, "dur": (ts - start) / 1000, "args": args}


def write_chrome_json(profile: Profile, path: str | Path) -> None:
    """Write Chrome trace-event JSON (chrome://tracing, ui.perfetto.dev); streamed, one event a line.

    No displayTimeUnit key: trace_processor takes it as the unit of "ts", which is µs here.
    Non-ASCII stays raw UTF-8 because trace_processor's JSON reader rejects \\u escapes.
    """
    metadata = {"profinfer.format": FORMAT_VERSION, "lost_events": profile.lost_events,
                **{ATTR_META_PREFIX + k: v for k, v in profile.meta.items()}}
    with open(path, "w", encoding="utf-8") as f:
        f.write('{"traceEvents": [\n')
        sep = ""
        for ev in chrome_events(profile):
            f.write(sep + json.dumps(ev, ensure_ascii=False))
            sep = ",\n"
        f.write('\n],\n"metadata": ' + json.dumps(metadata, ensure_ascii=False) + "}\n")
