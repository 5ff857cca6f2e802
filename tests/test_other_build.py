"""Acceptance 8: another llama.cpp version, built as plain Release (no DWARF), works without
code changes: structures come from the known-layout table, validated on live data."""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from conftest import completion_cmd, llama_perf, run_profinfer, with_llama_log
from profinfer import workload
from profinfer.symbols import load_elf


@pytest.fixture(scope="session")
def release_build():
    return workload.ensure_llama_build(workload.OTHER_VERSION, debug_info=False)


def test_release_build_of_other_version(release_build, tiny_model, tmp_path):
    libs = list((release_build / "bin").glob("libggml-base.so*"))
    assert libs and all(load_elf(str(p)).dwarf_path is None for p in libs), "must be a build without DWARF"
    env = {**os.environ, **workload.llama_env(release_build)}
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


def test_fully_stripped_libraries(release_build, tiny_model, tmp_path):
    """strip --strip-all leaves only .dynsym: exported entry points still give every level
    (the backends' static graph_compute functions are gone, so the graph level falls back
    to ggml_backend_graph_compute_async), and profinfer says what it fell back to."""
    copy = tmp_path / "bin"
    shutil.copytree(release_build / "bin", copy, symlinks=True)
    for lib in copy.glob("lib*.so.*.*"):
        subprocess.run(["strip", "--strip-all", str(lib)], check=True)
        assert not load_elf(str(lib)).has_symtab
    env = {**os.environ, "LD_LIBRARY_PATH": str(copy)}
    cmd = completion_cmd(release_build, tiny_model, n=16)
    cmd[0] = str(copy / "llama-completion")
    r = with_llama_log(lambda: run_profinfer(["record", "--quiet", "--", *cmd], env=env, tmp_path=tmp_path))
    assert r.rc == 0, r.stderr[-2000:]
    s = r.summary
    assert s["tokens"]["decode"] == llama_perf(r.stderr)["eval"][1]
    assert any(k.startswith("probe:ggml_backend_graph_compute_async+") for k in s["meta"])
    # no symbol table, so no graph-loop call sites: the barrier is probed at its entry
    assert any(k.startswith("probe:ggml_barrier+") for k in s["meta"])
    assert {"MUL_MAT", "ROPE"} <= {o["op"] for o in s["ops"]}
