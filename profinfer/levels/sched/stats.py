"""Scheduler view (pure logic): each target thread's time on CPU, runnable but waiting, and
sleeping, from its context switches and wakeups; and how much of each op it was not running.

States of a thread between events:
- on CPU: from a switch that gives it the CPU to the switch that takes it away;
- runnable: taken off while still runnable (prev_state 0: preempted) until it runs again,
  or woken from sleep until it runs (wakeup latency); "preempted" is the first kind;
- sleeping: taken off in a sleeping state until its wakeup (or next run, if the wakeup
  came before the window).
Before a thread's first event its state is unknown, and that time counts in none of them.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from profinfer.core.profile.model import Profile
from profinfer.core.profile.stats import op_arrays

ON_CPU, PREEMPTED, WAKING, SLEEPING = 0, 1, 2, 3


@dataclass
class ThreadSched:
    tid: int
    name: str
    on_cpu_ns: int = 0
    preempted_ns: int = 0       # runnable after being preempted
    waking_ns: int = 0          # runnable after a wakeup, waiting for a CPU
    sleeping_ns: int = 0
    preemptions: int = 0
    # comm of the tasks that ran on its CPU while it was preempted -> ns
    preempted_by: dict[str, int] = field(default_factory=dict)

    @property
    def runnable_ns(self) -> int:
        return self.preempted_ns + self.waking_ns


@dataclass
class OpSched:
    op: str
    count: int
    op_ns: int
    preempted_ns: int
    runnable_ns: int
    sleeping_ns: int


@dataclass
class SchedStats:
    threads: list[ThreadSched]
    ops: list[OpSched]              # by preempted time, descending
    switches: int
    wakeups: int
    # per op (profile.ops order): ns preempted / runnable / sleeping inside [start, end]
    op_preempted_ns: np.ndarray
    op_runnable_ns: np.ndarray
    op_sleeping_ns: np.ndarray


def thread_intervals(profile: Profile) -> dict[int, list[tuple[int, int, int, int]]]:
    """Per target thread: (start, end, state, CPU it left) intervals, sorted."""
    events: dict[int, list[tuple]] = {}
    for s in profile.switches:
        if s.prev_pid == profile.pid or (not s.prev_pid and s.prev_tid in profile.thread_names):
            events.setdefault(s.prev_tid, []).append((s.ts_ns, 1, "out", s.prev_state, s.cpu))
        if s.next_pid == profile.pid or (not s.next_pid and s.next_tid in profile.thread_names):
            events.setdefault(s.next_tid, []).append((s.ts_ns, 0, "in", 0, s.cpu))
    for w in profile.wakeups:
        events.setdefault(w.tid, []).append((w.ts_ns, 2, "wake", 0, -1))
    out: dict[int, list[tuple[int, int, int, str]]] = {}
    for tid, evs in events.items():
        evs.sort()
        ivs = []
        state, since, cpu = None, None, -1
        for ts, _, kind, prev_state, ev_cpu in evs:
            if kind == "in":
                if state is not None:
                    ivs.append((since, ts, state, cpu))
                state, since, cpu = ON_CPU, ts, ev_cpu
            elif kind == "out":
                if state is None or state == ON_CPU:
                    if state is not None:
                        ivs.append((since, ts, ON_CPU, cpu))
                    state = PREEMPTED if prev_state == 0 else SLEEPING
                    since, cpu = ts, ev_cpu
            elif kind == "wake" and state == SLEEPING:
                ivs.append((since, ts, SLEEPING, cpu))
                state, since = WAKING, ts
        out[tid] = ivs
    return out


def _overlap(starts: np.ndarray, ends: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """For each [a, b]: total overlap with the disjoint, sorted intervals [starts, ends)."""
    if not len(starts):
        return np.zeros(len(a), np.int64)
    cum = np.concatenate([[0], np.cumsum(ends - starts)])

    def covered_before(t: np.ndarray) -> np.ndarray:
        i = np.searchsorted(starts, t, side="right") - 1
        safe = np.maximum(i, 0)
        part = np.clip(t - starts[safe], 0, ends[safe] - starts[safe])
        return np.where(i >= 0, cum[safe] + part, 0)

    return np.maximum(covered_before(b) - covered_before(a), 0)


class _CpuOccupants:
    """Who ran on each CPU, as far as the recorded switches show: after a switch, its next
    task until the CPU's next recorded switch (switches between two other tasks are not
    recorded, so a stretch goes to the last task seen taking the CPU)."""

    def __init__(self, profile: Profile):
        by_cpu: dict[int, list[tuple[int, str]]] = {}
        for s in profile.switches:
            by_cpu.setdefault(s.cpu, []).append((s.ts_ns, s.next_comm))
        self.ts = {c: np.array([e[0] for e in sorted(v)], np.int64) for c, v in by_cpu.items()}
        self.comm = {c: [e[1] for e in sorted(v)] for c, v in by_cpu.items()}

    def split(self, cpu: int, start: int, end: int, into: dict[str, int]) -> None:
        ts = self.ts.get(cpu)
        if ts is None:
            return
        i = max(int(np.searchsorted(ts, start, side="right")) - 1, 0)
        t = start
        while t < end and i < len(ts):
            nxt = int(ts[i + 1]) if i + 1 < len(ts) else end
            seg_end = min(max(nxt, t), end)
            comm = self.comm[cpu][i]
            if seg_end > t:
                into[comm] = into.get(comm, 0) + seg_end - t
            t = seg_end
            i += 1


@dataclass
class _Spans:
    """Ops as arrays: the recorded nodes (llama.cpp), or the top-level calls (vLLM)."""
    tid: np.ndarray
    start: np.ndarray
    end: np.ndarray
    code: np.ndarray
    names: list[str]

    @property
    def dur(self) -> np.ndarray:
        return self.end - self.start

    def __len__(self) -> int:
        return len(self.tid)


def _op_spans(profile: Profile):
    if not profile.calls:
        return op_arrays(profile.ops)
    top = [c for c in profile.calls if c.depth == 0]
    names = sorted({c.op for c in top})
    index = {n: k for k, n in enumerate(names)}
    return _Spans(np.array([c.tid for c in top], np.int64), np.array([c.start_ns for c in top], np.int64),
                  np.array([c.end_ns for c in top], np.int64),
                  np.array([index[c.op] for c in top], np.int64), names)


def compute(profile: Profile) -> SchedStats | None:
    if not profile.switches and not profile.wakeups:
        return None
    ivs = thread_intervals(profile)
    occupants = _CpuOccupants(profile)
    threads = []
    for tid in sorted(ivs):
        t = ThreadSched(tid, profile.thread_names.get(tid, ""))
        for start, end, state, cpu in ivs[tid]:
            d = end - start
            if state == ON_CPU:
                t.on_cpu_ns += d
            elif state == PREEMPTED:
                t.preempted_ns += d
                t.preemptions += 1
                occupants.split(cpu, start, end, t.preempted_by)
            elif state == WAKING:
                t.waking_ns += d
            else:
                t.sleeping_ns += d
        threads.append(t)
    arr = _op_spans(profile)
    n = len(arr)
    pre, run, slp = (np.zeros(n, np.int64) for _ in range(3))
    for tid, tiv in ivs.items():
        sel = np.nonzero(arr.tid == tid)[0]
        if not len(sel):
            continue
        a, b = arr.start[sel], np.maximum(arr.end[sel], arr.start[sel])
        for state_set, dest in (((PREEMPTED,), pre), ((PREEMPTED, WAKING), run), ((SLEEPING,), slp)):
            chosen = [(s, e) for s, e, st, _ in tiv if st in state_set]
            s_arr = np.array([c[0] for c in chosen], np.int64)
            e_arr = np.array([c[1] for c in chosen], np.int64)
            dest[sel] = _overlap(s_arr, e_arr, a, b)
    ops = []
    for k, name in enumerate(arr.names):
        m = arr.code == k
        ops.append(OpSched(name, int(m.sum()), int(arr.dur[m].sum()), int(pre[m].sum()),
                           int(run[m].sum()), int(slp[m].sum())))
    ops.sort(key=lambda o: (-o.preempted_ns, -o.op_ns))
    return SchedStats(threads, ops, len(profile.switches), len(profile.wakeups), pre, run, slp)
