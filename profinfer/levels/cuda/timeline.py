"""The cuda level's tracks in a Perfetto trace.

Each call is a slice (category cuda, name = the function called) on its thread's track,
under the op it was made in; counted calls (BPF's groups, no timeline) are not slices. Each
process has, on the level's own sequence, one track per stream with its launches in order
(graph launches too; category cuda_stream, name = the kernel) and a counter track of its live
device memory.
"""
from __future__ import annotations

from perfetto.protos.perfetto.trace.perfetto_trace_pb2 import BuiltinClock, TrackEvent
from perfetto.trace_builder.proto_builder import TraceProtoBuilder

from profinfer.levels.cuda.records import CudaCall
from profinfer.core.plugin.timeline import (
    INT, LEVEL_RUNTIME, STR, SliceKind, Timeline, process_track_uuid, process_uuid,
)
from profinfer.levels.cuda.stats import live_memory

CAT_CUDA, CAT_CUDA_STREAM = "cuda", "cuda_stream"
LIVE_MEMORY_TRACK = "CUDA live device memory (bytes)"
# its process tracks' kinds (core.timeline.process_track_uuid)
STREAM_TRACKS, MEMORY_TRACKS = 5, 6
MONOTONIC = BuiltinClock.BUILTIN_CLOCK_MONOTONIC

_CUDA_INTS = ("shmem", "stream", "bytes", "ptr", "handle", "ret", "step")
_CUDA_STRS = ("what", "kernel", "copy_kind", "caller", "op")


def cuda_args(c: CudaCall) -> tuple:
    args = tuple((k, STR, getattr(c, k)) for k in _CUDA_STRS if getattr(c, k))
    args += tuple((k, INT, getattr(c, k)) for k in _CUDA_INTS if getattr(c, k))
    if c.what == "launch":
        args += (("grid", STR, "x".join(map(str, c.grid))), ("block", STR, "x".join(map(str, c.block))))
    if c.captured:
        args += (("captured", INT, 1),)
    return args


def cuda_call_from(pid: int, tid: int, start: int, end: int, api: str, args: dict) -> CudaCall:
    def dims(k):
        return tuple(int(x) for x in args[k].split("x")) if k in args else (0, 0, 0)
    return CudaCall(pid, tid, api, args.get("what", ""), start, end, 1, end - start if end else 0,
                    args.get("kernel", ""), dims("grid"), dims("block"),
                    *(args.get(k, 0) for k in ("shmem", "stream", "bytes")), args.get("copy_kind", ""),
                    args.get("ptr", 0), args.get("handle", 0), args.get("ret", 0), args.get("caller", ""),
                    bool(args.get("captured", 0)), args.get("step", 0), args.get("op", ""))


def _timed(profile) -> list[CudaCall]:
    """The calls with a timeline (counted in BPF, a group has none: not slices)."""
    return [c for c in profile.cuda_calls if c.count == 1 and c.start_ns]


class CudaKind(SliceKind):
    category, field = CAT_CUDA, "cuda_calls"

    def begin(self, obj: CudaCall):
        return CAT_CUDA, obj.api, cuda_args(obj)

    def read(self, reader, seq, start, ts, tid, name, begin_args, end_args):
        return cuda_call_from(reader.pid_of(tid), tid, start, end_args.get("end_ns", ts), name, begin_args)


class StreamKind(SliceKind):
    """The launches again, by stream, on process tracks: read back from the thread tracks."""
    category = CAT_CUDA_STREAM


class CudaTimeline(Timeline):
    process_track_kinds = (STREAM_TRACKS, MEMORY_TRACKS)

    def __init__(self):
        self.call = CudaKind()
        self.kinds = (self.call, StreamKind())

    def slices(self, profile):
        for c in _timed(profile):
            yield self.call, c, LEVEL_RUNTIME

    def thread_pids(self, profile):
        return {c.tid: c.pid for c in profile.cuda_calls if c.tid and c.pid != profile.pid}

    def process_tracks(self, profile, seq_id: int) -> bytes:
        """One track per (process, stream) with its launches in order (graph launches too), and a
        counter track of each process's live device memory."""
        timed = _timed(profile)
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


TIMELINE = CudaTimeline()
