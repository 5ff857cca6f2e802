"""Timeline export: native Perfetto protobuf trace, and Chrome trace-event JSON as a fallback.

This module writes the frame; each plugin's timeline module (profinfer/core/plugin/timeline.py: the
contract) writes the slices and tracks of its own records. Protobuf layout (trace_reader.py
reads exactly this back into a Profile):
- sequence 1: a ClockSnapshot making CLOCK_MONOTONIC the trace clock (our timestamps are
  bpf_ktime_get_ns) and relating BOOTTIME to it (offset Profile.meta["boottime_offset_ns"]),
  the process and thread TrackDescriptors (the profiled process first, then others whose
  threads have slices), the plugins' own descriptors and main-sequence packets, and as the
  very last packet a TraceAttributes packet (profinfer.format, profinfer.lost_events, the
  plugins' attributes, meta.<key> per Profile.meta). trace_processor lists those in its
  metadata table as trace_attribute.*; the UI shows them in the trace overview. Being last,
  it also tells the reader the file was not cut short.
- one sequence per thread (2, 3, ...): its first packet clears incremental state, sets packet
  defaults (track = the thread's track, clock = sequence clock 64) and snapshots clock 64 as an
  incremental nanosecond clock equal to MONOTONIC. Then TrackEvent slice BEGIN/END packets in
  time order whose timestamps are deltas, with interned names, categories, argument names and
  string values. This keeps an op (4 packets with its barrier) to a few dozen bytes.
- then each plugin's own sequence, if it has tracks of its own (per process).
- slices on one track must nest strictly (a slice of a lower level is the parent); where the
  data overlaps (clock rounding, a next op starting before the previous barrier ended) the
  slice is cut short and its END carries the true end_ns (or other end field), so nothing is
  lost.
"""
from __future__ import annotations

import heapq
import json
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

from perfetto.protos.perfetto.trace.perfetto_trace_pb2 import (
    BuiltinClock, InternedData, TracePacket, TrackEvent,
)
from perfetto.trace_builder.proto_builder import TraceProtoBuilder

from profinfer.core.base import registry
from profinfer.core.profile.model import Profile
from profinfer.core.plugin.timeline import (
    DBL, INT, MAIN_SEQUENCE, PTR, STR, Timeline, process_track_kind, process_uuid, thread_uuid,
)

FORMAT_VERSION = 1
SEQ_CLOCK = 64                       # first sequence-scoped clock id
MONOTONIC = BuiltinClock.BUILTIN_CLOCK_MONOTONIC
BOOTTIME = BuiltinClock.BUILTIN_CLOCK_BOOTTIME
META_BOOT_OFFSET = "boottime_offset_ns"
ATTR_FORMAT, ATTR_LOST, ATTR_META_PREFIX = "profinfer.format", "profinfer.lost_events", "meta."

# interned-data table per kind of string
INTERN_TABLES = {"cat": "event_categories", "name": "event_names",
                 "arg": "debug_annotation_names", "str": "debug_annotation_string_values"}


def timelines() -> list[Timeline]:
    """The registered plugins' timeline parts, in the registry's order."""
    parts = []
    for p in registry.plugins():
        module = p.part("timeline")
        if module is not None:
            parts.append(module.TIMELINE)
    return parts


def process_track_of(uuid: int) -> tuple[int, int] | None:
    """(kind, pid) of a plugin's process track's uuid; None for any other track."""
    kind, pid = process_track_kind(uuid)
    if kind and any(kind in t.process_track_kinds for t in timelines()):
        return kind, pid
    return None


def __getattr__(name: str):
    """Names that moved to a plugin's timeline module (LIVE_MEMORY_TRACK, cuda_call_from,
    ATTR_COUNTERS, ...) stay importable from here, found through the registry."""
    if not name.startswith("_"):
        for p in registry.plugins():
            module = p.part("timeline")
            value = getattr(module, name, None)
            if value is not None and not isinstance(value, ModuleType) \
                    and getattr(value, "__module__", module.__name__) == module.__name__:
                return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# --------------------------------------------------------------------------- slice planning

class ThreadItems:
    """One thread's slices as (start, level, seq, obj, kind), sorted so parents precede
    children at equal starts. The records of a plugin's runs are made one at a time as they
    are written (a profile's ops are columns; a whole run of them as objects would not fit in
    the collector's memory)."""

    def __init__(self, calls: list[tuple], runs: list[tuple[int, object]]):
        self.calls = sorted(calls)          # few
        self.runs = runs                    # (seq0, run)
        firsts = [self.calls[0][0]] if self.calls else []
        firsts += [run.first_ns for _, run in runs]
        self.first_ns = min(firsts)

    def __iter__(self) -> Iterator[tuple]:
        return heapq.merge(self.calls, *(run.items(seq0) for seq0, run in self.runs))


def thread_items(profile: Profile, parts: list[Timeline]) -> dict[int, ThreadItems]:
    calls: dict[int, list[tuple]] = defaultdict(list)
    seq = 0
    for part in parts:
        for kind, o, level in part.slices(profile):
            calls[o.tid].append((o.start_ns, level, seq, o, kind))
            seq += 1
    runs: dict[int, list[tuple[int, object]]] = defaultdict(list)
    for part in parts:
        part_runs = part.runs(profile)
        for tid, run in part_runs.items():
            if len(run):
                runs[tid].append((seq, run))
        seq += sum(len(run) for run in part_runs.values())
    return {tid: ThreadItems(calls.get(tid, []), runs.get(tid, []))
            for tid in sorted(set(calls) | set(runs))}


def plan(items) -> Iterator[tuple]:
    """Turn one thread's items into a strictly nested, time-ordered slice event stream.

    Yields ("B", ts, obj, kind), then what the kind's close() yields: ("E", ts, obj, kind, raw)
    with raw = {field: true value} for ends that had to be cut (or None), and ("b", ts, cat,
    name) / ("e", ts) for a slice with no record of its own (an op's barrier).
    Starts are never moved; only ends are clamped, to the parent's end or the next sibling's start.
    """
    stack: list[list] = []           # [level, obj, latest allowed end, kind]
    for start, level, _, obj, kind in items:
        while stack and (stack[-1][2] <= start or stack[-1][0] >= level):
            top = stack.pop()
            yield from top[3].close(top[1], min(top[2], start))
        extent = kind.extent(obj)
        if stack:
            extent = min(extent, stack[-1][2])
        yield ("B", start, obj, kind)
        stack.append([level, obj, max(start, extent), kind])
    while stack:
        top = stack.pop()
        yield from top[3].close(top[1], top[2])


def thread_pids(profile: Profile, parts: list[Timeline]) -> dict[int, int]:
    """The process of each thread that is not the profiled process's."""
    pid_of: dict[int, int] = {}
    for part in parts:
        pid_of.update(part.thread_pids(profile))
    return pid_of


# --------------------------------------------------------------------------- protobuf writer
#
# Structural packets are built with TraceProtoBuilder. The millions of slice packets are framed
# by hand around TrackEvent bodies that protobuf serialized once and that are reused from a cache:
# a thread repeats the same nodes token after token (bench/results.md: what a message per
# packet cost).

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
            if kind == STR:
                ann.string_value_iid = self._iid(interned, "str", value)
            elif kind == PTR:
                ann.pointer_value = value
            elif kind == DBL:
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

    def counter(self, ts: int, uuid: int, value: float) -> None:
        """A value on a counter track (a plugin's decorator writes them beside the slices)."""
        body = TrackEvent(type=TrackEvent.TYPE_COUNTER, track_uuid=uuid,
                          double_counter_value=value).SerializeToString()
        self._packet(ts, TAG_TRACK_EVENT + varint(len(body)) + body)

    def write(self, items: ThreadItems, decorators: list) -> None:
        end_plain = TAG_TRACK_EVENT + varint(len(_END_BODY)) + _END_BODY
        for ev in plan(items):
            what, ts = ev[0], ev[1]
            if what == "B":
                obj = ev[2]
                self._begin(ts, *ev[3].begin(obj))
                for d in decorators:
                    d.begin(self, ts, obj)
            elif what == "E":
                obj, raw = ev[2], ev[4]
                args = tuple((k, INT, v) for k, v in raw.items()) if raw else ()
                for d in decorators:
                    args += d.end_args(obj)
                args += ev[3].end_args(obj)
                if args:
                    self._packet(ts, b"".join(self._track_event(TrackEvent.TYPE_SLICE_END, None, None, args)))
                else:
                    self._packet(ts, end_plain)
                for d in decorators:
                    d.end(self, ts, obj)
            elif what == "b":
                self._begin(ts, ev[2], ev[3], ())
            else:
                self._packet(ts, end_plain)
            if len(self.parts) >= _FLUSH_PARTS:
                self.flush()


def _attributes_packet(attributes: list[tuple[str, object]]) -> TraceProtoBuilder:
    footer = TraceProtoBuilder()
    pkt = footer.add_packet()
    pkt.trusted_packet_sequence_id = MAIN_SEQUENCE
    for key, value in attributes:
        attr = pkt.trace_attributes.attribute.add()
        attr.key = key
        if isinstance(value, str):
            attr.string_value = value
        else:
            attr.long_value = value
    return footer


def with_meta(trace: bytes, meta: dict[str, str]) -> bytes:
    """A written trace with more meta.<key> attributes: a second attributes packet after the
    last (the reader takes every one; the last packet is still the attributes)."""
    return trace + _attributes_packet([(ATTR_META_PREFIX + k, v) for k, v in meta.items()]).serialize()


def write_perfetto(profile: Profile, path: str | Path) -> None:
    """Write `profile` as a native Perfetto trace (open it in ui.perfetto.dev or trace_processor)."""
    parts_of = timelines()
    by_tid = thread_items(profile, parts_of)
    t_min = min((items.first_ns for items in by_tid.values()), default=0)

    header = TraceProtoBuilder()

    def add_packet() -> TracePacket:
        pkt = header.add_packet()
        pkt.trusted_packet_sequence_id = MAIN_SEQUENCE
        return pkt

    pkt = add_packet()
    pkt.sequence_flags = TracePacket.SEQ_INCREMENTAL_STATE_CLEARED
    pkt.first_packet_on_sequence = True
    clock = pkt.clock_snapshot.clocks.add()
    clock.clock_id, clock.timestamp = MONOTONIC, t_min
    boot = pkt.clock_snapshot.clocks.add()
    boot_offset = int(profile.meta.get(META_BOOT_OFFSET, 0))
    boot.clock_id, boot.timestamp = BOOTTIME, max(0, t_min + boot_offset)   # an unsigned field
    pkt.clock_snapshot.primary_trace_clock = MONOTONIC   # trace time = our timestamps, unconverted
    # the profiled process first (the reader's Profile.pid), then others whose threads have
    # slices (vLLM's workers)
    pid_of = thread_pids(profile, parts_of)
    for pid in [profile.pid] + sorted(set(pid_of.values()) - {profile.pid}):
        pkt = add_packet()
        pkt.track_descriptor.uuid = process_uuid(pid)
        pkt.track_descriptor.process.pid = pid
        if pid == profile.pid:
            pkt.track_descriptor.process.process_name = profile.process_name
    for tid in sorted(set(by_tid) | set(profile.thread_names)):
        desc = add_packet().track_descriptor
        desc.uuid = thread_uuid(tid)
        desc.thread.pid = pid_of.get(tid, profile.pid)
        desc.thread.tid = tid
        if tid in profile.thread_names:
            desc.thread.thread_name = profile.thread_names[tid]
    for part in parts_of:
        part.header(profile, add_packet)

    attributes = [(ATTR_FORMAT, FORMAT_VERSION), (ATTR_LOST, profile.lost_events)]
    for part in parts_of:
        attributes += part.attributes(profile)
    attributes += [(ATTR_META_PREFIX + k, str(v)) for k, v in profile.meta.items()]
    footer = _attributes_packet(attributes)

    with open(path, "wb") as f:
        out: list[bytes] = [header.serialize()]

        def flush() -> None:
            f.write(b"".join(out))
            out.clear()

        for part in parts_of:
            out.extend(part.main_packets(profile, boot_offset))
        for seq_id, tid in enumerate(sorted(by_tid), start=MAIN_SEQUENCE + 1):
            items = by_tid[tid]
            decorators = [d for d in (part.decorator(profile, tid) for part in parts_of) if d is not None]
            _ThreadSequence(out, flush, seq_id, tid, items.first_ns).write(items, decorators)
        seq_id = MAIN_SEQUENCE + 1 + len(by_tid)
        for part in parts_of:
            own = part.process_tracks(profile, seq_id)
            if own:
                out.append(own)
                seq_id += 1
        out.append(footer.serialize())
        flush()


# --------------------------------------------------------------------------- Chrome JSON

def _chrome_args(args) -> dict:
    return {k: (hex(v) if kind == PTR else v) for k, kind, v in args}


def chrome_events(profile: Profile) -> Iterator[dict]:
    """Chrome trace events: process/thread name metadata, then one "X" event per slice (ts in µs)."""
    parts_of = timelines()
    decorating = [p for p in parts_of if type(p).chrome_args is not Timeline.chrome_args]
    pid = profile.pid
    pid_of = thread_pids(profile, parts_of)
    yield {"ph": "M", "pid": pid, "tid": pid, "name": "process_name",
           "args": {"name": profile.process_name}}
    for tid, name in sorted(profile.thread_names.items()):
        yield {"ph": "M", "pid": pid_of.get(tid, pid), "tid": tid, "name": "thread_name", "args": {"name": name}}
    for tid, items in sorted(thread_items(profile, parts_of).items()):
        pid = pid_of.get(tid, profile.pid)
        open_begins: list[tuple] = []        # (start, category and name of a slice with no record)
        for ev in plan(items):
            what, ts = ev[0], ev[1]
            if what == "B":
                open_begins.append((ts, None))
                continue
            if what == "b":
                open_begins.append((ts, ev[2:4]))
                continue
            start, plain = open_begins.pop()
            if what == "E":
                obj, kind = ev[2], ev[3]
                cat, name, args = kind.begin(obj)
                args = _chrome_args(args)
                if ev[4]:
                    args.update(ev[4])
                for part in decorating:
                    args.update(part.chrome_args(profile, obj))
                args.update(_chrome_args(kind.end_args(obj)))
            else:
                (cat, name), args = plain, {}
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
