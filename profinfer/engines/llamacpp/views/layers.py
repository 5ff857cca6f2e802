"""Per-layer time and decode time as a function of context length (pure logic).

- Layer of a node: from its tensor name ("ffn_out-7"), or the layer whose span it lies in
  (profinfer.engines.llamacpp.views.dag); nodes outside every layer (embedding, output head) are layer None.
- Context: each decode call is placed by the KV length its attention read (the K source of
  FLASH_ATTN_EXT, or of the KQ MUL_MAT without flash attention). llama.cpp pads that length
  (to 256 on CPU), so decode time rises in steps: the staircase of KQ/KQV cost.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from profinfer.engines.llamacpp.views.dag import graph_dags, node_layers
from profinfer.core.profile.model import Profile
from profinfer.engines.llamacpp.views.nodes import node_runs


@dataclass
class LayerRow:
    layer: int | None
    phase: str
    nodes: int
    time_ns: int


def layer_times(profile: Profile) -> list[LayerRow]:
    acc: dict[tuple[int | None, str], list[int]] = {}
    for g in graph_dags(profile):
        for n, layer in zip(g.nodes, node_layers(g.nodes)):
            row = acc.setdefault((layer, g.phase), [0, 0])
            row[0] += 1
            row[1] += n.dur_ns
    return [LayerRow(layer, phase, c, t) for (layer, phase), (c, t) in
            sorted(acc.items(), key=lambda kv: (kv[0][1], -1 if kv[0][0] is None else kv[0][0]))]


@dataclass
class ContextRow:
    kv_len: int               # KV length attention read (padded as llama.cpp pads it)
    calls: int
    mean_call_ns: float       # llama_decode duration (TPOT without sampling)
    mean_attention_ns: float  # attention nodes' time per call


def decode_by_context(profile: Profile) -> list[ContextRow]:
    decode = sorted((t for t in profile.tokens if not t.prefill), key=lambda t: t.start_ns)
    if not decode:
        return []
    runs, _ = node_runs(profile)
    attn = [r for r in runs if r.op.startswith("FLASH_ATTN_EXT") and len(r.src_ne) > 1]
    if not attn:
        attn = [r for r in runs if r.op == "MUL_MAT" and r.name.startswith("kq") and len(r.src_ne) > 1]
    if not attn:
        return []
    starts = np.array([t.start_ns for t in decode], np.int64)
    ends = np.array([t.end_ns for t in decode], np.int64)
    kv: dict[int, int] = {}
    attn_ns = np.zeros(len(decode), np.int64)
    for r in attn:
        i = int(np.searchsorted(starts, r.start_ns, side="right")) - 1
        if i < 0 or r.start_ns > ends[i]:
            continue
        # FLASH_ATTN_EXT: K is [D, n_kv, H_kv]; KQ MUL_MAT: src0 is K
        k_ne = r.src_ne[1] if r.op.startswith("FLASH_ATTN_EXT") else r.src_ne[0]
        kv[i] = max(kv.get(i, 0), int(k_ne[1]))
        attn_ns[i] += r.dur_ns
    groups: dict[int, list[int]] = {}
    for i, n in kv.items():
        groups.setdefault(n, []).append(i)
    return [ContextRow(n, len(ix), float(np.mean([decode[i].dur_ns for i in ix])),
                       float(np.mean(attn_ns[ix]))) for n, ix in sorted(groups.items())]
