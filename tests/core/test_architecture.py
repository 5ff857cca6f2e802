"""Probe placement decodes x86-64 only: a llama.cpp built for another architecture is refused
with one line naming it, never probed at offsets computed from misread instructions."""
from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import run_profinfer
from profinfer.core.base.errors import ProfinferError
from profinfer.core.plugin.packs import load_pack, resolve
from profinfer.core.target.symbols import load_elf

# Entry points the llama.cpp probe pack looks for, as a real aarch64 library defines them.
SOURCE = """
struct llama_batch { int n_tokens; };
int llama_decode(void *ctx, struct llama_batch batch) { return ctx ? batch.n_tokens : -1; }
void ggml_barrier(void *threadpool) { (void)threadpool; }
void ggml_cpu_extra_compute_forward(void *params, void *tensor) { (void)params; (void)tensor; }
const char *ggml_op_name(int op) { return op ? "OP" : "NONE"; }
"""


@pytest.fixture(scope="module")
def aarch64_llama(tmp_path_factory):
    """A real aarch64 shared object, built by clang and lld (setup.sh installs both)."""
    d = tmp_path_factory.mktemp("aarch64")
    (d / "llama.c").write_text(SOURCE)
    lib = d / "libllama.so"
    subprocess.run(["clang", "--target=aarch64-linux-gnu", "-fuse-ld=lld", "-nostdlib", "-shared",
                    "-fPIC", "-O1", "-o", str(lib), str(d / "llama.c")], check=True)
    header = subprocess.run(["readelf", "-h", str(lib)], capture_output=True, text=True).stdout
    assert "AArch64" in header
    return lib


def test_resolve_refuses_an_aarch64_library(aarch64_llama):
    elf = load_elf(str(aarch64_llama))
    assert elf.find("llama_decode")          # the probes would resolve: only the check refuses
    with pytest.raises(ProfinferError, match=r"libllama\.so is built for aarch64: profinfer "
                                             r"places probes by decoding x86-64 code only"):
        resolve(load_pack("llamacpp"), [elf], {"token", "graph", "op"})


def test_attach_to_a_process_mapping_aarch64_llama(aarch64_llama, tmp_path):
    """Through the CLI: an x86-64 process that maps the aarch64 library executable (as a
    loader would; it cannot run it) is refused in one line, before anything is attached."""
    holder = subprocess.Popen([sys.executable, "-c", (
        "import mmap, sys, time\n"
        f"f = open({str(aarch64_llama)!r}, 'rb')\n"
        "m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ | mmap.PROT_EXEC)\n"
        "print('mapped', flush=True)\n"
        "time.sleep(60)\n")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "mapped"
        r = run_profinfer(["attach", "--pid", str(holder.pid), "--duration", "1"], tmp_path=tmp_path)
    finally:
        holder.kill()
        holder.wait()
    assert r.rc != 0
    lines = r.stderr.strip().splitlines()
    assert lines == [f"profinfer: error: /proc/{holder.pid}/root{aarch64_llama} is built for "
                     "aarch64: profinfer places probes by decoding x86-64 code only"], r.stderr
