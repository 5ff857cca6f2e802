"""Another llama.cpp version, built as plain Release (no DWARF), works without
code changes: structures come from the known-layout table, validated on live data."""
from __future__ import annotations

import shutil
import subprocess

import pytest

from conftest import completion_cmd, llama_perf, llama_run_env, run_profinfer, with_llama_log
from profinfer.engines.llamacpp.probes import ggml
from profinfer.engines.llamacpp import workload
from profinfer.core.target.symbols import load_elf


@pytest.fixture(scope="session")
def release_build():
    return workload.ensure_llama_build(workload.OTHER_VERSION, debug_info=False)


def test_release_build_of_other_version(release_build, tiny_model, tmp_path):
    libs = list((release_build / "bin").glob("libggml-base.so*"))
    assert libs and all(load_elf(str(p)).dwarf_path is None for p in libs), "must be a build without DWARF"
    env = llama_run_env(release_build)
    r = with_llama_log(lambda: run_profinfer(
        ["record", "--quiet", "--", *completion_cmd(release_build, tiny_model, n=16)],
        env=env, tmp_path=tmp_path))
    assert r.rc == 0, r.stderr[-2000:]
    assert "validated on the first" in r.stderr          # it said it used a table layout
    perf = llama_perf(r.stderr)
    s = r.summary
    assert s["tokens"]["prefill"] == perf["prompt eval"][1]
    assert s["tokens"]["decode"] == perf["eval"][1]
    ops = {o["op"] for o in s["ops"]}
    assert {"MUL_MAT", "ROPE", "GET_ROWS"} <= ops
    assert not any(o.startswith("OP") for o in ops)     # every op named from the binary's table
    # without the graph loop's DWARF the op level keeps two probes per node, and says why
    assert s["meta"]["op_probes"].startswith("two probes per node (no DWARF for libggml-cpu.so")


def test_fully_stripped_libraries(release_build, tiny_model, tmp_path):
    """strip --strip-all leaves only .dynsym: exported entry points still give every level
    (the backends' static graph_compute functions are gone, so the graph level falls back
    to ggml_backend_graph_compute_async), and profinfer says what it fell back to."""
    copy = tmp_path / "bin"
    shutil.copytree(release_build / "bin", copy, symlinks=True)
    for lib in copy.glob("lib*.so.*.*"):
        subprocess.run(["strip", "--strip-all", str(lib)], check=True)
        assert not load_elf(str(lib)).has_symtab
    env = llama_run_env(release_build, LD_LIBRARY_PATH=str(copy))
    cmd = completion_cmd(release_build, tiny_model, n=16)
    cmd[0] = str(copy / "llama-completion")
    r = with_llama_log(lambda: run_profinfer(["record", "--quiet", "--", *cmd], env=env, tmp_path=tmp_path))
    assert r.rc == 0, r.stderr[-2000:]
    s = r.summary
    assert s["tokens"]["decode"] == llama_perf(r.stderr)["eval"][1]
    assert any(k.startswith("probe:ggml_backend_graph_compute_async+") for k in s["meta"])
    # no symbol table, so no graph-loop call sites: the barrier is probed at its entry
    assert any(k.startswith("probe:ggml_barrier+") for k in s["meta"])
    assert s["meta"]["op_probes"] == "two probes per node (no ggml_graph_compute_thread symbol)"
    assert {"MUL_MAT", "ROPE"} <= {o["op"] for o in s["ops"]}


def _layout_spec(lay: ggml.TensorLayout, **moved: int) -> str:
    """--tensor-layout as offsets, some moved by the given number of bytes."""
    offsets = {"type": lay.type, "ne": lay.ne, "op": lay.op, "src": lay.src,
               "view_src": lay.view_src, "data": lay.data, "name": lay.name_off}
    return ",".join(f"{k}={v + moved.get(k, 0)}" for k, v in offsets.items())


@pytest.fixture(scope="module")
def dwarf_layout(llama_build):
    base = load_elf(str(next((llama_build / "bin").glob("libggml-base.so.*.*"))))
    return ggml.tensor_layout_from_dwarf(base.dwarf_path)


@pytest.mark.parametrize("moved,fault", [
    # src[] read one pointer late: src[0] is the real src[1] (absent for unary ops, the
    # activations for a matmul), and so on
    ({"src": 8}, "sources (src) are missing, unreadable, or not what the op takes"),
    # view_src read at view_offs: the DAG would lose every view's root
    ({"view_src": 8}, "views (view_src, view_offs) do not point at the tensor that holds their data"),
    # data read at view_offs: the MoE reads would read expert ids from address 0
    ({"data": -8}, "data is null"),
])
def test_table_layout_with_wrong_edges_is_refused(llama_build, tiny_model, dwarf_layout, tmp_path,
                                                 moved, fault):
    """A layout whose op, type, ne and name offsets are right (every op decodes as a sane node)
    but whose src, view_src or data offset is wrong is refused, naming what is wrong. (Run on
    the DWARF build, whose true offsets are known; --tensor-layout makes it skip DWARF.)"""
    env = llama_run_env(llama_build)
    cmd = completion_cmd(llama_build, tiny_model, n=8)
    wrong = _layout_spec(dwarf_layout, **moved)
    r = run_profinfer(["record", "--quiet", "--tensor-layout", wrong, "--", *cmd],
                      env=env, tmp_path=tmp_path)
    assert r.rc != 0
    errors = [l for l in r.stderr.splitlines() if l.startswith("profinfer: error:")]
    assert len(errors) == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert errors[0].startswith(f"profinfer: error: unknown ggml_tensor layout: with the {wrong} "
                                f"layout, {fault} in "), errors[0]


def test_table_layout_from_offsets_is_accepted(llama_build, tiny_model, dwarf_layout, tmp_path):
    """The offsets this build's DWARF gives, passed as a table layout, pass every check."""
    env = llama_run_env(llama_build)
    cmd = completion_cmd(llama_build, tiny_model, n=8)
    right = _layout_spec(dwarf_layout)
    r = with_llama_log(lambda: run_profinfer(["record", "--quiet", "--tensor-layout", right, "--", *cmd],
                                             env=env, tmp_path=tmp_path))
    assert r.rc == 0, r.stderr[-2000:]
    assert r.summary["meta"]["tensor_layout"] == right
    assert r.summary["tokens"]["decode"] == llama_perf(r.stderr)["eval"][1]
