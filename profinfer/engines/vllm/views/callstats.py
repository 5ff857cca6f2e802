"""Statistics of engines whose ops are function calls (vLLM): per op, per op and argument
shapes, per step and per phase. Engine-neutral: it reads Profile.calls and Profile.steps, and
the calls counted instead of sent (Profile.call_totals and call_hists: no timeline asked),
whose percentiles come from their histograms (core.loghist)."""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from profinfer.core.profile import loghist
from profinfer.core.profile.model import CallTotal, OpCall, Profile, Step
from profinfer.core.profile.stats import OpStats


@dataclass
class ShapeStats:
    op: str
    args: tuple[tuple[str, str, tuple[int, ...] | None], ...]   # (name, dtype, shape)
    count: int
    total_ns: int


@dataclass
class PhaseStats:
    steps: int = 0
    tokens: int = 0
    time_ns: int = 0
    op_ns: int = 0

    @property
    def tokens_per_s(self) -> float | None:
        return self.tokens / (self.time_ns / 1e9) if self.time_ns else None


@dataclass
class CallProfileStats:
    ops: list[OpStats]                 # share: of all top-level op time
    shapes: list[ShapeStats]
    steps: list[Step]
    phases: dict[str, PhaseStats] = field(default_factory=dict)
    prefill_tokens: int = 0
    decode_tokens: int = 0
    op_total_ns: int = 0
    threads: dict[int, int] = field(default_factory=dict)   # tid -> top-level op ns
    steps_per_s: float | None = None


# the signature of calls counted where BPF's table of signatures was full
NOT_KEPT = (("(shapes not kept)", "", None),)


def signature(call: OpCall | CallTotal) -> tuple[tuple[str, str, tuple[int, ...] | None], ...]:
    if call.args is None:
        return NOT_KEPT
    return tuple((a.name, a.dtype, a.shape) for a in call.args)


def _op_stats(profile: Profile, total_ns: int) -> list[OpStats]:
    """Per op: the calls sent, each timed, and those counted, with their histogram."""
    by_op: dict[str, list[int]] = defaultdict(list)
    for c in profile.calls:
        by_op[c.op].append(c.dur_ns)
    counted: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for t in profile.call_totals:
        counted[t.op][0] += t.calls
        counted[t.op][1] += t.total_ns
    ops = []
    for name in by_op.keys() | counted.keys():
        d = np.asarray(by_op.get(name, ()), dtype=np.int64)
        calls, ns = counted.get(name, (0, 0))
        n, ns = len(d) + calls, int(d.sum()) + ns
        if not n:
            continue
        hist = profile.call_hists.get(name)
        if calls and hist is not None:
            p50, p99 = loghist.percentiles(loghist.add(hist, d), [50, 99])
        elif len(d):
            p50, p99 = (float(x) for x in np.percentile(d, [50, 99]))
        else:
            p50 = p99 = None
        ops.append(OpStats(name, n, ns, ns / n, p50, p99, ns / total_ns))
    ops.sort(key=lambda o: -o.total_ns)
    return ops


def compute(profile: Profile) -> CallProfileStats:
    top = [c for c in profile.calls if c.depth == 0]
    counted_top = [t for t in profile.call_totals if not t.nested]
    op_total = sum(c.dur_ns for c in top) + sum(t.total_ns for t in counted_top)
    ops = _op_stats(profile, op_total or 1)
    shapes: dict[tuple, ShapeStats] = {}
    for c in (*profile.calls, *profile.call_totals):
        key = (c.op, signature(c))
        calls, ns = (c.calls, c.total_ns) if isinstance(c, CallTotal) else (1, c.dur_ns)
        s = shapes.get(key)
        if s is None:
            shapes[key] = ShapeStats(c.op, key[1], calls, ns)
        else:
            s.count += calls
            s.total_ns += ns
    threads: dict[int, int] = defaultdict(int)
    for c in top:
        threads[c.tid] += c.dur_ns
    for t in counted_top:
        threads[t.tid] += t.total_ns
    st = CallProfileStats(ops, sorted(shapes.values(), key=lambda s: -s.total_ns), profile.steps,
                          op_total_ns=op_total, threads=dict(threads))
    phases = {"prefill": PhaseStats(), "decode": PhaseStats(), "mixed": PhaseStats()}
    calls_by_step = _op_time_by_step(top, profile.steps)
    for step, op_ns in zip(profile.steps, calls_by_step):
        ph = phases[step.phase]
        ph.steps += 1
        ph.tokens += step.n_tokens
        ph.time_ns += step.dur_ns
        ph.op_ns += op_ns
        st.prefill_tokens += step.prefill_tokens
        st.decode_tokens += step.decode_tokens
    for t in counted_top:           # counted in the phase of the step each call began in
        if t.phase in phases:
            phases[t.phase].op_ns += t.total_ns
    st.phases = phases
    if len(profile.steps) > 1:
        span = profile.steps[-1].end_ns - profile.steps[0].start_ns
        st.steps_per_s = len(profile.steps) / (span / 1e9) if span > 0 else None
    return st


def _op_time_by_step(top: list[OpCall], steps: list[Step]) -> list[int]:
    """Top-level op time inside each step (same thread, within its span)."""
    out = []
    by_thread: dict[tuple[int, int], list[OpCall]] = defaultdict(list)
    for c in top:
        by_thread[(c.pid, c.tid)].append(c)
    starts = {k: np.array([c.start_ns for c in v], dtype=np.int64) for k, v in by_thread.items()}
    durs = {k: np.array([c.dur_ns for c in v], dtype=np.int64) for k, v in by_thread.items()}
    for s in steps:
        k = (s.pid, s.tid)
        if k not in starts:
            out.append(0)
            continue
        lo, hi = np.searchsorted(starts[k], [s.start_ns, s.end_ns], side="left")
        out.append(int(durs[k][lo:hi].sum()))
    return out


@dataclass
class ServerRow:
    what: str
    server: float | None       # the engine's own /metrics, over the recording
    ours: float | None         # profinfer's figure for the same, where it has one
    unit: str


def server_rows(profile: Profile, st: CallProfileStats) -> list[ServerRow]:
    """The engine server's own counts over the recording (meta server:*, scraped from its
    /metrics at the start and end), beside profinfer's."""
    m = {k[len("server:"):]: float(v) for k, v in profile.meta.items() if k.startswith("server:")}
    if not m:
        return []

    def mean(name: str) -> float | None:
        n = m.get(name + "_count")
        return m[name + "_sum"] / n if n else None

    dec = st.phases["decode"]
    return [
        ServerRow("steps", m.get("vllm:iteration_tokens_total_count"), len(st.steps), ""),
        ServerRow("prompt tokens", m.get("vllm:prompt_tokens"), st.prefill_tokens, ""),
        ServerRow("generated tokens", m.get("vllm:generation_tokens"), None, ""),
        ServerRow("requests finished", m.get("vllm:e2e_request_latency_seconds_count"), None, ""),
        ServerRow("time to first token, mean", mean("vllm:time_to_first_token_seconds"), None, "s"),
        ServerRow("inter-token latency, mean (ours: decode step)", mean("vllm:inter_token_latency_seconds"),
                  dec.time_ns / dec.steps / 1e9 if dec.steps else None, "s"),
    ]
