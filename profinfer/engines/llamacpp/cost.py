"""ggml's cost model for the roofline: each node's FLOPs and minimum bytes moved, from its
shapes and types (pure logic), and the verdicts per (phase, op) it gives (core.roofline)."""
from __future__ import annotations

from functools import lru_cache
from math import inf, prod

import numpy as np

from profinfer.core.roofline import Cost, Roofs, SourceReuse, Verdict, judge_costs, judge_groups
from profinfer.engines.llamacpp.nodes import NodeRun, node_runs, phase_of

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


def judge(scope: str, runs: list[NodeRun], roofs: Roofs, llc_miss_index: int | None = None,
          reuse: SourceReuse | None = None) -> Verdict | None:
    """One verdict for a set of node runs (e.g. decode MUL_MAT): totals, then the roof.
    `llc_miss_index`: position of LLC-load-misses in the runs' counters, for the cross-check;
    `reuse`: their sources' reuse distances (reuse_of)."""
    return judge_costs(scope, ((node_cost(r), r.dur_ns, r.counters) for r in runs), roofs,
                       llc_miss_index, reuse)


def verdicts(profile, roofs: Roofs) -> list[Verdict]:
    """Verdicts per (phase, op type), largest time first. Scope is "decode MUL_MAT" etc."""
    runs, _ = node_runs(profile)
    groups: dict[str, list] = {}
    reads: dict[str, list] = {}
    for r, phase, read in zip(runs, phase_of(runs, profile.tokens), reuse_by_run(runs)):
        scope = f"{phase} {r.op}"
        groups.setdefault(scope, []).append((node_cost(r), r.dur_ns, r.counters))
        reads.setdefault(scope, []).append(read)
    return judge_groups(groups, roofs, profile.counter_names,
                        {scope: reuse for scope, rs in reads.items() if (reuse := reuse_of(rs))})


def _reads(desc) -> tuple[tuple[tuple[int, float], ...], float]:
    """A node's sources as (the tensor whose data they are: a view's root, bytes read), and
    the bytes the node moves in all (its cost's, else its sources' and its result's)."""
    base = desc.op.split("+", 1)[0]
    reads = []
    for i, (src, root, ne, dtype) in enumerate(zip(desc.srcs, desc.src_views, desc.src_ne, desc.src_dtypes)):
        if root or src:
            # GET_ROWS reads only the rows it gathers from its table
            reads.append((root or src, nbytes(desc.ne, dtype) if base == "GET_ROWS" and i == 0
                          else nbytes(ne, dtype)))
    cost = _cost(desc.op, desc.ne, desc.dtype, desc.src_ne, desc.src_dtypes)
    moved = cost.bytes if cost else sum(b for _, b in reads) + nbytes(desc.ne, desc.dtype)
    return tuple(reads), moved


# One node run's sources: their reuse distances and the bytes read from each.
RunReads = tuple[list[float], list[float]]


def reuse_by_run(runs: list[NodeRun]) -> list[RunReads]:
    """Per node run (runs in start order, across graph computes), the bytes it reads from each
    source and that source's reuse distance: the bytes every node moved since the tensor's
    data was last read or written, and the bytes read of it (inf: not before). A model's
    weights were last read a token's graph before; an activation, as the node that wrote it
    ended."""
    moved = 0.0
    last: dict[int, float] = {}
    by_desc: dict[int, tuple] = {}
    out = []
    for r in runs:
        desc = r.desc
        known = by_desc.get(id(desc))
        if known is None:
            known = by_desc[id(desc)] = _reads(desc)
        reads, node_moved = known
        # re-read in order, each byte was last touched what moved since, and the rest of the
        # tensor, before
        out.append(([inf if (seen := last.get(t)) is None else moved - seen + nb for t, nb in reads],
                    [nb for _, nb in reads]))
        moved += node_moved
        for tensor, _ in reads:
            last[tensor] = moved
        if desc.tensor:
            last[desc.tensor] = moved
    return out


def reuse_of(reads) -> SourceReuse | None:
    """The reuse distances of a set of runs' sources (reuse_by_run's), None without any."""
    reads = list(reads)
    dist = [d for ds, _ in reads for d in ds]
    if not dist:
        return None
    return SourceReuse(np.array(dist, np.float64), np.array([b for _, bs in reads for b in bs], np.float64))
