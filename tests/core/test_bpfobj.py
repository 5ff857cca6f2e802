"""The BPF object: built ahead of time by clang, cached by content, loadable by the kernel."""
from __future__ import annotations

import os

import pytest

from profinfer.core.ebpf import bpfobj, libbpf
from profinfer.core.base.errors import ProfinferError


def test_object_builds_caches_and_verifies(tmp_path, monkeypatch):
    monkeypatch.setenv("PROFINFER_CACHE", str(tmp_path))
    paths = {v: bpfobj.object_path("llamacpp.bpf.c", v) for v in bpfobj.VARIANTS}
    assert all(p.startswith(str(tmp_path)) and os.path.getsize(p) > 0 for p in paths.values())
    mtime = os.path.getmtime(paths["ring"])
    assert bpfobj.object_path("llamacpp.bpf.c", "ring") == paths["ring"]   # cached, not rebuilt
    assert os.path.getmtime(paths["ring"]) == mtime
    sched = {v: bpfobj.object_path("sched.bpf.c", v) for v in bpfobj.VARIANTS}
    for path in [*paths.values(), *sched.values()]:
        obj = libbpf.BpfObject(path)
        try:
            names = obj.program_names()
            assert ({"sched_switch", "sched_wakeup"} if "sched" in path else
                    {"token_enter", "token_return", "op_start", "op_barrier", "graph_enter_7"}) <= set(names)
            obj.load(set(names))   # the kernel's verifier accepts every program
        finally:
            obj.close()


def test_missing_object_without_clang_is_one_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("PROFINFER_CACHE", str(tmp_path))
    monkeypatch.setattr(bpfobj, "find_clang", lambda: None)
    with pytest.raises(ProfinferError, match="no clang to build it"):
        bpfobj.object_path("llamacpp.bpf.c", "ring")


def test_configuration_size_mismatch_is_refused(tmp_path):
    obj = libbpf.BpfObject(bpfobj.object_path("llamacpp.bpf.c", "ring"))
    try:
        with pytest.raises(ProfinferError, match="disagree"):
            obj.set_rodata(b"\0" * 3)
    finally:
        obj.close()
