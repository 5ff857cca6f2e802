"""vLLM's steps (one model forward each), made from op calls that run once per step.

The pack names those ops and the argument that holds the step's query start locations
(per sequence, the offset of its new tokens; the last value is the step's token count):
BPF reads that small tensor's values at the call, and numbers the thread's steps there: a
step holds the calls its thread makes from that call to the next step's (the next step's
input preparation, which runs before its step op, falls in the step before).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from profinfer.core.profile.model import OpCall, Step
from profinfer.core.plugin.packs import Pack
from profinfer.engines.vllm.probes.ops import SKIP, NativeOp


@dataclass(frozen=True)
class StepRule:
    op: str
    values_arg: int      # the C++ parameter whose values BPF reads


def rules(pack: Pack, ops: list[NativeOp]) -> dict[str, StepRule]:
    """The pack's step ops found among the probed ops (the first in pack order)."""
    by_name = {op.name: op for op in ops}
    for rule in pack.raw.get("step", ()):
        op = by_name.get(rule["op"])
        if op is None:
            continue
        names = [a.name for a in op.schema.args]
        arg = rule["query_start_loc"]
        if arg in names and op.kinds[names.index(arg)] != SKIP:
            return {op.name: StepRule(op.name, names.index(arg))}
    return {}


def values_of(raw: bytes, n: int, value_bytes: int) -> tuple[int, ...]:
    """BPF's values as integers: n int64 or int32, as read."""
    kind = "<i4" if value_bytes == 4 else "<i8"
    return tuple(int(v) for v in np.frombuffer(raw, kind, count=n))


def steps(calls: list[OpCall], step_rules: dict[str, StepRule],
          ends: dict[tuple[int, int], tuple[int, int]] | None = None) -> list[Step]:
    """One Step per (process, thread, step number) that holds its step op's call: BPF numbers
    each thread's steps at their step op (open_spans), and each call carries its number.
    `ends`: where the step's calls were counted, not sent, its end and calls as BPF saw them,
    by (thread, step)."""
    if not step_rules:
        return []
    by_key: dict[tuple[int, int, int], Step] = {}
    members: dict[tuple[int, int, int], list[OpCall]] = {}
    for c in calls:                                   # in start order
        key = (c.pid, c.tid, c.step)
        # the first call of the step op in its step, at whatever depth BPF gave it (an op
        # whose end the probes missed leaves every later call one deeper)
        if c.step and c.op in step_rules and key not in by_key:
            qsl = c.values
            lens = tuple(b - a for a, b in zip(qsl, qsl[1:]))
            by_key[key] = Step(c.pid, c.tid, c.start_ns, c.end_ns, qsl[-1] if qsl else 0, lens, 0)
        members.setdefault(key, []).append(c)
    for key, step in by_key.items():
        group = members[key]
        step.end_ns = max(c.end_ns for c in group)
        step.n_calls = len(group)
        seen = ends.get(key[1:]) if ends else None
        if seen is not None and seen[1]:
            step.end_ns = max(step.end_ns, seen[0])
            step.n_calls = seen[1]
    return sorted(by_key.values(), key=lambda s: (s.start_ns, s.tid))
