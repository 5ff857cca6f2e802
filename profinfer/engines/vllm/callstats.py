"""Statistics of engines whose ops are function calls (vLLM): per op, per op and argument
shapes, per step and per phase. Engine-neutral: it reads Profile.calls and Profile.steps."""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from profinfer.core.model import OpCall, Profile, Step
from profinfer.core.stats import OpStats


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


def signature(call: OpCall) -> tuple[tuple[str, str, tuple[int, ...] | None], ...]:
    return tuple((a.name, a.dtype, a.shape) for a in call.args)


def compute(profile: Profile) -> CallProfileStats:
    top = [c for c in profile.calls if c.depth == 0]
    by_op: dict[str, list[int]] = defaultdict(list)
    for c in profile.calls:
        by_op[c.op].append(c.dur_ns)
    total = sum(c.dur_ns for c in top) or 1
    ops = []
    for name, durs in by_op.items():
        d = np.asarray(durs, dtype=np.int64)
        ops.append(OpStats(name, len(d), int(d.sum()), float(d.mean()), float(np.percentile(d, 50)),
                             float(np.percentile(d, 99)), float(d.sum()) / total))
    ops.sort(key=lambda o: -o.total_ns)
    shapes: dict[tuple, ShapeStats] = {}
    for c in profile.calls:
        key = (c.op, signature(c))
        s = shapes.get(key)
        if s is None:
            shapes[key] = ShapeStats(c.op, key[1], 1, c.dur_ns)
        else:
            s.count += 1
            s.total_ns += c.dur_ns
    threads: dict[int, int] = defaultdict(int)
    for c in top:
        threads[c.tid] += c.dur_ns
    st = CallProfileStats(ops, sorted(shapes.values(), key=lambda s: -s.total_ns), profile.steps,
                          op_total_ns=sum(c.dur_ns for c in top), threads=dict(threads))
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
