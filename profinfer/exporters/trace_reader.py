"""Read a trace written by exporters.perfetto.write_perfetto back into a Profile.

The result equals the written Profile with each kind of record sorted by (start_ns, tid)
(stable). Only our own layout is understood (see exporters/perfetto.py): this module reads
the frame, and each plugin's timeline module the slices and packets of its own records.
A file that is not one, is damaged or was cut short raises TraceFormatError.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

from google.protobuf.message import DecodeError
from perfetto.protos.perfetto.trace.perfetto_trace_pb2 import TracePacket, TrackEvent

from profinfer.core.target import procfs
from profinfer.core.profile.model import Profile
from profinfer.core.plugin.timeline import Timeline, TraceFormatError
from profinfer.exporters.perfetto import (
    ATTR_FORMAT, ATTR_LOST, ATTR_META_PREFIX, BOOTTIME, FORMAT_VERSION, INTERN_TABLES, MONOTONIC,
    SEQ_CLOCK, process_track_of, timelines,
)

__all__ = ["TraceFormatError", "read_named_tracks", "read_trace"]

_BEGIN, _END, _COUNTER = TrackEvent.TYPE_SLICE_BEGIN, TrackEvent.TYPE_SLICE_END, TrackEvent.TYPE_COUNTER
_DECODE_CACHE_LIMIT = 200_000
_PROFILE_FIELDS = {f.name for f in dataclasses.fields(Profile)}


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    """(value, next position); IndexError past the end of data."""
    b = data[pos]
    if b < 0x80:
        return b, pos + 1
    value, shift = b & 0x7F, 7
    while True:
        pos += 1
        b = data[pos]
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, pos + 1
        shift += 7
        if shift > 63:
            raise TraceFormatError(f"malformed varint at offset {pos}")


class _Sequence:
    def __init__(self):
        self.tables: dict[str, dict[int, str]] = {k: {} for k in INTERN_TABLES}
        self.clock_id = 0
        self.track_uuid = 0
        self.ts = 0                  # absolute time of the last packet on the incremental clock
        self.decoded: dict[bytes, tuple] = {}   # track_event bytes -> (type, cat, name, args, tid)
        self.open: list[tuple] = []  # BEGINs waiting for their END: (ts, cat, name, args, tid)
        self.state: dict = {}        # what a plugin's slice kinds keep per sequence


class _Reader:
    def __init__(self):
        self.parts: list[Timeline] = timelines()
        self.kinds = {k.category: k for part in self.parts for k in part.kinds}
        self.packet_readers = {kind: part for part in self.parts for kind in part.packet_kinds}
        self.end_readers = [p for p in self.parts if type(p).read_end is not Timeline.read_end]
        self.seqs: dict[int, _Sequence] = {}
        self.pid: int | None = None
        self.process_name = ""
        self.thread_names: dict[int, str] = {}
        self.track_tid: dict[int, int] = {}
        self.attrs: dict[str, object] = {}
        self.records: dict[str, list] = {}        # Profile field -> the records read for it
        self.state: dict = {}                     # what plugins keep until the trace is read
        self.track_names: dict[int, str] = {}
        self.collect_named = False                # read_named_tracks: keep what those tracks hold
        self.named_tracks: dict[tuple[int, str], list] = {}   # (pid, track name): slice names or values
        self.track_pid: dict[int, int] = {}
        self.boot_offset = 0

    def pid_of(self, tid: int) -> int:
        """The process of a thread track (the profiled process's when not said)."""
        return self.track_pid.get(tid, self.pid or 0)

    def read(self, data: bytes) -> None:
        """Walk the Trace framing. Slice packets (sequence id, timestamp and track_event, nothing
        else: the writer emits millions) are split by hand; any other packet goes to protobuf."""
        pos, n = 0, len(data)
        seq_id, seq = None, None
        while pos < n:
            if data[pos] != 0x0A:    # Trace.packet = 1, length-delimited
                raise TraceFormatError(f"unexpected byte 0x{data[pos]:02x} at offset {pos}, "
                                       "not a Perfetto trace packet")
            length, start = _varint(data, pos + 1)
            end = start + length
            if end > n:
                raise TraceFormatError(f"truncated packet at offset {pos} ({length} bytes announced, "
                                       f"{n - start} left)")
            pkt_seq = ts = te = None
            p = start
            while p < end:
                tag = data[p]
                if tag == 0x50:      # trusted_packet_sequence_id = 10
                    pkt_seq, p = _varint(data, p + 1)
                elif tag == 0x40:    # timestamp = 8
                    ts, p = _varint(data, p + 1)
                elif tag == 0x5A:    # track_event = 11
                    size, p = _varint(data, p + 1)
                    te = data[p:p + size]
                    p += size
                else:
                    break
            if p == end and te is not None and ts is not None and pkt_seq is not None:
                if pkt_seq != seq_id:
                    seq_id, seq = pkt_seq, self.seqs.get(pkt_seq)
                    if seq is None:
                        seq = self.seqs[pkt_seq] = _Sequence()
                self.track_event(seq, ts, te)
            else:
                try:
                    pkt = TracePacket.FromString(data[start:end])
                except DecodeError as e:
                    raise TraceFormatError(f"undecodable packet at offset {pos}: {e}") from None
                self.packet(pkt)
                seq_id = None        # the packet may have replaced its sequence's state
            pos = end

    def packet(self, pkt: TracePacket) -> None:
        seq = self.seqs.get(pkt.trusted_packet_sequence_id)
        if seq is None or pkt.sequence_flags & TracePacket.SEQ_INCREMENTAL_STATE_CLEARED:
            seq = self.seqs[pkt.trusted_packet_sequence_id] = _Sequence()
        if pkt.HasField("trace_packet_defaults"):
            d = pkt.trace_packet_defaults
            seq.clock_id = d.timestamp_clock_id
            seq.track_uuid = d.track_event_defaults.track_uuid
            seq.decoded.clear()
        if pkt.HasField("interned_data"):
            for kind, field in INTERN_TABLES.items():
                table = seq.tables[kind]
                for entry in getattr(pkt.interned_data, field):
                    value = entry.str.decode() if kind == "str" else entry.name
                    if not isinstance(value, str):      # a name that is not UTF-8
                        raise TraceFormatError(f"an interned {kind} that is not UTF-8 text: {value[:40]!r}")
                    if table.setdefault(entry.iid, value) != value:   # redefined: cached decodes are stale
                        table[entry.iid] = value
                        seq.decoded.clear()
        data = pkt.WhichOneof("data")
        if data == "track_event":
            self.track_event(seq, pkt.timestamp, pkt.track_event.SerializeToString())
        elif data == "clock_snapshot":
            clocks = {c.clock_id: c.timestamp for c in pkt.clock_snapshot.clocks}
            if SEQ_CLOCK in clocks:
                seq.ts = clocks[SEQ_CLOCK]
            if MONOTONIC in clocks and BOOTTIME in clocks:
                self.boot_offset = clocks[BOOTTIME] - clocks[MONOTONIC]
        elif data in self.packet_readers:
            self.packet_readers[data].read_packet(self, pkt)
        elif data == "track_descriptor":
            desc = pkt.track_descriptor
            if desc.HasField("process"):
                if self.pid is None:             # the profiled process comes first
                    self.pid = desc.process.pid
                    self.process_name = desc.process.process_name
            elif process_track_of(desc.uuid):      # a plugin's track of a process, not a thread
                self.track_names[desc.uuid] = desc.name
            elif desc.HasField("thread"):
                self.track_tid[desc.uuid] = desc.thread.tid
                self.track_pid[desc.thread.tid] = desc.thread.pid
                if desc.thread.HasField("thread_name"):
                    self.thread_names[desc.thread.tid] = desc.thread.thread_name
        elif data == "trace_attributes":
            for a in pkt.trace_attributes.attribute:
                self.attrs[a.key] = (a.string_value if a.WhichOneof("value") == "string_value"
                                     else a.long_value)

    def decode(self, seq: _Sequence, te_bytes: bytes) -> tuple:
        """(type, category, name, args, tid) of a TrackEvent body, names resolved through interning."""
        te = TrackEvent.FromString(te_bytes)
        strings = seq.tables["str"]
        args = {}
        for ann in te.debug_annotations:
            kind = ann.WhichOneof("value")
            value = strings[ann.string_value_iid] if kind == "string_value_iid" else getattr(ann, kind)
            args[seq.tables["arg"][ann.name_iid]] = value
        uuid = te.track_uuid if te.HasField("track_uuid") else seq.track_uuid
        if uuid in self.track_names:     # a process's track, not a thread's
            if self.collect_named:
                value = te.name if te.type == _BEGIN else te.counter_value if te.type == _COUNTER else None
                if value is not None:
                    key = (process_track_of(uuid)[1], self.track_names[uuid])
                    self.named_tracks.setdefault(key, []).append(value)
            return None, None, None, args, None
        if te.type != _BEGIN:
            return te.type, None, None, args, None
        cat = seq.tables["cat"][te.category_iids[0]]
        kind = self.kinds.get(cat)
        if kind is not None:
            kind.parse_begin(args)   # once per distinct event body, not per slice
        return te.type, cat, seq.tables["name"][te.name_iid], args, self.track_tid.get(uuid)

    def track_event(self, seq: _Sequence, ts: int, te_bytes: bytes) -> None:
        if seq.clock_id == SEQ_CLOCK:
            seq.ts += ts
            ts = seq.ts
        decoded = seq.decoded.get(te_bytes)
        if decoded is None:
            decoded = self.decode(seq, te_bytes)
            if len(seq.decoded) >= _DECODE_CACHE_LIMIT:
                seq.decoded.clear()
            seq.decoded[te_bytes] = decoded
        etype, cat, name, args, tid = decoded
        if etype is None:
            seq.decoded.pop(te_bytes, None)     # a named track's: each one counts
            return
        if etype == _COUNTER:        # counter tracks repeat the slices' END arguments
            return
        if etype == _BEGIN:
            seq.open.append((ts, cat, name, args, tid))
            return
        if etype != _END:
            raise TraceFormatError(f"unexpected track event type {etype}")
        if not seq.open:
            raise TraceFormatError("slice END without BEGIN")
        start, cat, name, begin_args, tid = seq.open.pop()
        kind = self.kinds.get(cat)
        if kind is None:
            raise TraceFormatError(f"unknown slice category {cat!r}")
        record = kind.read(self, seq, start, ts, tid, name, begin_args, args)
        if record is not None:
            self.records.setdefault(kind.field, []).append(record)
            if args:
                for part in self.end_readers:
                    part.read_end(self, record, args)

    def profile(self) -> Profile:
        version = self.attrs.get(ATTR_FORMAT)
        if version is None:
            raise TraceFormatError(f"not a profinfer trace, or cut short (no {ATTR_FORMAT} attribute)")
        if version != FORMAT_VERSION:
            raise TraceFormatError(f"unsupported profinfer trace format {version} "
                                   f"(this version reads {FORMAT_VERSION})")
        if self.pid is None:
            raise TraceFormatError("no process descriptor")
        if any(s.open for s in self.seqs.values()):
            raise TraceFormatError("slices left open at the end of the trace")

        fields: dict[str, object] = {}
        for part in self.parts:
            fields.update(part.read_done(self))
        for kind in self.kinds.values():
            if kind.field is not None:
                fields[kind.field] = kind.collect(self.records.get(kind.field, []))
        own = {f: fields.pop(f) for f in list(fields) if f not in _PROFILE_FIELDS}
        return Profile(
            pid=self.pid, process_name=self.process_name, thread_names=self.thread_names,
            lost_events=int(self.attrs.get(ATTR_LOST, 0)),
            meta={k[len(ATTR_META_PREFIX):]: str(v) for k, v in self.attrs.items()
                  if k.startswith(ATTR_META_PREFIX)},
            records={f: v for f, v in own.items() if len(v)}, **fields)   # where any were read


def read_trace(path: str | Path) -> Profile:
    """Load a profinfer Perfetto trace. OSError for an unreadable path or one that is not a
    regular file, TraceFormatError for bad content."""
    data = procfs.read_regular(str(path))
    if not data:
        raise TraceFormatError(f"{path}: empty file")
    reader = _Reader()
    try:
        reader.read(data)
        return reader.profile()
    except TraceFormatError as e:
        message = str(e)
    except (DecodeError, KeyError, IndexError, ValueError, TypeError, AttributeError, OverflowError) as e:
        # well framed, but not our layout (unknown interned id, missing argument, cut varint...)
        message = f"not a valid profinfer trace ({type(e).__name__}: {e})"
    raise TraceFormatError(f"{path}: {message}".replace("\n", " "))


def read_named_tracks(path: str | Path) -> dict[tuple[int, str], list]:
    """The trace's tracks that belong to a process, not a thread, by (pid, name): the cuda
    level's stream tracks (their launches' kernel names in order) and live-memory counters
    (their values)."""
    reader = _Reader()
    reader.collect_named = True
    try:
        reader.read(procfs.read_regular(str(path)))
    except (DecodeError, KeyError, IndexError, ValueError, TypeError, AttributeError, OverflowError) as e:
        raise TraceFormatError(f"{path}: not a valid profinfer trace ({type(e).__name__}: {e})") from None
    return reader.named_tracks
