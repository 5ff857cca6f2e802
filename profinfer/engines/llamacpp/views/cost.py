"""ggml's cost model for the roofline: each node's FLOPs and minimum bytes moved, from its
shapes and types (pure logic), and the verdicts per (phase, op) it gives (core.roofline)."""
from __future__ import annotations

from collections.abc import Iterable
from functools import lru_cache
from math import inf, prod

import numpy as np

from profinfer.core.calibration.roofline import Cost, Roofs, SourceReuse, Verdict, judge_costs, judge_groups
from profinfer.engines.llamacpp.views.nodes import NodeRun, node_runs, phase_of

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
def source_reads(op: str, ne: tuple, dtype: str, src_ne: tuple, src_dtypes: tuple) -> tuple[float, ...]:
    """The bytes a node reads from each source whose shape is known (the first two), at
    least once: what the cost model counts (V, FLASH_ATTN_EXT's third source, is read like K)."""
    base = op.split("+", 1)[0]
    srcs = list(zip(src_ne, src_dtypes))
    if base == "MUL_MAT_ID" and len(srcs) >= 2:
        # experts [K, M, n_expert]; dst [M, n_used, n_tokens]: each used expert's weights once
        (a_ne, a_t), (b_ne, b_t) = srcs[0], srcs[1]
        k, m, n_expert = a_ne[0], a_ne[1], max(a_ne[2], 1)
        experts_read = min(n_expert, max(ne[1], 1) * max(ne[2], 1))
        return experts_read * nbytes((k, m), a_t), nbytes(b_ne, b_t)
    if base == "GET_ROWS":
        # only the rows it gathers from its table (its ids are not counted)
        return (nbytes(ne, srcs[0][1]),) if srcs else ()
    if base in ("SET_ROWS", "CPY", "CONT", "DUP"):
        return (nbytes(*srcs[0]),) if srcs else ()
    return tuple(nbytes(s_ne, t) for s_ne, t in srcs)


@lru_cache(maxsize=1 << 16)
def _cost(op: str, ne: tuple, dtype: str, src_ne: tuple, src_dtypes: tuple) -> Cost | None:
    base = op.split("+", 1)[0]
    out = prod(max(int(x), 1) for x in ne)
    out_bytes = nbytes(ne, dtype)
    srcs = list(zip(src_ne, src_dtypes))
    if base in ("MUL_MAT", "MUL_MAT_ID", "FLASH_ATTN_EXT") and len(srcs) < 2:
        return None
    read = sum(source_reads(op, ne, dtype, src_ne, src_dtypes))
    if base in ("MUL_MAT", "MUL_MAT_ID"):
        return Cost(2.0 * srcs[0][0][0] * out, read + out_bytes)
    if base == "FLASH_ATTN_EXT":
        # q [D, n_q, H]; k [D, n_kv, H_kv]; v like k: QK^T and PV, 2 FLOPs per multiply-add
        (q_ne, _), (k_ne, k_t) = srcs[0], srcs[1]
        d, n_q, heads = q_ne[0], q_ne[1], max(q_ne[2], 1) * max(q_ne[3], 1)
        n_kv = k_ne[1]
        return Cost(4.0 * d * n_q * n_kv * heads, read + nbytes(k_ne, k_t) + out_bytes)
    if base == "GET_ROWS":
        return Cost(0.0, (read if srcs else nbytes(ne, dtype)) + out_bytes)
    if base in ("SET_ROWS", "CPY", "CONT", "DUP"):
        # writes as many elements as src0 has (dst of SET_ROWS is the whole cache)
        if not srcs:
            return Cost(0.0, 2 * out_bytes)
        written = prod(max(int(x), 1) for x in srcs[0][0]) * nbytes((1,), dtype)
        return Cost(0.0, read + written)
    flops = _ELEMENTWISE_FLOPS.get(base, 1) * out
    if "+" in op:
        flops += out          # the fused second op (MUL, ADD): one more per element
    return Cost(float(flops), read + out_bytes)


def judge(scope: str, runs: list[NodeRun], roofs: Roofs, llc_miss_index: int | None = None,
          reuse: SourceReuse | None = None) -> Verdict | None:
    """One verdict for a set of node runs (e.g. decode MUL_MAT): totals, then the roof.
    `llc_miss_index`: position of LLC-load-misses in the runs' counters, for the cross-check;
    `reuse`: their sources' reuse distances (reuse_of)."""
    return judge_costs(scope, ((node_cost(r), r.dur_ns, r.counters) for r in runs), roofs,
                       llc_miss_index, reuse)


def verdicts(profile, roofs: Roofs) -> list[Verdict]:
    """Verdicts per (phase, op type), largest time first. Scope is "decode MUL_MAT" etc.;
    computed once a profile and roofs (its summary and its report both show them)."""
    return profile.derived("verdicts", (len(profile.ops), len(profile.graphs), len(profile.tokens), roofs),
                           lambda: _verdicts(profile, roofs))


def _verdicts(profile, roofs: Roofs) -> list[Verdict]:
    runs, _ = node_runs(profile)
    groups: dict[str, list] = {}
    reads: dict[str, list] = {}
    for r, phase, read in zip(runs, phase_of(runs, profile.tokens), run_reads(profile)):
        scope = f"{phase} {r.op}"
        groups.setdefault(scope, []).append((node_cost(r), r.dur_ns, r.counters))
        reads.setdefault(scope, []).append((r, read))
    return judge_groups(groups, roofs, profile.counter_names,
                        {scope: reuse for scope, rs in reads.items() if (reuse := reuse_of(rs))})


# One node run's sources: the reuse distance of each whose bytes are known (inf: its data not
# touched before in the recording), and those bytes.
RunReads = tuple[list[float], list[float]]


def _reads(desc) -> tuple[tuple[int, ...], tuple[float, ...], tuple[int, ...], float]:
    """A node's sources' data (a view's root, else the source), the bytes read of the first
    ones (source_reads), the tensors it writes (itself; a fused node, its second op's too),
    and the bytes it moves in all (its cost's, else its sources' and its result's)."""
    views = tuple(desc.src_views) + (0,) * (len(desc.srcs) - len(desc.src_views))
    data = tuple(root or src for src, root in zip(desc.srcs, views) if root or src)
    nbs = source_reads(desc.op, desc.ne, desc.dtype, desc.src_ne, desc.src_dtypes) \
        if all(root or src for src, root in zip(desc.srcs[:len(desc.src_ne)], views)) else ()
    cost = _cost(desc.op, desc.ne, desc.dtype, desc.src_ne, desc.src_dtypes)
    moved = cost.bytes if cost else sum(nbs) + nbytes(desc.ne, desc.dtype)
    written = tuple(t for t in (desc.tensor, desc.fused_tensor) if t)
    return data, nbs, written, moved


def reuse_by_run(runs: list[NodeRun]) -> list[RunReads]:
    """Per node run (runs in start order, across graph computes), each source's reuse
    distance and the bytes read of it. The distance is the bytes every node moved (as the
    cost model counts them) since its data was last read or written, plus those bytes: read
    in order, its first byte was last touched that long before. A model's weights were last
    read a token's graph before; an activation, as the node that wrote it ended."""
    moved = 0.0
    last: dict[int, float] = {}
    by_desc: dict[int, tuple] = {}
    out = []
    for r in runs:
        desc = r.desc
        known = by_desc.get(id(desc))
        if known is None:
            known = by_desc[id(desc)] = _reads(desc)
        data, nbs, written, node_moved = known
        out.append(([inf if (seen := last.get(t)) is None else moved - seen + nb for t, nb in zip(data, nbs)],
                    list(nbs)))
        moved += node_moved
        for t in data + written:
            last[t] = moved
    return out


def run_reads(profile) -> list[RunReads]:
    """reuse_by_run of the profile's node runs (node_runs' order), computed once a profile."""
    runs, _ = node_runs(profile)
    return profile.derived("run_reads", (len(profile.ops), len(profile.graphs)), lambda: reuse_by_run(runs))


def reuse_of(run_reads_: Iterable[tuple[NodeRun, RunReads]]) -> SourceReuse | None:
    """The reuse distances of the sources of the runs a verdict counts (with a cost and a
    duration), where their data was touched before in the recording; None without any (a
    recording that began with the node: where its data was is not known)."""
    dist: list[float] = []
    size: list[float] = []
    for run, (ds, nbs) in run_reads_:
        if run.dur_ns <= 0 or node_cost(run) is None:
            continue
        for d, nb in zip(ds, nbs):
            if d != inf:
                dist.append(d)
                size.append(nb)
    return SourceReuse(np.array(dist, np.float64), np.array(size, np.float64)) if dist else None
