"""What profinfer must know about ggml's data structures, taken from the target binary.

- Op names come from the binary's own GGML_OP_NAME table (found through ggml_op_name), since
  the op enum is renumbered between versions.
- ggml_tensor field offsets come from DWARF when the build has it, otherwise from a table of
  known layouts that the collector validates on live data before trusting it.
- ggml_type numbers are part of the GGUF file format and never change, so they are a table.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import capstone
from elftools.elf.elffile import ELFFile
from elftools.elf.relocation import RelocationSection

from . import dwarf
from .errors import ProfinferError
from .symbols import ElfInfo

# enum ggml_type (fixed by the GGUF format; removed types keep their numbers as gaps)
GGML_TYPES = {
    0: "f32", 1: "f16", 2: "q4_0", 3: "q4_1", 6: "q5_0", 7: "q5_1", 8: "q8_0", 9: "q8_1",
    10: "q2_k", 11: "q3_k", 12: "q4_k", 13: "q5_k", 14: "q6_k", 15: "q8_k", 16: "iq2_xxs",
    17: "iq2_xs", 18: "iq3_xxs", 19: "iq1_s", 20: "iq4_nl", 21: "iq3_s", 22: "iq2_s",
    23: "iq4_xs", 24: "i8", 25: "i16", 26: "i32", 27: "i64", 28: "f64", 29: "iq1_m",
    30: "bf16", 34: "tq1_0", 35: "tq2_0", 39: "mxfp4",
}


@dataclass(frozen=True)
class TensorLayout:
    name: str
    type: int
    ne: int
    op: int
    src: int
    name_off: int
    view_src: int
    data: int
    name_len: int = 64

    @property
    def nb(self) -> int:
        return self.ne + 32      # int64_t ne[4] is followed by size_t nb[4] in every version


# Known ggml_tensor layouts, newest first. Used only when the binary has no DWARF, and then
# only after the live data looks right (see plausible()).
KNOWN_LAYOUTS = [
    # Sept 2024 on (grad fields removed): type, buffer, ne, nb, op, op_params[16], flags, src[10]...
    # ... view_src (the root tensor a view looks into), view_offs, data, name.
    TensorLayout("ggml-2024.09", type=0, ne=16, op=80, src=152, name_off=256, view_src=232,
                 data=248),
    # Before: a grad pointer after flags (and the backend field before buffer in older ones).
    TensorLayout("ggml-2024.06", type=0, ne=16, op=80, src=160, name_off=264, view_src=240,
                 data=256),
]


def layout_by_name(name: str) -> TensorLayout:
    for lay in KNOWN_LAYOUTS:
        if lay.name == name:
            return lay
    raise ProfinferError(f"unknown tensor layout {name!r}; known: "
                         + ", ".join(l.name for l in KNOWN_LAYOUTS))


def tensor_layout_from_dwarf(path: str, build_id: str) -> TensorLayout | None:
    """struct ggml_tensor member offsets from the file's DWARF."""
    found = dwarf.struct_layout(path, build_id, "ggml_tensor")
    if not found:
        return None
    m = found["members"]
    try:
        return TensorLayout("dwarf", type=m["type"], ne=m["ne"], op=m["op"], src=m["src"],
                            name_off=m["name"], view_src=m["view_src"], data=m["data"])
    except KeyError:
        return None


_NAME_RE = re.compile(r"^[A-Z][A-Z0-9_]*$")


def op_names(base: ElfInfo) -> list[str]:
    """The GGML_OP_NAME table of this build, read from the file (relocations applied).

    The table is static, so it is located through ggml_op_name(), which is exported and
    indexes it with a RIP-relative lea.
    """
    table = _op_table_vaddr(base)
    with open(base.path, "rb") as f:
        elf = ELFFile(f)
        relocs = {}
        for sec in elf.iter_sections():
            if isinstance(sec, RelocationSection) and sec.is_RELA():
                for r in sec.iter_relocations():
                    relocs[r["r_offset"]] = r["r_addend"]
        names = []
        for i in range(1024):
            target = relocs.get(table + 8 * i)
            if target is None:
                break
            s = _read_cstr(elf, f, target)
            if not s or not _NAME_RE.match(s):
                break
            names.append(s)
    if len(names) < 10 or names[0] != "NONE":
        raise ProfinferError(f"cannot read the op-name table of {base.path}")
    return names


def _op_table_vaddr(base: ElfInfo) -> int:
    fn = base.find("ggml_op_name")
    if fn is None:
        raise ProfinferError(f"{base.path} has neither GGML_OP_NAME nor ggml_op_name")
    md = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
    md.detail = True
    for insn in md.disasm(base.code_bytes(fn, 64), fn.vaddr):
        if insn.mnemonic == "lea" and "rip" in insn.op_str:
            disp = insn.operands[1].mem.disp
            return insn.address + insn.size + disp
        if insn.mnemonic == "ret":
            break
    raise ProfinferError(f"cannot locate the op-name table in {base.path}")


def _read_cstr(elf: ELFFile, f, vaddr: int) -> str:
    for seg in elf.iter_segments():
        h = seg.header
        if h.p_type == "PT_LOAD" and h.p_vaddr <= vaddr < h.p_vaddr + h.p_filesz:
            f.seek(vaddr - h.p_vaddr + h.p_offset)
            raw = f.read(64)
            return raw.split(b"\0", 1)[0].decode("ascii", "replace")
    return ""


def plausible(op: int, dtype: int, ne, name: bytes, n_ops: int) -> bool:
    """Does one op event decoded with a candidate layout look like a real ggml node?"""
    if not (0 < op < n_ops) or dtype not in GGML_TYPES:
        return False
    if any(not (1 <= int(n) < (1 << 40)) for n in ne):
        return False
    # llama.cpp names every node it computes ("Qcur-0", "ffn_out-3"): an empty name means
    # the name field is not where this layout says.
    text = name.split(b"\0", 1)[0]
    return bool(text) and all(32 <= c < 127 for c in text)
