"""The sched level's events in a Perfetto trace: ftrace sched_switch / sched_wakeup events in
FtraceEventBundles per CPU on the main sequence, so trace_processor builds thread states and
CPU tracks from them as from a kernel trace. Ftrace timestamps are BOOTTIME: the frame's clock
snapshot relates it to MONOTONIC (offset Profile.meta["boottime_offset_ns"]).
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator

from perfetto.trace_builder.proto_builder import TraceProtoBuilder

from profinfer.levels.sched.records import SchedSwitch, SchedWakeup
from profinfer.core.plugin.timeline import MAIN_SEQUENCE, Timeline

DEFAULT_PRIO = 120
_FTRACE_BUNDLE = 1000                # events per FtraceEventBundle


class SchedTimeline(Timeline):
    packet_kinds = ("ftrace_events",)

    def main_packets(self, profile, boot_offset: int) -> Iterator[bytes]:
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

    def read_packet(self, reader, pkt) -> None:
        cpu = pkt.ftrace_events.cpu
        switches = reader.records.setdefault("switches", [])
        wakeups = reader.records.setdefault("wakeups", [])
        for ev in pkt.ftrace_events.event:
            ts = ev.timestamp - reader.boot_offset
            kind = ev.WhichOneof("event")
            if kind == "sched_switch":
                sw = ev.sched_switch
                switches.append(SchedSwitch(ts, cpu, sw.prev_pid, sw.prev_comm, sw.prev_state,
                                            sw.next_pid, sw.next_comm))
            elif kind == "sched_wakeup":
                wk = ev.sched_wakeup
                wakeups.append(SchedWakeup(ts, cpu, wk.pid, wk.comm, ev.pid))

    def read_done(self, reader) -> dict:
        switches = reader.records.get("switches", [])
        ours = set(reader.track_tid.values())
        for sw in switches:          # process ids are implied by our thread tracks
            sw.prev_pid = reader.pid if sw.prev_tid in ours else 0
            sw.next_pid = reader.pid if sw.next_tid in ours else 0
        return {"switches": sorted(switches, key=lambda e: (e.ts_ns, e.cpu)),
                "wakeups": sorted(reader.records.get("wakeups", []), key=lambda e: (e.ts_ns, e.cpu))}


TIMELINE = SchedTimeline()
