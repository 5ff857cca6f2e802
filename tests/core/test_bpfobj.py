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


def test_an_object_is_named_by_what_it_includes_not_by_the_plugins_beside_it(tmp_path):
    """An object's name hashes its program and the headers it includes (transitively): a
    plug-in installed beside the bundled ones (the toy engine, with a header of its own)
    renames none of their objects (the wheel ships them by name), and a header an object
    includes from another plug-in (llama.cpp's program, the sched level's sched.h) is hashed
    into its name."""
    import subprocess
    import sys
    from pathlib import Path
    from profinfer.core.base import registry
    from profinfer.core.ebpf import bpfbuild
    tests = Path(__file__).resolve().parents[1]
    code = ("from profinfer.core.ebpf import bpfobj\n"
            "print(*(bpfobj._name(s, 'ring') for s in ('discover.bpf.c', 'llamacpp.bpf.c', 'cuda.bpf.c')))")
    names = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env).stdout
             for env in (os.environ, {**os.environ, "PROFINFER_PLUGINS": "toyengine",
                                      "PYTHONPATH": os.pathsep.join([str(tests), os.environ.get("PYTHONPATH", "")])})]
    assert names[0] == names[1] and len(names[0].split()) == 3, names
    sched_h = registry.bpf_file("sched.h").read_bytes()
    assert sched_h in bpfbuild.included(registry.bpf_file("llamacpp.bpf.c"), registry.bpf_dirs())
    assert sched_h not in bpfbuild.included(registry.bpf_file("cuda.bpf.c"), registry.bpf_dirs())
