"""Facts read from the target binary: symbols, op-name table, struct layouts, probe offsets."""
from __future__ import annotations

import re
import subprocess

import pytest

from profinfer.core.target import dwarf
from profinfer.core.ebpf import layout
from profinfer.core.target.arch import placement
from profinfer.engines.llamacpp.probes import ggml
from profinfer.core.base.errors import ProfinferError
from profinfer.core.target.symbols import load_elf


def lib(build, name):
    return load_elf(str(next((build / "bin").glob(name + ".so.*.*"))))


def test_symbol_offsets_match_nm(llama_build):
    elf = lib(llama_build, "libggml-cpu")
    nm = subprocess.run(["nm", "--defined-only", elf.path], capture_output=True, text=True).stdout
    want = {l.split()[2]: int(l.split()[0], 16) for l in nm.splitlines()
            if len(l.split()) == 3 and l.split()[1] in "Tt"}
    for name in ("ggml_barrier", "ggml_cpu_extra_compute_forward", "ggml_compute_forward_rms_norm_mul_fused"):
        assert elf.find(name).vaddr == want[name]


def test_op_names_equal_the_enum_in_the_source(llama_build):
    """The table read from the binary (through ggml_op_name's lea) is exactly enum ggml_op."""
    header = (llama_build.parent / "src" / "ggml" / "include" / "ggml.h").read_text()
    body = header[header.index("enum ggml_op {"):]
    body = body[: re.search(r"GGML_OP_COUNT\s*,", body).start()]
    enum = [m.group(1) for m in re.finditer(r"^\s*GGML_OP_(\w+)\s*[,=]", body, re.M)]
    assert ggml.op_names(lib(llama_build, "libggml-base")) == enum


def test_dwarf_layouts(llama_build):
    base = lib(llama_build, "libggml-base")
    t = ggml.tensor_layout_from_dwarf(base.dwarf_path)
    assert (t.type, t.ne, t.op, t.src, t.name_off) == (0, 16, 80, 152, 256)
    assert ggml.KNOWN_LAYOUTS[0].op == t.op and ggml.KNOWN_LAYOUTS[0].name_off == t.name_off
    llama = lib(llama_build, "libllama")
    b = dwarf.struct_layout(llama.dwarf_path, "llama_batch_ext")
    assert "tokens" in b["members"] and b["nested"]["token"] > 0


def test_tensor_layout_from_offsets(llama_build):
    """--tensor-layout spelled as offsets equals the DWARF layout it spells; a bad spelling is
    one clear error, not a traceback later."""
    base = lib(llama_build, "libggml-base")
    t = ggml.tensor_layout_from_dwarf(base.dwarf_path)
    spec = (f"type={t.type},ne={t.ne},op={t.op},src={t.src},view_src={t.view_src},"
            f"data={t.data},name={t.name_off}")
    got = ggml.layout_by_name(spec)
    assert (got.type, got.ne, got.op, got.src, got.view_src, got.data, got.name_off, got.nb) == \
        (t.type, t.ne, t.op, t.src, t.view_src, t.data, t.name_off, t.nb)
    for bad, says in ((spec.replace(",name=", ",nam="), "give each of"),
                      (spec.replace(f"data={t.data}", ""), "give each of"),
                      (spec.rsplit(",", 1)[0], "no offset for name"),
                      (spec.replace(f"src={t.src},", f"src={t.src + 4},"), "misaligned"),
                      (spec.replace(f"name={t.name_off}", "name=500"), "beyond the first 512"),
                      ("ggml-1999", "unknown tensor layout")):
        with pytest.raises(ProfinferError, match=says):
            ggml.layout_by_name(bad)


@pytest.mark.parametrize("code,args,offset,emulated", [
    (bytes.fromhex("4155" "4154"), (2,), 0, True),                        # push r13
    (bytes.fromhex("8b4768" "6683f801" "7407" "c3"), (), 7, True),         # mov; cmp; je
    (bytes.fromhex("4889fb" "53" "c3"), (1,), 3, True),                    # mov rbx,rdi keeps rdi
    (bytes.fromhex("bf05000000" "53" "c3"), (1,), 0, False),               # mov edi,5 clobbers arg 1
    (bytes.fromhex("4883ec08" "53" "c3"), (), 0, False),                   # sub rsp moves the stack
    (bytes.fromhex("4885ff" "7403" "c3"), (1, 2), 3, True),                # test; je
])
def test_probe_placement(code, args, offset, emulated):
    p = placement.choose(code, args)
    assert (p.offset, p.emulated) == (offset, emulated)


def test_event_layout_rejects_implicit_padding():
    consts, dts = layout.parse("#define N 2\nstruct ok { u64 a; u32 b[N]; };\n")
    assert dts["ok"].itemsize == 16
    with pytest.raises(ValueError):
        layout.parse("struct bad { u32 a; u64 b; };\n")


def test_barrier_call_sites_in_the_graph_loop(llama_build):
    """The op-end probe sits on the graph loop's calls of ggml_barrier (through the PLT),
    not on ggml_barrier itself, which exported MUL_MAT also calls."""
    from profinfer.core.target.arch.callsites import call_sites
    cpu = lib(llama_build, "libggml-cpu")
    sites = call_sites(cpu, r"^ggml_graph_compute(_thread)?[._]", "ggml_barrier")
    assert sites and all(name.startswith("ggml_graph_compute") for name, _ in sites)
    everywhere = call_sites(cpu, r".", "ggml_barrier")
    assert any(name == "ggml_compute_forward_mul_mat" for name, _ in everywhere)
    for name, off in sites:
        code = cpu.code_bytes(cpu.find(name), off + 5)[off:]
        assert code[0] == 0xE8      # call rel32: emulated by the kernel, no single-step
