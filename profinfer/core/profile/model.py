"""The profile model: what one profiling run observed, independent of how it was collected.

Every exporter and viewer reads this; the collector and the trace reader build it.
Times are CLOCK_MONOTONIC nanoseconds (what bpf_ktime_get_ns returns).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np


@dataclass(slots=True)
class TokenCall:
    """One llama_decode call."""
    tid: int
    start_ns: int
    end_ns: int
    n_tokens: int        # batch size (tokens submitted in this call)
    prefill: bool        # the batch carries prompt tokens (see split_batch)
    ret: int = 0         # llama_decode's return value
    # The batch's sequences, where the engine's batch was read: runs of one sequence at
    # consecutive positions, (sequence id, first position, tokens); tokens not in a run
    # (past what BPF reads) count as prompt tokens.
    runs: tuple[tuple[int, int, int], ...] = ()
    decode_tokens: int = 0   # tokens that continue a generating sequence (see split_batch)

    @property
    def dur_ns(self) -> int:
        return self.end_ns - self.start_ns

    def __post_init__(self):
        if not self.prefill and not self.decode_tokens:
            self.decode_tokens = self.n_tokens     # a decode call: all of its tokens

    @property
    def prefill_tokens(self) -> int:
        return self.n_tokens - self.decode_tokens

    @property
    def phase(self) -> str:
        """"prefill", "decode", or "mixed" for a batch with both (a server's parallel slots)."""
        if not self.prefill:
            return "decode"
        return "mixed" if self.decode_tokens else "prefill"

    @classmethod
    def of_batch(cls, tid: int, start_ns: int, end_ns: int, n_tokens: int, ret: int,
                 runs: tuple[tuple[int, int, int], ...] = ()) -> "TokenCall":
        decode = split_batch(n_tokens, runs)
        return cls(tid, start_ns, end_ns, n_tokens, decode < n_tokens, ret, runs, decode)


def split_batch(n_tokens: int, runs: tuple[tuple[int, int, int], ...]) -> int:
    """How many of a batch's tokens are decode tokens.

    With the batch's sequences known, per sequence: a sequence that adds one token after
    position 0 is decoding, one that adds more (or starts at 0) is reading its prompt. Without
    them, llama.cpp's own rule (llama_perf_context_print): a batch of one token is decode,
    of more, prefill; for a single sequence both agree."""
    if not runs:
        return n_tokens if n_tokens == 1 else 0
    return sum(1 for _, pos0, n in runs if decoding_run(pos0, n))


def decoding_run(pos0: int, n_tokens: int) -> bool:
    """A sequence that adds one token after position 0 is generating."""
    return n_tokens == 1 and pos0 > 0


def decode_tokens(n_tokens, n_runs, runs_pos0, runs_n) -> int:
    """split_batch summed over arrays of batches (numpy: one row a batch, its runs as columns
    of which the first n_runs are meaningful)."""
    slots = np.arange(runs_n.shape[1]) < n_runs[:, None]
    decoding = (slots & (runs_n == 1) & (runs_pos0 > 0)).sum(axis=1)
    return int(np.where(n_runs > 0, decoding, n_tokens == 1).sum())


@dataclass(slots=True)
class GraphCall:
    """One backend graph compute."""
    tid: int
    start_ns: int
    end_ns: int
    backend: str         # e.g. "CPU"
    n_nodes: int
    function: str = ""   # probed function, e.g. ggml_backend_sched_graph_compute_async

    @property
    def dur_ns(self) -> int:
        return self.end_ns - self.start_ns


@dataclass(slots=True)
class OpSlice:
    """One graph node computed by one worker thread."""
    tid: int
    cpu: int
    start_ns: int
    end_ns: int          # node work done (entry of the barrier that follows)
    barrier_end_ns: int  # thread free again (next node starts, or the graph ends)
    op: str              # "MUL_MAT", "RMS_NORM+MUL" for fused nodes
    name: str            # tensor name, e.g. "attn_norm-3"
    ne: tuple[int, int, int, int]
    dtype: str           # "f32", "f16", "q4_0", ...
    tensor: int = 0      # tensor address (identifies the node within a graph)
    srcs: tuple[int, ...] = ()            # source tensor addresses (the graph's edges)
    src_views: tuple[int, ...] = ()       # per source: the tensor it is a view of, or 0
    fused_tensor: int = 0                 # second node of a fused pair (RMS_NORM+MUL: the MUL)
    src_ne: tuple[tuple[int, ...], ...] = ()   # shapes of the first two sources
    src_dtypes: tuple[str, ...] = ()
    # perf counter deltas over [start, end], scaled for multiplexing, in Profile.counter_names
    # order; None when not counted (no counters, or dropped: see Profile.counter_dropped)
    counters: tuple[float, ...] | None = None
    # MUL_MAT_ID: the experts each token was routed to (one tuple per token), as read at its start
    experts: tuple[tuple[int, ...], ...] | None = None

    @property
    def dur_ns(self) -> int:
        return self.end_ns - self.start_ns

    @property
    def barrier_ns(self) -> int:
        return self.barrier_end_ns - self.end_ns


@dataclass(frozen=True, slots=True)
class OpTotal:
    """An op type's runs in one phase, counted where they happened (BPF) instead of recorded
    one by one: what the op level gives without a timeline."""
    op: str              # as OpSlice.op: "MUL_MAT", "RMS_NORM+MUL"
    phase: str           # of the decode call under way at each run's start (core.stats.PHASES)
    calls: int
    total_ns: int


@dataclass(slots=True)
class CallTotal:
    """An op's calls with one argument signature, on one thread, in one phase of its step, at
    the top level or inside another op: counted where they happened (BPF) instead of recorded
    one by one, what the op level gives without a timeline (engines whose ops are calls)."""
    pid: int
    tid: int
    op: str
    args: tuple["TensorArg", ...] | None     # None: not kept (BPF's table of them was full)
    phase: str           # core.stats.PHASES: of the thread's step when each call began
    nested: bool         # called from inside another op
    calls: int
    total_ns: int


@dataclass(frozen=True, slots=True)
class TensorArg:
    """A tensor argument of a native op call, as it was at the call's entry."""
    name: str            # the argument's name in the op's schema
    dtype: str           # "bfloat16", "int32", ... ("" for an empty optional)
    shape: tuple[int, ...] | None   # None: an empty optional (no tensor passed)


@dataclass(slots=True)
class OpCall:
    """One call of an engine's native op that is a function, not a graph node (vLLM's
    torch custom ops): who called it, when, and its tensor arguments."""
    pid: int
    tid: int
    start_ns: int
    end_ns: int
    op: str
    args: tuple[TensorArg, ...] = ()
    depth: int = 0       # ops already open on the thread (an op called from another)
    library: str = ""
    values: tuple[int, ...] = ()   # the values of a small integer argument, where read
    step: int = 0        # the thread's engine step when it began (0: before any seen)
    # perf counter deltas over the call, scaled, in Profile.counter_names order; None when
    # not counted (no counters, or dropped: see Profile.counter_dropped)
    counters: tuple[float, ...] | None = None

    @property
    def dur_ns(self) -> int:
        return self.end_ns - self.start_ns


@dataclass(slots=True)
class Step:
    """One engine step (one model forward over a scheduled batch)."""
    pid: int
    tid: int
    start_ns: int
    end_ns: int
    n_tokens: int        # tokens scheduled
    query_lens: tuple[int, ...] = ()   # per sequence, new tokens in this step
    n_calls: int = 0     # native op calls in the step

    @property
    def dur_ns(self) -> int:
        return self.end_ns - self.start_ns

    @property
    def decode_seqs(self) -> int:
        """Sequences adding one token (vLLM's own rule: a query of length one decodes)."""
        return sum(1 for q in self.query_lens if q == 1)

    @property
    def prefill_seqs(self) -> int:
        return len(self.query_lens) - self.decode_seqs

    @property
    def decode_tokens(self) -> int:
        return self.decode_seqs

    @property
    def prefill_tokens(self) -> int:
        return self.n_tokens - self.decode_tokens

    @property
    def phase(self) -> str:
        if not self.prefill_seqs:
            return "decode"
        return "mixed" if self.decode_seqs else "prefill"


@dataclass(slots=True)
class Request:
    """One request an engine served, where its time went: arrival (queued), start (given a
    sequence to run as), the batch that completed its prompt, its end; and its tokens. Which
    figures the engine marks itself and which come from its batches: docs/requests.md."""
    id: int                  # the engine's own id for it (llama-server: its task id)
    seq: int                 # the sequence its tokens are batched as (llama-server: its slot)
    start_ns: int            # it began to run
    arrival_ns: int | None = None   # it reached the engine (None: before the recording)
    kind: str = ""           # what was asked ("completion", "embedding", ...)
    prompt_tokens: int = 0   # prompt tokens computed
    cached_tokens: int = 0   # prompt tokens not computed: the sequence's cache held them
    generated_tokens: int = 0
    first_token_ns: int | None = None   # end of the batch that completed its prompt
    end_ns: int | None = None           # end of its last batch
    pid: int = 0

    @property
    def queue_ns(self) -> int | None:
        return None if self.arrival_ns is None else self.start_ns - self.arrival_ns

    @property
    def ttft_ns(self) -> int | None:
        return None if self.first_token_ns is None else self.first_token_ns - self.start_ns

    @property
    def tpot_ns(self) -> float | None:
        """Per generated token after the first (which comes from the prompt's batch)."""
        if self.generated_tokens < 2 or self.first_token_ns is None or self.end_ns is None:
            return None
        return (self.end_ns - self.first_token_ns) / (self.generated_tokens - 1)

    @property
    def latency_ns(self) -> int | None:
        """Arrival (or start) to end."""
        if self.end_ns is None:
            return None
        return self.end_ns - (self.start_ns if self.arrival_ns is None else self.arrival_ns)


@dataclass
class Profile:
    pid: int
    process_name: str = ""
    thread_names: dict[int, str] = field(default_factory=dict)
    tokens: list[TokenCall] = field(default_factory=list)
    graphs: list[GraphCall] = field(default_factory=list)
    # a list of OpSlice, or OpColumns (a collected profile: the same ops, stored compactly)
    ops: Sequence[OpSlice] = field(default_factory=list)
    # the ops counted per type and phase instead (no timeline asked): ops is then empty
    op_totals: list[OpTotal] = field(default_factory=list)
    # engines whose ops are functions (vLLM): each call, and the engine's steps
    calls: list[OpCall] = field(default_factory=list)
    steps: list[Step] = field(default_factory=list)
    # the calls counted instead (no timeline asked; calls then holds those still sent: the
    # step ops', ...), and each op's counted calls' durations (core.loghist counts)
    call_totals: list[CallTotal] = field(default_factory=list)
    call_hists: dict[str, "np.ndarray"] = field(default_factory=dict)
    # the levels' records: CUDA calls (levels/cuda/records.py), context switches and wakeups
    # (levels/sched/records.py)
    cuda_calls: list = field(default_factory=list)
    switches: list = field(default_factory=list)
    wakeups: list = field(default_factory=list)
    lost_events: int = 0
    counter_names: list[str] = field(default_factory=list)
    # ops whose counter deltas were dropped, by reason ("migrated": the thread changed CPU
    # inside the op; "unreadable"; "not running": multiplexed out the whole op)
    counter_dropped: dict[str, int] = field(default_factory=dict)
    # engine, library paths and build ids, model path, levels, profinfer version, ...
    meta: dict[str, str] = field(default_factory=dict)
    # records of a plugin's own types that have no field above, by the name its timeline
    # kinds give them (SliceKind.field): a new record type needs no field here
    records: dict[str, list] = field(default_factory=dict)
    # optional report tables asked for (report --requests: "requests"); never saved
    shown: frozenset[str] = frozenset()

    _RECORD_LISTS = ("tokens", "graphs", "calls", "steps", "cuda_calls", "switches", "wakeups")

    def derived(self, name: str, key, compute: Callable[[], object]):
        """compute()'s value, computed once while `key` (compared by ==: the records it reads,
        their counts) stays what it was: a summary and a report read the same views of one
        profile, each costly on a long recording."""
        memo = self.__dict__.setdefault("_derived", {})
        cached = memo.get(name)
        if cached is not None and cached[0] == key:
            return cached[1]
        value = compute()
        memo[name] = (key, value)
        return value

    def absorb(self, level: "Profile") -> None:
        """Add a level's profile of the same process to this one: its records, its lost
        events, and the metadata and thread names this one lacks."""
        for name in self._RECORD_LISTS:
            getattr(self, name).extend(getattr(level, name))
        for name, records in level.records.items():
            self.records.setdefault(name, []).extend(records)
        self.lost_events += level.lost_events
        self.meta.update((k, v) for k, v in level.meta.items() if k not in self.meta)
        for tid, name in level.thread_names.items():
            self.thread_names.setdefault(tid, name)
