"""The sched level's records: context switches and wakeups of the target's threads."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class SchedSwitch:
    """A context switch on `cpu` in which a thread of the target left or took the CPU."""
    ts_ns: int
    cpu: int
    prev_tid: int
    prev_comm: str
    prev_state: int      # 0: still runnable (preempted); else sleeping/blocked (TASK_* bits)
    next_tid: int
    next_comm: str
    prev_pid: int = 0    # the target's pid when prev is one of its threads, else 0
    next_pid: int = 0    # likewise for next


@dataclass(slots=True)
class SchedWakeup:
    """A thread of the target made runnable by the `waker_tid` task (running on `cpu`)."""
    ts_ns: int
    cpu: int
    tid: int
    comm: str
    waker_tid: int
