"""Roofline without a PMU: each node's FLOPs and bytes from its shapes and types (pure logic).

With the node's measured time this gives achieved GFLOP/s and GB/s, and against the
machine's calibrated roofs (profinfer calibrate) a verdict:
- memory-bound: arithmetic intensity below the ridge point and at least MIN_ROOF_SHARE of
  the bandwidth roof reached;
- compute-bound: intensity above the ridge and at least MIN_ROOF_SHARE of the compute roof;
- neither (latency/overhead-bound): far from the roof its intensity points at (synchronisation,
  dispatch, too little work per thread).

The byte counts are what the op must move at least once (sources read, result written);
re-reads of data that does not stay in cache are not in them, so achieved GB/s is a lower
bound and a memory-bound verdict is conservative.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from math import prod

from profinfer.engines.llamacpp.nodes import NodeRun

MIN_ROOF_SHARE = 0.4

# ggml block formats: (elements per block, bytes per block); from ggml's type traits.
TYPE_BLOCK = {
    "f32": (1, 4), "f16": (1, 2), "bf16": (1, 2), "f64": (1, 8), "i8": (1, 1), "i16": (1, 2),
    "i32": (1, 4), "i64": (1, 8),
    "q4_0": (32, 18), "q4_1": (32, 20), "q5_0": (32, 22), "q5_1": (32, 24), "q8_0": (32, 34),
    "q8_1": (32, 36), "iq4_nl": (32, 18), "mxfp4": (32, 17),
    "q2_k": (256, 84), "q3_k": (256, 110), "q4_k": (256, 144), "q5_k": (256, 176),
    "q6_k": (256, 210), "q8_k": (256, 292), "iq2_xxs": (256, 66), "iq2_xs": (256, 74),
    "iq3_xxs": (256, 98), "iq1_s": (256, 50), "iq3_s": (256, 110), "iq2_s": (256, 82),
    "iq4_xs": (256, 136), "iq1_m": (256, 56), "tq1_0": (256, 54), "tq2_0": (256, 66),
}

# FLOPs per output element of element-wise and row ops (a small constant: they are
# memory-bound whatever it is exactly).
_ELEMENTWISE_FLOPS = {"ADD": 1, "SUB": 1, "MUL": 1, "DIV": 1, "SCALE": 1, "SQR": 1, "SQRT": 1,
                      "SILU": 4, "GELU": 8, "GLU": 5, "UNARY": 4, "RMS_NORM": 3, "NORM": 5,
                      "ROPE": 6, "SOFT_MAX": 5, "ADD1": 1, "ACC": 1, "CLAMP": 1}


def nbytes(ne: tuple[int, ...], dtype: str) -> float:
    per_block, block_bytes = TYPE_BLOCK.get(dtype, (1, 4))
    return prod(max(int(n), 1) for n in ne) * block_bytes / per_block


@dataclass(frozen=True, slots=True)
class Cost:
    flops: float
    bytes: float

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes if self.bytes else 0.0


def node_cost(n: NodeRun) -> Cost | None:
    """FLOPs and minimum bytes moved for one node, or None when its sources are unknown."""
    return _cost(n.op, n.ne, n.dtype, n.src_ne, n.src_dtypes)


@lru_cache(maxsize=1 << 16)      # a run repeats the same few hundred shapes many times
def _cost(op: str, ne: tuple, dtype: str, src_ne: tuple, src_dtypes: tuple) -> Cost | None:
    base = op.split("+", 1)[0]
    out = prod(max(int(x), 1) for x in ne)
    out_bytes = nbytes(ne, dtype)
    srcs = list(zip(src_ne, src_dtypes))
    if base in ("MUL_MAT", "MUL_MAT_ID", "FLASH_ATTN_EXT") and len(srcs) < 2:
        return None
    if base == "MUL_MAT":
        (a_ne, a_t), (b_ne, b_t) = srcs[0], srcs[1]
        k = a_ne[0]
        return Cost(2.0 * k * out, nbytes(a_ne, a_t) + nbytes(b_ne, b_t) + out_bytes)
    if base == "MUL_MAT_ID":
        # experts [K, M, n_expert]; dst [M, n_used, n_tokens]: each used expert's weights once
        (a_ne, a_t), (b_ne, b_t) = srcs[0], srcs[1]
        k, m, n_expert = a_ne[0], a_ne[1], max(a_ne[2], 1)
        routed = max(ne[1], 1) * max(ne[2], 1)
        experts_read = min(n_expert, routed)
        return Cost(2.0 * k * out, experts_read * nbytes((k, m), a_t) + nbytes(b_ne, b_t) + out_bytes)
    if base == "FLASH_ATTN_EXT":
        # q [D, n_q, H]; k [D, n_kv, H_kv]; v like k: QK^T and PV, 2 FLOPs per multiply-add
        (q_ne, q_t), (k_ne, k_t) = srcs[0], srcs[1]
        d, n_q, heads = q_ne[0], q_ne[1], max(q_ne[2], 1) * max(q_ne[3], 1)
        n_kv = k_ne[1]
        return Cost(4.0 * d * n_q * n_kv * heads,
                    nbytes(q_ne, q_t) + 2 * nbytes(k_ne, k_t) + out_bytes)
    if base == "GET_ROWS":
        # reads only the selected rows of src0
        row_type = srcs[0][1] if srcs else dtype
        return Cost(0.0, nbytes(ne, row_type) + out_bytes)
    if base in ("SET_ROWS", "CPY", "CONT", "DUP"):
        # writes as many elements as src0 has (dst of SET_ROWS is the whole cache)
        if not srcs:
            return Cost(0.0, 2 * out_bytes)
        s_ne, src_t = srcs[0]
        written = prod(max(int(x), 1) for x in s_ne) * nbytes((1,), dtype)
        return Cost(0.0, nbytes(s_ne, src_t) + written)
    flops = _ELEMENTWISE_FLOPS.get(base, 1) * out
    if "+" in op:
        flops += out          # the fused second op (MUL, ADD): one more per element
    return Cost(float(flops), sum(nbytes(ne, t) for ne, t in srcs) + out_bytes)


@dataclass(slots=True)
class Roofs:
    peak_gflops: float       # compute roof (f32 FMA, all threads)
    peak_gbps: float         # memory roof (read bandwidth, all threads)

    @property
    def ridge(self) -> float:
        return self.peak_gflops / self.peak_gbps


@dataclass(slots=True)
class Verdict:
    scope: str
    nodes: int
    time_ns: int
    flops: float
    bytes: float
    gflops: float
    gbps: float
    intensity: float
    bound: str               # "memory", "compute" or "neither"
    roof_share: float        # achieved / the roof its intensity points at
    # cross-check where the PMU counts LLC load misses: DRAM read bandwidth they imply
    # (lines × 64 B over the counted nodes' time); None without that counter
    measured_gbps: float | None = None
    notes: list[str] = field(default_factory=list)


LINE_BYTES = 64


def judge(scope: str, runs: list[NodeRun], roofs: Roofs, llc_miss_index: int | None = None
          ) -> Verdict | None:
    """One verdict for a set of node runs (e.g. decode MUL_MAT): totals, then the roof.
    `llc_miss_index`: position of LLC-load-misses in the runs' counters, for the cross-check."""
    return judge_costs(scope, ((node_cost(r), r.dur_ns, r.counters) for r in runs), roofs,
                       llc_miss_index)


def judge_costs(scope: str, items, roofs: Roofs, llc_miss_index: int | None = None) -> Verdict | None:
    """The same from (Cost or None, duration ns, counters or None) per op run."""
    flops = bytes_ = 0.0
    time_ns = 0
    counted = 0
    miss_lines, miss_ns = 0.0, 0
    for cost, dur_ns, counters in items:
        if cost is None or dur_ns <= 0:
            continue
        flops += cost.flops
        bytes_ += cost.bytes
        time_ns += dur_ns
        counted += 1
        if llc_miss_index is not None and counters is not None:
            miss_lines += counters[llc_miss_index]
            miss_ns += dur_ns
    if not counted or not time_ns:
        return None
    gflops, gbps = flops / time_ns, bytes_ / time_ns       # per ns = G per s
    intensity = flops / bytes_ if bytes_ else float("inf")
    if intensity < roofs.ridge:
        side, share = "memory", gbps / roofs.peak_gbps
    else:
        side, share = "compute", gflops / roofs.peak_gflops
    bound = side if share >= MIN_ROOF_SHARE else "neither"
    measured = miss_lines * LINE_BYTES / miss_ns if miss_ns else None
    return Verdict(scope, counted, time_ns, flops, bytes_, gflops, gbps, intensity, bound, share,
                   measured)


def verdicts(profile, roofs: Roofs) -> list[Verdict]:
    """Verdicts per (phase, op type), largest time first. Scope is "decode MUL_MAT" etc."""
    from profinfer.engines.llamacpp.nodes import node_runs, phase_of
    runs, _ = node_runs(profile)
    groups: dict[str, list[NodeRun]] = {}
    for r, phase in zip(runs, phase_of(runs, profile.tokens)):
        groups.setdefault(f"{phase} {r.op}", []).append(r)
    names = profile.counter_names
    llc = names.index("LLC-load-misses") if "LLC-load-misses" in names else None
    out = [v for scope, rs in groups.items() if (v := judge(scope, rs, roofs, llc)) is not None]
    out.sort(key=lambda v: -v.time_ns)
    return out


# Engines whose ops are calls (vLLM): the pack says which ops have a cost model, in terms of
# their argument names, e.g. matmul = { a = "mat1", b = "mat2", out = "out" }: out[M, N] =
# a[M, K] times b[N, K] transposed.
TORCH_DTYPES = {"float32": "f32", "float16": "f16", "bfloat16": "bf16", "float64": "f64",
                "int8": "i8", "int16": "i16", "int32": "i32", "int64": "i64"}


def call_cost(call, rule: dict, query_lens: tuple[int, ...] = ()) -> Cost | None:
    """`query_lens`: the new tokens of each sequence in the call's step (attention)."""
    args = {a.name: a for a in call.args}
    if "attention" in rule:
        return _attention_cost(args, rule["attention"], call.values, query_lens)
    mm = rule.get("matmul")
    if mm is None:
        return None
    a, b, out = args.get(mm["a"]), args.get(mm["b"]), args.get(mm["out"])
    if not a or not b or not out or a.shape is None or b.shape is None or out.shape is None \
            or not a.shape or not out.shape:
        return None
    k = a.shape[-1]
    outputs = prod(max(int(x), 1) for x in out.shape)
    return Cost(2.0 * k * outputs,
                sum(nbytes(t.shape, TORCH_DTYPES.get(t.dtype, "f32")) for t in (a, b, out)))


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
    kv_bytes = sum(seq_lens) * kv_heads * dim * 2 * nbytes((1,), TORCH_DTYPES.get(kc.dtype, "f32"))
    return Cost(flops, nbytes(q.shape, TORCH_DTYPES.get(q.dtype, "f32"))
                + nbytes(out.shape, TORCH_DTYPES.get(out.dtype, "f32")) + kv_bytes)


def call_verdicts(profile, roofs: Roofs, rules: dict[str, dict]) -> list[Verdict]:
    """Verdicts per (step phase, op) for the ops `rules` models; "decode weight_packed_linear"."""
    from profinfer.engines.vllm.callstats import steps_by_number
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
    names = profile.counter_names
    llc = names.index("LLC-load-misses") if "LLC-load-misses" in names else None
    out = [v for scope, items in groups.items() if (v := judge_costs(scope, items, roofs, llc)) is not None]
    out.sort(key=lambda v: -v.time_ns)
    return out
