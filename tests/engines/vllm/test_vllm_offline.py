"""vLLM, offline generation: every native op call and every step, against the process's own
truth (torch.profiler with record_shapes, and the engine's scheduler outputs), in eager and
in the default compiled mode."""
from __future__ import annotations

import json
import subprocess
from collections import Counter
from pathlib import Path

import pytest

from conftest import CPU_FLAGS, PROFINFER, VLLM_NATIVE_LINEAR, BpfWatch, attached_generation
from profinfer.engines.vllm.views import comparable as vllm_comparable
from profinfer.exporters.trace_reader import read_trace

# torch.profiler's dtype names for the ScalarTypes seen (c10's C++ type names)
PROFILER_DTYPES = {"c10::BFloat16": "bfloat16", "float": "float32", "int": "int32",
                   "long int": "int64", "signed char": "int8", "c10::Half": "float16",
                   "double": "float64", "bool": "bool", "unsigned char": "uint8", "short int": "int16"}


# vLLM's linear layers on the CPU, by its ISA: SGL's packed kernel, or oneDNN's matmul where
# the CPU has AVX-512 with bf16; each with its input and output arguments
LINEAR_OPS = {"weight_packed_linear": ("mat1", "out"), "onednn_mm": ("a", "c")}


def linear_op(truth: dict) -> tuple[str, tuple[str, str]] | None:
    """The linear layers' op in a truth record (the one this machine's vLLM called); None on a
    CPU without AVX-512, whose build calls none (torch.profiler's record says so)."""
    found = {c["op"] for c in truth["calls"]} & set(LINEAR_OPS)
    if not VLLM_NATIVE_LINEAR:
        assert not found, found
        return None
    assert len(found) == 1, found
    op = found.pop()
    return op, LINEAR_OPS[op]


def _key(op: str, args: dict) -> tuple:
    return (op, tuple(sorted((name, None if a is None else (a["dtype"], tuple(a["shape"])))
                             for name, a in args.items())))


def _truth_key(call: dict) -> tuple:
    args = {name: None if a is None else {"dtype": PROFILER_DTYPES.get(a["dtype"], a["dtype"]),
                                          "shape": a["shape"]}
            for name, a in call["args"].items()}
    return _key(call["op"], args)


def run_offline(engine, tmp_path: Path, extra: tuple[str, ...] = (), timeline: bool = True,
                bpf_watch=None) -> tuple[dict, dict, str]:
    """One generation of the module's engine (conftest.vllm_engine) with profinfer attached:
    (its truth, profinfer's summary, its stderr). timeline: with -o (each call sent); without,
    the op level counts calls in BPF."""
    truth_path, summary_path = tmp_path / "truth.json", tmp_path / "summary.json"
    out = ["-o", str(tmp_path / "trace.pftrace")] if timeline else []
    truth, err = attached_generation(engine, ["attach", "--pid", str(engine.pid), "--json", str(summary_path),
                                              *out, "--quiet", *extra], truth_path, bpf_watch=bpf_watch)
    return truth, json.loads(summary_path.read_text()), err


@pytest.fixture(scope="module")
def recorded(vllm_engine, tmp_path_factory):
    """recorded(mode): the mode's run with a timeline (its directory, truth and summary),
    made once for the tests that read it."""
    runs: dict[str, tuple[Path, dict, dict]] = {}

    def get(mode: str) -> tuple[Path, dict, dict]:
        if mode not in runs:
            where = tmp_path_factory.mktemp(f"vllm-{mode}")
            watch = BpfWatch()
            try:
                truth, summary, _ = run_offline(vllm_engine(mode), where, bpf_watch=watch)
            finally:
                watch.stop()
            runs[mode] = (where, truth, summary)
        return runs[mode]
    return get


@pytest.mark.parametrize("mode, timeline", [("eager", True), ("compiled", True),
                                            ("eager", False), ("compiled", False)],
                         ids=["eager", "compiled", "eager-counted", "compiled-counted"])
def test_ops_and_steps_equal_the_process_own_record(vllm_engine, vllm_model, recorded, mode, timeline, tmp_path,
                                                    bpf_watch):
    """With a timeline every call is sent; without, BPF counts them by op, shapes, thread and
    phase, and sends only the step ops' and attention's (whose values it reads): the same
    figures either way."""
    if timeline:
        where, truth, summary = recorded(mode)
    else:
        where = tmp_path
        truth, summary, _ = run_offline(vllm_engine(mode), tmp_path, timeline=False, bpf_watch=bpf_watch)
    assert summary["lost_events"] == 0
    assert summary["meta"]["engine"] == "vLLM"
    assert summary["meta"].get("op_level") == (None if timeline else "counted")
    # every native op call, by op and by each tensor argument's dtype and shape (an empty
    # optional: None), exactly as torch.profiler recorded them in the same process
    want = Counter(_truth_key(c) for c in truth["calls"])
    got = Counter()
    for row in summary["op_shapes"]:
        got[_key(row["op"], row["args"])] += row["count"]
    assert got == want
    # enough calls to mean something (the linear layers' are most of them where they are native)
    assert len(truth["calls"]) >= (300 if VLLM_NATIVE_LINEAR else 120)
    ops = {o["op"] for o in summary["ops"]}
    assert {"cpu_attention_with_kv_cache", "cpu_attn_reshape_and_cache"} <= ops
    # eager runs rotary embedding as a native op; compiled makes it a generated kernel
    assert ("rotary_embedding" in ops) == (mode == "eager")
    if mode == "compiled":
        assert "compiled" in summary["meta"]["mode"] and "rotary" in summary["meta"]["unobserved"]
    else:
        assert summary["meta"]["mode"] == "eager"
    # steps: as many as the scheduler made, each with its requests' new tokens
    steps = summary["step_list"]
    assert len(steps) == len(truth["steps"]) == 12
    # the per-thread open-span state (what a level under the engine reads) counted the same
    assert int(summary["meta"]["steps_begun"]) == 12
    assert [sorted(s["query_lens"]) for s in steps] == truth["steps"]
    assert [s["tokens"] for s in steps] == [sum(t) for t in truth["steps"]]
    assert [s["phase"] for s in steps] == ["prefill"] + ["decode"] * 11
    assert summary["tokens"] == {"prefill": sum(truth["steps"][0]), "decode": 11 * 4}
    # every call from the first step's start on falls in one step: all but the first
    # step's input preparation (its slot mapping comes before its scheduler metadata)
    assert sum(s["calls"] for s in steps) == len(truth["calls"]) - 1
    # roofline: the matmuls' FLOPs from the shapes, as torch.profiler recorded them (the
    # linear layers' op is the CPU's: LINEAR_OPS)
    verdicts = {v["scope"]: v for v in summary["roofline"]["verdicts"]}
    found = linear_op(truth)
    if found is None:           # none called: none judged
        assert not [s for s in verdicts if s.rsplit(" ", 1)[-1] in LINEAR_OPS], verdicts
    else:
        op, (a_name, out_name) = found
        mm = [c["args"] for c in truth["calls"] if c["op"] == op]
        flops = sum(2 * a[a_name]["shape"][-1] * a[out_name]["shape"][0] * a[out_name]["shape"][1] for a in mm)
        linear = [v for scope, v in verdicts.items() if scope.endswith(f" {op}")]
        assert len(linear) == 2 and sum(v["flops"] for v in linear) == flops
        assert sum(v["nodes"] for v in linear) == len(mm)
    # attention: each new token against its sequence's whole context (4 FLOPs a head, key
    # dimension and context token), the contexts from the scheduler's own steps: the
    # prefill's prompts, then each decode step one token longer; heads, head size and layers
    # from the model's own config
    prompts = truth["steps"][0]
    config = json.loads((vllm_model / "config.json").read_text())
    heads, layers = config["num_attention_heads"], config["num_hidden_layers"]
    dim = config.get("head_dim") or config["hidden_size"] // heads
    contexts = sum(p * p for p in prompts) + sum(p + k for k in range(1, 12) for p in prompts)
    attention = [v for scope, v in verdicts.items() if scope.endswith(" cpu_attention_with_kv_cache")]
    assert sum(v["flops"] for v in attention) == layers * 4 * heads * dim * contexts
    if not timeline:
        return
    # the Perfetto trace holds the same: `report` of it gives the same summary
    reread = tmp_path / "reread.json"
    r = subprocess.run([*PROFINFER, "report", str(where / "trace.pftrace"), "--json", str(reread)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    again = json.loads(reread.read_text())
    for key in ("ops", "op_shapes", "step_list", "tokens", "phases", "lost_events", "roofline"):
        assert again[key] == summary[key], key


def test_diff_eager_against_compiled_shows_the_ops_compilation_removes(recorded, tmp_path):
    """`diff` of the eager run against the compiled one: each op torch.profiler saw only in
    eager mode (the norms, activations and rotary embeddings that compiled graphs make
    kernels of their own) is a row of the eager run alone, in decode; an op both modes
    called is no such row, and no row names an op torch.profiler saw in neither."""
    (eager_dir, eager, _), (compiled_dir, compiled, _) = recorded("eager"), recorded("compiled")
    eager_ops, compiled_ops = ({c["op"] for c in t["calls"]} for t in (eager, compiled))
    removed = eager_ops - compiled_ops
    assert removed       # what compilation removes, by the processes' own record
    out = tmp_path / "d.json"
    r = subprocess.run([*PROFINFER, "diff", str(eager_dir / "trace.pftrace"), str(compiled_dir / "trace.pftrace"),
                        "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    rows = [c for c in json.loads(out.read_text())["changes"] if c["section"] == "op"]
    ops = {}
    for c in rows:
        phase, op = c["name"].split(" ", 1)
        ops.setdefault(op, {})[phase] = c["verdict"]
    assert set(ops) <= eager_ops | compiled_ops
    for op in removed:
        assert ops.get(op, {}).get("decode") == "only before", (op, ops.get(op))
        assert set(ops[op].values()) == {"only before"}, (op, ops[op])
    for op in compiled_ops - eager_ops:
        assert set(ops.get(op, {}).values()) == {"only after"}, (op, ops.get(op))
    for op in eager_ops & compiled_ops:
        assert not {"only before", "only after"} & set(ops.get(op, {}).values()), (op, ops[op])
    # the runs are comparable: the same attention in both, as the processes called it
    attention = [c["args"] for c in eager["calls"] if c["op"] == "cpu_attention_with_kv_cache"]
    (heads, size), = {tuple(a["query"]["shape"][1:]) for a in attention}
    kv_heads, = {a["key_cache"]["shape"][1] for a in attention}
    want = {"attention layers": str(len(attention) // len(eager["steps"])), "query heads": str(heads),
            "KV heads": str(kv_heads), "head size": str(size)}
    assert len(attention) % len(eager["steps"]) == 0
    for where in (eager_dir, compiled_dir):
        assert vllm_comparable.identity(read_trace(where / "trace.pftrace")) == want


def test_counters_per_native_op(vllm_engine, tmp_path, bpf_watch):
    """Software perf counters read around every call (per CPU: a call whose thread moved is
    not counted): task-clock over a call is the call's own time on its CPU."""
    truth, summary, _ = run_offline(vllm_engine("eager"), tmp_path, ("--counters", "task-clock,context-switches"),
                                    bpf_watch=bpf_watch)
    ctr = summary["counters"]
    assert ctr["names"] == ["task-clock", "context-switches"]
    counted = sum(r["counted"] for r in ctr["ops"])
    assert counted == len(truth["calls"]) - sum(ctr["dropped_ops"].values())
    assert counted >= 0.9 * len(truth["calls"])
    for r in ctr["ops"]:
        # the counters are read just outside the call's clock reads: within a few µs a call
        assert r["dur_ns"] * 0.9 <= r["totals"]["task-clock"] <= r["dur_ns"] + 5_000 * r["counted"], r
    assert set(ctr["phases"]) == {"prefill", "decode"}


def test_sched_level_on_native_ops(vllm_engine, tmp_path, bpf_watch):
    """The sched level watches the engine's threads: the calling thread's time on a CPU over
    the generation, from its context switches, is the kernel's own count of it."""
    from profinfer.levels.sched import stats as schedstats
    truth, summary, _ = run_offline(vllm_engine("eager"), tmp_path, ("--levels", "op,sched"), bpf_watch=bpf_watch)
    assert summary["sched"]["switches"] > 0 and summary["lost_events"] == 0
    linear = linear_op(truth)
    assert {o["op"] for o in summary["sched"]["ops"]} >= {"cpu_attention_with_kv_cache"} | (
        {linear[0]} if linear else set())
    profile = read_trace(tmp_path / "trace.pftrace")
    lo, hi = truth["start_ns"], truth["end_ns"]
    on_cpu = sum(max(0, min(e, hi) - max(s, lo))
                 for s, e, state, _ in schedstats.thread_intervals(profile)[truth["tid"]]
                 if state == schedstats.ON_CPU)
    assert on_cpu == pytest.approx(truth["on_cpu_ns"], rel=0.05)


SCHEMAS_OF_TORCH = """
import json, sys, torch
torch.ops.load_library(sys.argv[1])  # registers the ops (the ISA build this CPU runs) with torch
out = {}
for name in sys.argv[2:]:
    packet = getattr(torch.ops._C, name, None)
    if packet is not None:
        out[name] = [[a.name, str(a.type)] for a in packet.default._schema.arguments]
print(json.dumps(out))
"""


def test_op_discovery_agrees_with_torch_registry_on_every_isa_build(vllm_python):
    """The three CPU builds (AVX-512 with bf16, AVX-512, AVX2) are read the same way, from
    their own schema strings and symbols; the ops found, their argument names and which
    arguments are tensors agree with the schemas torch itself registered for them."""
    from profinfer.engines.vllm.probes.ops import SKIP, native_ops
    from profinfer.core.target.symbols import load_elf
    site = next((Path(vllm_python).parent.parent / "lib").glob("python3*/site-packages/vllm"))
    found = {}
    for lib in ("_C.abi3.so", "_C_AVX512.abi3.so", "_C_AVX2.abi3.so"):
        ops, _ = native_ops(load_elf(str(site / lib)))
        found[lib] = {o.name: o for o in ops}
        assert {"cpu_attention_with_kv_cache", "cpu_attn_reshape_and_cache", "rotary_embedding",
                "get_scheduler_metadata"} <= set(found[lib]), lib
        # a returned tensor takes the hidden pointer: greedy_argmax's logits arrive in rsi
        assert found[lib]["greedy_argmax"].slots == (1,)
    # torch registers the build this CPU can run (an AVX-512 one dies of SIGILL on AVX2 alone)
    runs = "_C" if "avx512_bf16" in CPU_FLAGS else "_C_AVX512" if "avx512f" in CPU_FLAGS else "_C_AVX2"
    ours = found[f"{runs}.abi3.so"]
    r = subprocess.run([str(vllm_python), "-c", SCHEMAS_OF_TORCH, str(site / f"{runs}.abi3.so"), *sorted(ours)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    registry = json.loads(r.stdout.strip().splitlines()[-1])
    # (the AVX2 build has fewer: 43, no matmuls of its own)
    assert len(registry) >= (40 if runs == "_C_AVX2" else 60) and set(registry) <= set(ours)
    for name, args in registry.items():
        op = ours[name]
        assert [a.name for a in op.schema.args] == [a for a, _ in args], name
        tensors = [i for i, (_, t) in enumerate(args) if t in ("Tensor", "Optional[Tensor]")]
        assert [i for i, k in enumerate(op.kinds) if k != SKIP] == tensors, name


def test_op_discovery_reads_a_gpu_release():
    """vLLM 0.33.0's CUDA wheel (never run here): stable-ABI ops whose symbols are local,
    MoE ops, and flash-attention, whose C++ functions are not named as their ops."""
    from profinfer.engines.vllm import workload as vllm_workload
    from profinfer.engines.vllm.probes.ops import OPT_STABLE_TENSOR, STABLE_TENSOR, native_ops
    from profinfer.core.target.symbols import load_elf
    root = vllm_workload.ensure_gpu_release_libraries() / "vllm"
    stable = load_elf(str(root / "_C_stable_libtorch.abi3.so"))
    ops, skipped = native_ops(stable)
    names = {o.name: o for o in ops}
    assert len(ops) >= 120 and len(skipped) <= 4, skipped
    rms = names["fused_add_rms_norm"]       # (Tensor! input, Tensor! residual, Tensor? weight, float)
    assert rms.kinds == (STABLE_TENSOR, STABLE_TENSOR, OPT_STABLE_TENSOR, 0)
    assert names["reshape_and_cache_flash"].tensor_args[:5] == ["key", "value", "key_cache",
                                                                "value_cache", "slot_mapping"]
    fa3, _ = native_ops(load_elf(str(root / "vllm_flash_attn" / "_vllm_fa3_C.abi3.so")))
    fa3 = {o.name: o for o in fa3}
    assert fa3["fwd"].signature.startswith("mha_fwd(")
    meta = fa3["get_scheduler_metadata"]       # returns a tensor: the request count is in esi
    assert meta.signature.startswith("mha_fwd_get_scheduler_metadata(") and meta.slots[0] == 1
    fa2, _ = native_ops(load_elf(str(root / "vllm_flash_attn" / "_vllm_fa2_C.abi3.so")))
    assert {o.name: o for o in fa2}["varlen_fwd"].signature.startswith("flash::mha_varlen_fwd(")
    moe, skipped = native_ops(load_elf(str(root / "_moe_C_stable_libtorch.abi3.so")))
    assert len(moe) >= 15 and not skipped
