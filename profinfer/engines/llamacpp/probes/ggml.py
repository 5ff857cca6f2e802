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
import gguf
import numpy as np
from elftools.elf.elffile import ELFFile
from elftools.elf.relocation import RelocationSection

from profinfer.core.target import dwarf, parsing
from profinfer.core.target.elfheaders import elf_file
from profinfer.core.base.errors import ProfinferError
from profinfer.core.target.symbols import ElfInfo, open_checked

parsing.preload(__name__)      # its readings run in the parse worker: imported there before it is confined

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

    @property
    def view_offs(self) -> int:
        return self.view_src + 8   # size_t view_offs follows view_src in every version


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


_LAYOUT_FIELDS = {"type": 4, "ne": 64, "op": 4, "src": 24, "view_src": 16, "data": 8, "name": 64}
# the BPF object reads a tensor's fields from its first PI_TENSOR_WINDOW bytes (llamacpp.h)
_WINDOW = 512


def layout_by_name(name: str) -> TensorLayout:
    """A known layout by name, or one spelled out as offsets (`type=0,ne=16,op=80,src=152,
    view_src=232,data=248,name=256`, e.g. from `pahole -C ggml_tensor` on a debug build of
    the same version); either is validated on live data before it is trusted."""
    for lay in KNOWN_LAYOUTS:
        if lay.name == name:
            return lay
    if "=" not in name:
        raise ProfinferError(f"unknown tensor layout {name!r}; known: "
                             + ", ".join(l.name for l in KNOWN_LAYOUTS)
                             + ", or offsets: " + ",".join(f"{f}=N" for f in _LAYOUT_FIELDS))
    offsets: dict[str, int] = {}
    for part in name.split(","):
        field, _, value = part.partition("=")
        field = field.strip()
        if field not in _LAYOUT_FIELDS or field in offsets or not value.strip().isdigit():
            raise ProfinferError(f"tensor layout {name!r}: give each of "
                                 + ", ".join(_LAYOUT_FIELDS) + " once, as FIELD=OFFSET")
        offsets[field] = int(value)
    missing = [f for f in _LAYOUT_FIELDS if f not in offsets]
    if missing:
        raise ProfinferError(f"tensor layout {name!r}: no offset for {', '.join(missing)}")
    for field, off in offsets.items():
        if off % (4 if field in ("type", "op") else 8 if field != "name" else 1) or \
                off + _LAYOUT_FIELDS[field] > _WINDOW:
            raise ProfinferError(f"tensor layout {name!r}: {field}={off} is misaligned or "
                                 f"beyond the first {_WINDOW} bytes profinfer reads")
    return TensorLayout(name, type=offsets["type"], ne=offsets["ne"], op=offsets["op"],
                        src=offsets["src"], name_off=offsets["name"],
                        view_src=offsets["view_src"], data=offsets["data"])


def tensor_layout_from_dwarf(path: str) -> TensorLayout | None:
    """struct ggml_tensor member offsets from the file's DWARF."""
    found = dwarf.struct_layout(path, "ggml_tensor")
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
    # every relocation of a file a tenant may have made: read away from the daemon's loop
    names = parsing.run(("op_names", base.file_id, table), __name__, "_read_op_names", base.path,
                        base.file_id, table)
    if len(names) < 10 or names[0] != "NONE":
        raise ProfinferError(f"cannot read the op-name table of {base.path}")
    return names


def _read_op_names(path: str, file_id: tuple[int, int], table: int) -> list[str]:
    with open_checked(path, file_id) as f:       # the file the symbols came from
        elf = elf_file(f)
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


# (elements per block, bytes per block) of each type: nb[0] is the block's bytes
TYPE_SIZES = {int(t): size for t, size in gguf.GGML_QUANT_SIZES.items()}
_MAX_NE = 1 << 40
_I32 = 26
# ops whose result has the shape of their first source (ggml_dup_tensor(a) or a view of it)
_SHAPE_OF_SRC0 = {"ADD", "SUB", "MUL", "DIV", "SQR", "SQRT", "SCALE", "CLAMP", "NORM", "RMS_NORM",
                  "SOFT_MAX", "ROPE", "UNARY"}
# ops whose result is a view with permuted strides (nb[0] is then not the element size)
_PERMUTING = {"PERMUTE", "TRANSPOSE"}


def _shape_ok(ne) -> bool:
    return all(1 <= int(n) < _MAX_NE for n in ne)


def _nb_ok(desc, chk, op: str) -> bool:
    """Strides fit the type and shape: nb[0] is the type's (block) size, and a tensor that is
    not a view is contiguous (ggml_new_tensor's strides, exactly)."""
    size = TYPE_SIZES.get(int(desc["type"]))
    if size is None:
        return False
    block, nbytes = size
    nb, ne = [int(x) for x in chk["nb"]], [int(x) for x in desc["ne"]]
    if not all(0 < x < (1 << 48) for x in nb):
        return False
    if nb[0] != nbytes and op not in _PERMUTING:
        return False
    if int(chk["view_src"]):
        return True
    return (ne[0] % block == 0 and nb[1] == nbytes * ne[0] // block
            and nb[2] == nb[1] * ne[1] and nb[3] == nb[2] * ne[2])


def _sources(desc, chk):
    """(address, type, ne) of each of the three sources a description holds."""
    return [(int(desc["src"][0]), int(desc["src0_type"]), desc["src0_ne"]),
            (int(desc["src"][1]), int(desc["src1_type"]), desc["src1_ne"]),
            (int(desc["src"][2]), int(chk["src2_type"]), chk["src2_ne"])]


def _src_ok(desc, chk, op: str) -> bool:
    """Sources read as the inputs the op takes: a first source, each one a tensor (known type,
    sane shape) other than the node, and the shapes the op's result follows from."""
    srcs = _sources(desc, chk)
    if not srcs[0][0]:
        return False
    for addr, dtype, ne in srcs:
        if addr and (addr == int(desc["tensor"]) or dtype not in GGML_TYPES or not _shape_ok(ne)):
            return False
    ne = [int(x) for x in desc["ne"]]
    (_, _, ne0), (a1, t1, ne1), (a2, t2, _) = srcs
    if op == "MUL_MAT":
        return bool(a1) and ne0[0] == ne1[0] and ne[0] == ne0[1] and ne[1] == ne1[1]
    if op == "MUL_MAT_ID":      # src[2]: the expert ids the MoE reads take
        return bool(a1) and bool(a2) and t2 == _I32
    if op == "GET_ROWS":
        return bool(a1) and t1 == _I32 and ne[0] == ne0[0] and ne[1] == ne1[0]
    if op in _SHAPE_OF_SRC0:
        return ne == [int(x) for x in ne0]
    return True


def _view_src_ok(desc, chk, root_data: dict[int, int]) -> bool:
    """Each source's view_src is 0 (then its view_offs is 0) or a root tensor (its own
    view_src 0) whose data plus the view's view_offs is the view's data; the node's too,
    where its root's data was seen."""
    for k, (addr, dtype, _) in enumerate(_sources(desc, chk)):
        if not addr or dtype == -1:
            continue
        root, offs, data = int(desc["src_view"][k]), int(chk["src_view_offs"][k]), int(chk["src_data"][k])
        if not root:
            if offs:
                return False
        elif (root == addr or int(chk["root_type"][k]) not in GGML_TYPES
              or int(chk["root_view_src"][k]) or data != int(chk["root_data"][k]) + offs):
            return False
    root, offs = int(chk["view_src"]), int(chk["view_offs"])
    if not root:
        return not offs
    return root not in root_data or int(chk["data"]) == root_data[root] + offs


def _data_ok(desc, chk) -> bool:
    """A computed node has data, and so has each source it reads."""
    return bool(int(chk["data"])) and all(
        int(chk["src_data"][k]) for k, (addr, dtype, _) in enumerate(_sources(desc, chk))
        if addr and dtype != -1)


def layout_faults(nodes: np.ndarray, op_names: list[str]) -> list[tuple[str, int, int]]:
    """Check a table layout on pi_node_event records BPF read with it: [(what is wrong,
    nodes it is wrong in, nodes checked)] for each field group some nodes fail.

    Op, type, shape and name must look like a ggml node (plausible()); where BPF filled the
    check fields (pi_node_check), so must the fields the DAG and the MoE reads use: the
    sources, views (view_src, view_offs), data and strides (nb)."""
    n_ops = len(op_names)
    faults = []
    bad = sum(not plausible(int(e["desc"]["op"]), int(e["desc"]["type"]), e["desc"]["ne"],
                            bytes(e["desc"]["name"]), n_ops) for e in nodes)
    if bad:
        faults.append(("op, type, ne or name decode as garbage", bad, len(nodes)))
    checked = [e for e in nodes if e["check"]["checked"]]
    # data of the tensors a view may look into: described nodes, and roots read as such
    root_data = {int(e["desc"]["tensor"]): int(e["check"]["data"]) for e in checked}
    for e in checked:
        for k in range(3):
            if int(e["check"]["root_type"][k]) != -1:
                root_data.setdefault(int(e["desc"]["src_view"][k]), int(e["check"]["root_data"][k]))

    def op_of(e) -> str:
        op = int(e["desc"]["op"])
        return op_names[op] if 0 <= op < n_ops else ""

    for what, ok in (
            ("sources (src) are missing, unreadable, or not what the op takes",
             lambda e: _src_ok(e["desc"], e["check"], op_of(e))),
            ("views (view_src, view_offs) do not point at the tensor that holds their data",
             lambda e: _view_src_ok(e["desc"], e["check"], root_data)),
            ("data is null", lambda e: _data_ok(e["desc"], e["check"])),
            ("strides (nb) do not fit the type and shape",
             lambda e: _nb_ok(e["desc"], e["check"], op_of(e)))):
        bad = sum(not ok(e) for e in checked)
        if bad:
            faults.append((what, bad, len(checked)))
    return faults
