"""The neutral quantities `diff` compares (core.compare.Series), from decode calls and graph
nodes (pure logic): what any engine that has them is judged by.

Each is a sample per decode call of a phase, divided by the call's tokens (a batch of 8
decode tokens costs more than one of 1), or per sequence (TTFT, TPOT):
- "<phase> time per token": the decode calls' duration;
- "<phase> <OP>": the op's time in the call (its slices summed over threads: CPU time, as
  the op table's), and its runs as the series' events;
- "<phase> barrier wait": the threads' waits after their nodes;
- "<phase> thread N op time" / "barrier wait": per op thread, N its rank by first op (0 the
  thread that ran the first node), so that runs of different thread ids line up.
Ops that ran outside every decode call (phase "other") are not compared.
"""
from __future__ import annotations

import numpy as np

from profinfer.core.diff.compare import Series
from profinfer.core.profile.model import Profile
from profinfer.core.profile.opcolumns import as_columns
from profinfer.core.profile.stats import sequences

PER_TOKEN = "ns per {phase} token"
CALL_PHASES = ("prefill", "decode", "mixed")


def calls(profile: Profile):
    """The decode calls by start: (calls, starts, ends, tokens (at least 1), phase indices
    into CALL_PHASES)."""
    calls = sorted(profile.tokens, key=lambda t: t.start_ns)
    starts = np.fromiter((t.start_ns for t in calls), np.int64, len(calls))
    ends = np.fromiter((t.end_ns for t in calls), np.int64, len(calls))
    tokens = np.fromiter((max(t.n_tokens, 1) for t in calls), np.float64, len(calls))
    phases = np.array([CALL_PHASES.index(t.phase) for t in calls], np.int64)
    return calls, starts, ends, tokens, phases


def call_of(starts: np.ndarray, ends: np.ndarray, at: np.ndarray) -> np.ndarray:
    """Per time in `at`, the index of the call (sorted, not overlapping) running then; -1
    outside every call."""
    if not len(starts):
        return np.full(len(at), -1, np.int64)
    i = np.searchsorted(starts, at, side="right") - 1
    safe = np.maximum(i, 0)
    return np.where((i >= 0) & (at <= ends[safe]), i, -1)


def per_call(call: np.ndarray, code: np.ndarray, weights: np.ndarray, n_calls: int, n_codes: int
             ) -> tuple[np.ndarray, np.ndarray]:
    """(sum of weights, count) per call and code, as n_calls x n_codes arrays; rows with
    call -1 left out."""
    inside = call >= 0
    flat = call[inside] * n_codes + code[inside]
    size = n_calls * n_codes
    sums = np.bincount(flat, weights=weights[inside], minlength=size).reshape(n_calls, n_codes)
    counts = np.bincount(flat, minlength=size).reshape(n_calls, n_codes)
    return sums, counts


def series(profile: Profile) -> list[Series]:
    calls_, starts, ends, tokens, phases = calls(profile)
    out: list[Series] = []
    for p, phase in enumerate(CALL_PHASES):
        mine = phases == p
        if mine.any():
            unit = PER_TOKEN.format(phase=phase)
            out.append(Series("latency", f"{phase} time per token", unit,
                              (ends - starts)[mine] / tokens[mine]))
    seqs = sequences(profile.tokens)
    ttft = np.array([q.ttft_ns for q in seqs if q.ttft_ns is not None], np.float64)
    tpot = np.array([q.tpot_ns for q in seqs if q.tpot_ns is not None], np.float64)
    if len(ttft):
        out.append(Series("latency", "TTFT", "ns per sequence", ttft,
                          speed_unit=PER_TOKEN.format(phase="prefill")))
    if len(tpot):
        out.append(Series("latency", "TPOT", "ns per sequence", tpot,
                          speed_unit=PER_TOKEN.format(phase="decode")))
    if len(profile.ops) and len(calls_):
        out += _op_series(profile, starts, ends, tokens, phases)
    return out


def _op_series(profile: Profile, starts, ends, tokens, phases) -> list[Series]:
    cols = as_columns(profile.ops)
    code, names = cols.op_codes()
    call = call_of(starts, ends, cols.start)
    n = len(starts)
    dur = (cols.end - cols.start).astype(np.float64)
    barrier = (cols.barrier_end - cols.end).astype(np.float64)
    op_ns, op_runs = per_call(call, code, dur, n, len(names))
    rank = _thread_rank(cols.tid, cols.start)
    n_threads = int(rank.max()) + 1 if len(rank) else 0
    thread_ns, _ = per_call(call, rank, dur, n, n_threads)
    thread_wait, _ = per_call(call, rank, barrier, n, n_threads)
    wait = thread_wait.sum(axis=1)
    out: list[Series] = []
    for p, phase in enumerate(CALL_PHASES):
        mine = phases == p
        if not mine.any():
            continue
        unit, per = PER_TOKEN.format(phase=phase), tokens[mine]
        order = np.argsort(-op_ns[mine].sum(axis=0), kind="stable")
        for k in order:
            runs = int(op_runs[mine, k].sum())
            if runs:
                out.append(Series("op", f"{phase} {names[k]}", unit, op_ns[mine, k] / per, runs))
        out.append(Series("thread", f"{phase} barrier wait", unit, wait[mine] / per, sharing=True))
        for r in range(n_threads):
            out.append(Series("thread", f"{phase} thread {r} op time", unit, thread_ns[mine, r] / per,
                              sharing=True))
            out.append(Series("thread", f"{phase} thread {r} barrier wait", unit,
                              thread_wait[mine, r] / per, sharing=True))
    return out


def _thread_rank(tid: np.ndarray, start: np.ndarray) -> np.ndarray:
    """Each op's thread, numbered by the thread's first op (0: the first to run one)."""
    if not len(tid):
        return np.zeros(0, np.int64)
    uniq, inverse = np.unique(tid, return_inverse=True)
    first = np.full(len(uniq), np.iinfo(np.int64).max)
    np.minimum.at(first, inverse, start)
    order = np.argsort(first, kind="stable")
    rank_of = np.empty(len(uniq), np.int64)
    rank_of[order] = np.arange(len(uniq))
    return rank_of[inverse]


def op_threads(profile: Profile) -> int:
    """How many threads ran ops."""
    return len(np.unique(as_columns(profile.ops).tid)) if len(profile.ops) else 0
