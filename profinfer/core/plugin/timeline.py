"""The timeline contract: how a plugin's records appear in a Perfetto trace, and are read back.

The exporter (profinfer/exporters/perfetto.py) writes the frame of a trace: the clock
snapshot, process and thread descriptors, one packet sequence per thread with interned
strings and delta timestamps, the attributes packet, and the rule that slices on one track
nest strictly. The reader (exporters/trace_reader.py) reads that frame back. What the
slices are, and any track beyond the threads', comes from the plugins: a plugin whose
records belong on the timeline declares `timeline="timeline"` in its Plugin, and that module
defines TIMELINE, a Timeline. The exporter and the reader find them through the registry.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator

class TraceFormatError(ValueError):
    """The file is not a readable profinfer Perfetto trace."""


MAIN_SEQUENCE = 1      # the frame's packet sequence: descriptors, plugins' main packets, attributes

# argument value kinds: (key, kind, value) in a slice's arguments
INT, STR, PTR, DBL = 0, 1, 2, 3

# nesting levels on a thread track: a slice nests in the open one of a lower level
LEVEL_BATCH = 0        # one model forward: a llama_decode call, an engine step
LEVEL_GRAPH = 1        # a graph compute; an op that is a call, at depth 0 (one deeper per depth)
LEVEL_OP = 2           # a graph's node
LEVEL_RUNTIME = 50     # a runtime call, under whatever op is open (deeper than any op)


def process_uuid(pid: int) -> int:
    return (2 << 40) | pid


def thread_uuid(tid: int) -> int:
    return (1 << 40) | tid


def counter_track_uuid(tid: int, index: int) -> int:
    """A counter track that is a child of a thread's track."""
    return (3 << 48) | (index << 40) | tid


def process_track_uuid(kind: int, pid: int, index: int = 0) -> int:
    """A track that belongs to a process, not a thread: `kind` (a Timeline's
    process_track_kinds, 4..15) in the top bits, then the pid, then the track's number."""
    return (kind << 60) | ((pid & 0xFFFFFFFF) << 24) | (index & 0xFFFFFF)


def process_track_kind(uuid: int) -> tuple[int, int]:
    """(kind, pid) of a uuid made by process_track_uuid (kind 0 for any other)."""
    return uuid >> 60, (uuid >> 24) & 0xFFFFFFFF


class SliceKind:
    """One record type drawn as slices on its thread's track, and read back from them.

    Writing: begin() gives the slice's category, name and arguments; extent() how far it may
    reach (children are clamped to it); close() the events that end it at `at` (a slice cut
    short carries its true end in its END's arguments); end_args() arguments of its END.
    Reading: parse_begin() once per distinct BEGIN's arguments, read() the record of one
    slice (None for a slice that is no record); the records go to Profile.<field>, or to
    Profile.records[field] for a field the Profile does not have."""
    category = ""
    field: str | None = None          # where its records go

    def begin(self, obj) -> tuple[str, str, tuple]:
        raise NotImplementedError

    def extent(self, obj) -> int:
        return obj.end_ns

    def close(self, obj, at: int) -> Iterator[tuple]:
        """("E", ts, obj, kind, raw) with raw = {field: true value} where cut short (or None),
        and ("b", ts, category, name) / ("e", ts) for a slice with no record (an op's barrier)."""
        yield ("E", at, obj, self, None if at == obj.end_ns else {"end_ns": obj.end_ns})

    def end_args(self, obj) -> tuple:
        return ()

    def parse_begin(self, args: dict) -> None:
        pass

    def read(self, reader, seq, start: int, ts: int, tid: int, name: str,
             begin_args: dict, end_args: dict):
        return None

    def collect(self, records: list):
        """The Profile field's value from the records read."""
        return sorted(records, key=lambda x: (x.start_ns, x.tid))


class Timeline:
    """A plugin's part of the trace. Every hook has a default that contributes nothing."""
    kinds: tuple[SliceKind, ...] = ()           # the slice categories it writes and reads back
    process_track_kinds: tuple[int, ...] = ()   # its process_track_uuid kinds
    packet_kinds: tuple[str, ...] = ()          # TracePacket data fields it reads (read_packet)

    # -- writing
    def slices(self, profile) -> Iterable[tuple[SliceKind, object, int]]:
        """(kind, record, level) of each slice on a thread track (a record has tid, start_ns)."""
        return ()

    def runs(self, profile) -> dict[int, object]:
        """Per thread, a run of records too many to hold as objects: len(), first_ns, and
        items(seq0) yielding (start_ns, level, seq0 + k, record, kind) in time order."""
        return {}

    def thread_pids(self, profile) -> dict[int, int]:
        """The process of threads that are not the profiled process's."""
        return {}

    def header(self, profile, add_packet) -> None:
        """Add descriptors (add_packet() gives a packet on the main sequence) after the threads'."""

    def main_packets(self, profile, boot_offset: int) -> Iterable[bytes]:
        """Serialized packets on the main sequence, before the thread sequences."""
        return ()

    def process_tracks(self, profile, seq_id: int) -> bytes:
        """Serialized packets of its own sequence `seq_id`, after the thread sequences."""
        return b""

    def attributes(self, profile) -> list[tuple[str, object]]:
        """Trace attributes (str or int values), after the frame's own and before meta."""
        return []

    def decorator(self, profile, tid: int):
        """For one thread's sequence: None, or an object with begin(seq, ts, obj),
        end_args(obj) -> args and end(seq, ts, obj), called at every slice's BEGIN and END."""
        return None

    def chrome_args(self, profile, obj) -> dict:
        """Arguments it adds to a slice's Chrome JSON event."""
        return {}

    # -- reading
    def read_packet(self, reader, pkt) -> None:
        """A packet whose data field is one of packet_kinds."""

    def read_end(self, reader, record, end_args: dict) -> None:
        """The END arguments of any record read (only those that have some)."""

    def read_done(self, reader) -> dict:
        """Profile fields it fills once the whole trace is read (before the kinds' collect)."""
        return {}
