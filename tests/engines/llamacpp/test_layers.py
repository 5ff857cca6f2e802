"""Per-layer breakdown and decode time against context length: the layers the model file
declares, the decode calls and prompt tokens llama.cpp counts itself."""
from __future__ import annotations

from gguf import GGUFReader

from conftest import completion_cmd, llama_perf, run_profinfer, with_llama_log
from profinfer.engines.llamacpp.views.dag import node_layers
from profinfer.engines.llamacpp.views.nodes import NodeRun
from profinfer.core.profile.opcolumns import NodeDesc


def _run(name: str) -> NodeRun:
    return NodeRun(0, NodeDesc("ADD", name, (1,), "f32", 1, (), (), 0, (), ()), 0, 1, 1, 1)


def test_layer_of_nodes_by_name_and_span():
    names = ["embd", "norm-0", "Qcur-0", "cache_k_l0 (view)", "node_7", "l_out-0",
             "norm-1", "node_9", "l_out-1", "node_12", "result_norm"]
    assert node_layers([_run(n) for n in names]) == [None, 0, 0, 0, 0, 0, 1, 1, 1, None, None]


def test_layers_and_context_staircase(llama_build, tiny_model, llama_env, tmp_path):
    """A prompt that ends just below a KV padding step (256) and a generation that crosses
    it: decode calls fall in exactly two KV-length groups, split where the context passes 256.
    (How much more the longer one costs is a measurement for the report, not a test.)"""
    words = "the and of to in is that it for on with as was at by this from".split()
    prompt = " ".join(words[i % len(words)] for i in range(236))
    r = with_llama_log(lambda: run_profinfer(
        # layers need every node (-o; without a timeline ops are counted per type)
        ["record", "--quiet", "-o", str(tmp_path / "t.pftrace"), "--",
         *completion_cmd(llama_build, tiny_model, n=48, prompt=prompt)],
        env=llama_env, tmp_path=tmp_path))
    assert r.rc == 0, r.stderr[-2000:]
    s, perf = r.summary, llama_perf(r.stderr)
    decoded = {row["layer"] for row in s["layers"] if row["phase"] == "decode" and row["layer"] is not None}
    assert decoded == set(range(block_count(tiny_model)))
    ctx = s["decode_by_context"]
    assert [c["kv_len"] for c in ctx] == [256, 512]
    assert sum(c["calls"] for c in ctx) == perf["eval"][1]
    # the context reaches 256 after 256 - prompt tokens decodes: those read a 256-long KV
    assert ctx[0]["calls"] == 256 - perf["prompt eval"][1]
    assert all(c["mean_attention_ns"] > 0 for c in ctx)


def block_count(model) -> int:
    """The model's layers, as its GGUF file declares them (ARCH.block_count)."""
    field = next(f for name, f in GGUFReader(model).fields.items() if name.endswith(".block_count"))
    return int(field.parts[field.data[0]][0])
