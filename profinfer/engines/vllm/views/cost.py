"""vLLM's cost model for the roofline: the FLOPs and minimum bytes of the native ops its
pack models ([[cost]] in pack.toml), from their tensor arguments, and the verdicts per
(step phase, op) they give (core.roofline).

The pack says which ops have a cost model, in terms of their argument names, e.g.
matmul = { a = "mat1", b = "mat2", out = "out" }: out[M, N] = a[M, K] times b[N, K]
transposed (without b, weights the kernel holds itself: N x K of a's type).
"""
from __future__ import annotations

from math import prod

from profinfer.core.calibration.roofline import Cost, Roofs, Verdict, judge_groups
from profinfer.core.profile.stats import steps_by_number

# Bytes per element of torch's dtypes (others are costed as 4, float32's).
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8,
               "int8": 1, "int16": 2, "int32": 4, "int64": 8}


def element_bytes(dtype: str) -> float:
    return float(DTYPE_BYTES.get(dtype, 4))


def tensor_bytes(shape: tuple[int, ...], dtype: str) -> float:
    return prod(max(int(n), 1) for n in shape) * element_bytes(dtype)


def call_cost(call, rule: dict, query_lens: tuple[int, ...] = ()) -> Cost | None:
    """`query_lens`: the new tokens of each sequence in the call's step (attention). A call
    counted, not sent, has no values: no attention cost (its op is sent)."""
    args = {a.name: a for a in call.args or ()}
    if "attention" in rule:
        return _attention_cost(args, rule["attention"], getattr(call, "values", ()), query_lens)
    mm = rule.get("matmul")
    if mm is None:
        return None
    a, out = args.get(mm["a"]), args.get(mm["out"])
    b = args.get(mm["b"]) if "b" in mm else None
    if not a or not out or a.shape is None or out.shape is None or not a.shape or not out.shape \
            or ("b" in mm and (not b or b.shape is None)):
        return None
    k = a.shape[-1]
    outputs = prod(max(int(x), 1) for x in out.shape)
    # weights not passed (held by the kernel's own handle): N x K, of a's type
    weights = tensor_bytes(b.shape, b.dtype) if b else tensor_bytes((out.shape[-1], k), a.dtype)
    return Cost(2.0 * k * outputs, weights + sum(tensor_bytes(t.shape, t.dtype) for t in (a, out)))


def _attention_cost(args: dict, names: dict, seq_lens: tuple[int, ...], query_lens) -> Cost | None:
    """Paged attention over each sequence's context: QK^T and PV, 2 FLOPs a multiply-add, for
    each new token against the sequence's whole context (the causal mask's saving among the
    new tokens is not taken off: an upper bound for prefills); bytes: the queries and
    outputs, and each context's K and V once."""
    q, kc, out = args.get(names["q"]), args.get(names["k_cache"]), args.get(names["out"])
    if not q or not kc or not out or not seq_lens or q.shape is None or kc.shape is None \
            or len(q.shape) != 3 or len(kc.shape) != 4:
        return None
    heads, dim, kv_heads = q.shape[1], q.shape[2], kc.shape[1]
    lens = query_lens if len(query_lens) == len(seq_lens) else (1,) * len(seq_lens)
    flops = sum(4.0 * heads * dim * ql * sl for ql, sl in zip(lens, seq_lens))
    kv_bytes = sum(seq_lens) * kv_heads * dim * 2 * element_bytes(kc.dtype)
    return Cost(flops, tensor_bytes(q.shape, q.dtype) + tensor_bytes(out.shape, out.dtype) + kv_bytes)


def call_verdicts(profile, roofs: Roofs, rules: dict[str, dict]) -> list[Verdict]:
    """Verdicts per (step phase, op) for the ops `rules` models; "decode weight_packed_linear"."""
    step_of = steps_by_number(profile)
    groups: dict[str, list] = {}
    for c in profile.calls:
        rule = rules.get(c.op)
        if rule is None:
            continue
        step = step_of.get((c.pid, c.tid, c.step))
        phase = step.phase if step else "other"
        cost = call_cost(c, rule, step.query_lens if step else ())
        groups.setdefault(f"{phase} {c.op}", []).append((cost, c.dur_ns, c.counters))
    for t in profile.call_totals:       # counted: one signature's calls at once
        rule = rules.get(t.op)
        cost = call_cost(t, rule) if rule else None
        if cost is not None:
            groups.setdefault(f"{t.phase} {t.op}", []).append(
                (Cost(cost.flops * t.calls, cost.bytes * t.calls), t.total_ns, None, t.calls))
    return judge_groups(groups, roofs, profile.counter_names)
