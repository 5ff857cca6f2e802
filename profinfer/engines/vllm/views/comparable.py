"""vLLM's quantities for `diff` (core.compare.Series), per engine step, and what two runs must share.

- "<phase> time per token": each step's duration over its tokens;
- "<phase> <op>": each native op's calls inside the step (on the step's thread, within its
  span; a nested call counts for its own op too), over the step's tokens, and its calls as
  the series' events; the finest parts of a step's work, which a run's common change of speed is
  estimated from. An op that a mode does not call (compiled graphs fuse norms,
  activations and rotary embeddings into kernels of their own) is a row of one run only.

Two runs must share the model's attention structure (identity), as its attention op's
arguments show it in both modes.
"""
from __future__ import annotations

from collections import Counter, defaultdict

import numpy as np

from profinfer.core.diff.comparable import CALL_PHASES, PER_TOKEN, call_of, per_call
from profinfer.core.diff.compare import Series
from profinfer.core.profile.model import Profile
from profinfer.core.plugin.packs import cost_rules


def series(profile: Profile) -> list[Series]:
    steps = sorted((s for s in profile.steps if s.phase in CALL_PHASES), key=lambda s: s.start_ns)
    if not steps:
        return []
    tokens = np.array([max(s.n_tokens, 1) for s in steps], np.float64)
    phases = np.array([CALL_PHASES.index(s.phase) for s in steps], np.int64)
    out: list[Series] = []
    for p, phase in enumerate(CALL_PHASES):
        mine = phases == p
        if mine.any():
            out.append(Series("latency", f"{phase} time per token", PER_TOKEN.format(phase=phase),
                              np.array([s.dur_ns for s, m in zip(steps, mine) if m], np.float64) / tokens[mine]))
    names = sorted({c.op for c in profile.calls})
    if not names:
        return out
    code_of = {n: i for i, n in enumerate(names)}
    by_thread: dict[tuple[int, int], list[int]] = defaultdict(list)
    for i, s in enumerate(steps):
        by_thread[(s.pid, s.tid)].append(i)
    calls_by_thread: dict[tuple[int, int], list] = defaultdict(list)
    for c in profile.calls:
        if (c.pid, c.tid) in by_thread:
            calls_by_thread[(c.pid, c.tid)].append(c)
    step_idx, codes, durs = [], [], []
    for key, cs in calls_by_thread.items():
        mine = np.array(by_thread[key], np.int64)
        starts = np.array([steps[i].start_ns for i in mine], np.int64)
        ends = np.array([steps[i].end_ns for i in mine], np.int64)
        at = call_of(starts, ends, np.array([c.start_ns for c in cs], np.int64))
        step_idx.append(np.where(at >= 0, mine[np.maximum(at, 0)], -1))
        codes.append(np.array([code_of[c.op] for c in cs], np.int64))
        durs.append(np.array([c.dur_ns for c in cs], np.float64))
    if not step_idx:
        return out
    op_ns, op_calls = per_call(np.concatenate(step_idx), np.concatenate(codes), np.concatenate(durs),
                               len(steps), len(names))
    for p, phase in enumerate(CALL_PHASES):
        mine = phases == p
        if not mine.any():
            continue
        unit = PER_TOKEN.format(phase=phase)
        for k in np.argsort(-op_ns[mine].sum(axis=0), kind="stable"):
            n = int(op_calls[mine, k].sum())
            if n:
                out.append(Series("op", f"{phase} {names[k]}", unit, op_ns[mine, k] / tokens[mine], n,
                                  finest=True))
    return out


def identity(profile: Profile) -> dict[str, str]:
    """The model's attention as the attention op's arguments show it (the op and its argument
    names: the pack's attention cost rule): its layers (the op's calls in most steps), query
    heads, KV heads and head size (q[T, H, D], KV cache [blocks, kv heads, block, D]).
    Nothing where no step called such an op (a backend the pack does not model)."""
    attention = {op: r["attention"] for op, r in cost_rules(profile.meta.get("pack")).items()
                 if "attention" in r}
    per_step: Counter = Counter()
    heads: set[tuple[int, int, int]] = set()
    for c in profile.calls:
        names = attention.get(c.op)
        if names is None or not c.step:
            continue
        per_step[(c.pid, c.tid, c.step)] += 1
        args = {a.name: a.shape for a in c.args or ()}
        q, kv = args.get(names["q"]), args.get(names["k_cache"])
        if q and kv and len(q) == 3 and len(kv) == 4:
            heads.add((q[1], kv[1], q[2]))
    if not per_step or len(heads) != 1:
        return {}
    (layers, _), = Counter(per_step.values()).most_common(1)
    (q_heads, kv_heads, size), = heads
    return {"attention layers": str(layers), "query heads": str(q_heads), "KV heads": str(kv_heads),
            "head size": str(size)}
