"""Perf counters in a Perfetto trace (Profile.counter_names, attribute profinfer.counters).

An op's scaled deltas are "ctr:<name>" double arguments of its END event, and each thread
that ran ops has one counter track per counter (child of the thread track) holding the op's
delta from its start to its end, and one per derived metric the counters allow (IPC, miss
rates, CPU util %). The attributes profinfer.counter_dropped.<reason> carry the dropped-op
counts.
"""
from __future__ import annotations

from profinfer.core.profile.model import OpSlice
from profinfer.core.profile.opcolumns import as_columns
from profinfer.core.plugin.timeline import DBL, Timeline, TraceFormatError, counter_track_uuid, thread_uuid
from profinfer.levels.counters.stats import derived_tracks, derived_values

ATTR_COUNTERS, ATTR_DROPPED_PREFIX = "profinfer.counters", "profinfer.counter_dropped."
COUNTER_ARG_PREFIX = "ctr:"


def _counted(obj) -> bool:
    return isinstance(obj, OpSlice) and obj.counters is not None


class _ThreadCounters:
    """One thread's counter tracks, written beside its op slices."""

    def __init__(self, tid: int, names: list[str]):
        self.derived = derived_tracks(names)
        self.tracks = [counter_track_uuid(tid, i) for i in range(len(names) + len(self.derived))]
        self.arg_names = [COUNTER_ARG_PREFIX + n for n in names]

    def begin(self, seq, ts: int, obj) -> None:
        if _counted(obj):
            values = list(obj.counters) + derived_values(obj.counters, obj.dur_ns, self.derived)
            for uuid, v in zip(self.tracks, values):
                seq.counter(ts, uuid, v)

    def end_args(self, obj) -> tuple:
        if not _counted(obj):
            return ()
        return tuple((n, DBL, float(v)) for n, v in zip(self.arg_names, obj.counters))

    def end(self, seq, ts: int, obj) -> None:
        if _counted(obj):
            for uuid in self.tracks:
                seq.counter(ts, uuid, 0.0)


class CountersTimeline(Timeline):
    def header(self, profile, add_packet) -> None:
        op_tids = as_columns(profile.ops).thread_ids() if profile.counter_names else []
        track_names = profile.counter_names + [m for m, *_ in derived_tracks(profile.counter_names)]
        for tid in op_tids:
            for i, name in enumerate(track_names):
                desc = add_packet().track_descriptor
                desc.uuid = counter_track_uuid(tid, i)
                desc.parent_uuid = thread_uuid(tid)
                desc.name = name
                desc.counter.SetInParent()

    def attributes(self, profile):
        attrs = [(ATTR_COUNTERS, ",".join(profile.counter_names))] if profile.counter_names else []
        return attrs + [(ATTR_DROPPED_PREFIX + k, v) for k, v in profile.counter_dropped.items()]

    def decorator(self, profile, tid: int):
        return _ThreadCounters(tid, profile.counter_names) if profile.counter_names else None

    def chrome_args(self, profile, obj) -> dict:
        if not _counted(obj):
            return {}
        return {COUNTER_ARG_PREFIX + n: v for n, v in zip(profile.counter_names, obj.counters)}

    def read_end(self, reader, record, end_args: dict) -> None:
        if isinstance(record, OpSlice) and any(k.startswith(COUNTER_ARG_PREFIX) for k in end_args):
            # the counter names are in the attributes packet, which comes last
            reader.state.setdefault("counted_ops", []).append((record, end_args))

    def read_done(self, reader) -> dict:
        names = [n for n in str(reader.attrs.get(ATTR_COUNTERS, "")).split(",") if n]
        for op, args in reader.state.get("counted_ops", []):
            try:
                op.counters = tuple(float(args[COUNTER_ARG_PREFIX + n]) for n in names)
            except KeyError as e:
                raise TraceFormatError(f"op counter {e} not among the trace's counters {names}") from None
        return {"counter_names": names,
                "counter_dropped": {k[len(ATTR_DROPPED_PREFIX):]: int(v) for k, v in reader.attrs.items()
                                    if k.startswith(ATTR_DROPPED_PREFIX)}}


TIMELINE = CountersTimeline()
