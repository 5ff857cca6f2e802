"""Scheduler view from context switches and wakeups (pure logic), and its trace round trip."""
from __future__ import annotations

from profinfer.exporters.perfetto import write_perfetto
from profinfer.exporters.trace_reader import read_trace
from profinfer.core.profile.model import OpSlice, Profile
from profinfer.levels.sched.records import SchedSwitch, SchedWakeup
from profinfer.levels.sched.stats import compute


def scenario() -> Profile:
    me, busy = 10, 99

    def out(ts, state):
        return SchedSwitch(ts, 0, me, "llama", state, busy, "busy", prev_pid=me)

    def into(ts):
        return SchedSwitch(ts, 0, busy, "busy", 0, me, "llama", next_pid=me)

    return Profile(
        pid=me, thread_names={me: "llama"},
        switches=[into(0), out(100, 0), into(150), out(300, 1), into(420), out(500, 0), into(600)],
        wakeups=[SchedWakeup(400, 1, me, "llama", 7)],
        ops=[OpSlice(me, 0, 50, 450, 460, "MUL_MAT", "a", (1, 1, 1, 1), "f32"),
             OpSlice(me, 0, 600, 700, 700, "ADD", "b", (1, 1, 1, 1), "f32")],
        meta={"boottime_offset_ns": "12345"})


def test_thread_states_and_op_overlap():
    ss = compute(scenario())
    (t,) = ss.threads
    assert (t.on_cpu_ns, t.preempted_ns, t.waking_ns, t.sleeping_ns, t.preemptions) == (330, 150, 20, 100, 2)
    assert t.preempted_by == {"busy": 150}
    assert ss.op_preempted_ns.tolist() == [50, 0]
    assert ss.op_runnable_ns.tolist() == [70, 0]
    assert ss.op_sleeping_ns.tolist() == [100, 0]
    mm = next(o for o in ss.ops if o.op == "MUL_MAT")
    assert (mm.preempted_ns, mm.runnable_ns, mm.sleeping_ns) == (50, 70, 100)


def test_no_sched_events_no_view():
    assert compute(Profile(pid=1)) is None


def test_sched_events_round_trip_through_ftrace_bundles(tmp_path):
    p = scenario()
    path = tmp_path / "s.pftrace"
    write_perfetto(p, path)
    back = read_trace(path)
    assert back.switches == p.switches and back.wakeups == p.wakeups
