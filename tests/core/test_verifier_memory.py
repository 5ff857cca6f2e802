"""The kernel memory that verifying each BPF program takes, as the kernel charges it to the
loader's memory cgroup. The daemon's pod has 512 MiB in all, and the verifier's transient
states count in it: vLLM's vop_enter once took ~250 MiB of them, and the kernel then killed
the agent for memory while vLLM's processes were held at their loader (found by the pod test).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from profinfer.core.ebpf import bpfobj, libbpf
from profinfer.core.base import registry
from conftest import REPO

# what one program's verification may take beyond what its load keeps (its maps, its code)
TRANSIENT_MAX = 32 << 20

V1 = Path("/sys/fs/cgroup/memory")
V2 = Path("/sys/fs/cgroup")

# In a cgroup of its own from its first line: the kernel memory it is charged from then on
# is this one load's.
LOADER = r"""
import json, os, sys
cgroup, peak_file, now_file, path, program = sys.argv[1:]
with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:
    f.write(str(os.getpid()))
from profinfer.core.ebpf import libbpf
obj = libbpf.BpfObject(path)
obj.load({program})
read = lambda name: int(open(os.path.join(cgroup, name)).read())
print(json.dumps({"peak": read(peak_file), "now": read(now_file)}))
obj.close()
"""


def _memory_cgroup() -> tuple[Path, str, str]:
    """A new memory cgroup: (its directory, its peak file, its current-usage file), kernel
    memory alone where the hierarchy tells it apart (v1)."""
    name = f"profinfer-verifier-{uuid.uuid4().hex[:8]}"
    if (V1 / "memory.kmem.max_usage_in_bytes").exists():
        d = V1 / name
        d.mkdir()
        return d, "memory.kmem.max_usage_in_bytes", "memory.kmem.usage_in_bytes"
    if "memory" in (V2 / "cgroup.controllers").read_text().split():
        d = V2 / name
        d.mkdir()
        return d, "memory.peak", "memory.current"
    pytest.skip("no memory cgroup controller here")


def _programs() -> list[tuple[str, str]]:
    out = []
    for d in registry.bpf_dirs():
        for src in sorted(d.iterdir(), key=lambda f: f.name):
            if src.name.endswith(".bpf.c"):
                obj = libbpf.BpfObject(bpfobj.object_path(src.name, "ring"))
                try:
                    out += [(src.name, name) for name in obj.program_names()]
                finally:
                    obj.close()
    return out


def test_each_program_verifies_in_bounded_kernel_memory():
    programs = _programs()
    assert any(p == ("vllm.bpf.c", "vop_enter") for p in programs)
    over, charged_at_all = [], False
    for source, program in programs:
        cgroup, peak_file, now_file = _memory_cgroup()
        try:
            done = subprocess.run([sys.executable, "-c", LOADER, str(cgroup), peak_file, now_file,
                                   bpfobj.object_path(source, "ring"), program],
                                  capture_output=True, text=True, timeout=300,
                                  cwd=REPO)
            assert done.returncode == 0, f"{source} {program}: {done.stderr[-2000:]}"
            charged = json.loads(done.stdout)
        finally:
            os.rmdir(cgroup)
        charged_at_all |= charged["now"] > 0
        transient = charged["peak"] - charged["now"]
        if transient > TRANSIENT_MAX:
            over.append(f"{source} {program}: {transient >> 20} MiB")
    assert charged_at_all, "the kernel charged no load to its cgroup: this measures nothing here"
    assert not over, f"verified in more than {TRANSIENT_MAX >> 20} MiB of kernel memory: {over}"
