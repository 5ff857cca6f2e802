"""ELF symbol tables: .symtab, .dynsym (versioned) and separate debug info found by build-id.

Uprobes are placed by file offset, so every symbol is returned with the file offset of its
first byte, computed from the PT_LOAD segment that holds it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from elftools.common.exceptions import ELFError
from elftools.elf.elffile import ELFFile
from elftools.elf.sections import SymbolTableSection

from .errors import ProfinferError

DEBUG_DIRS = ("/usr/lib/debug",)


@dataclass(frozen=True, slots=True)
class Symbol:
    name: str
    vaddr: int
    size: int
    file_offset: int


@dataclass
class ElfInfo:
    path: str
    build_id: str
    symbols: dict[str, Symbol]
    has_symtab: bool          # False: stripped (only .dynsym)
    debug_file: str | None    # separate debug info used, if any
    dwarf_path: str | None    # file that holds .debug_info, if any

    def find(self, name: str) -> Symbol | None:
        return self.symbols.get(name)

    def code_bytes(self, sym: Symbol, n: int) -> bytes:
        with open(self.path, "rb") as f:
            f.seek(sym.file_offset)
            return f.read(min(n, sym.size) if sym.size else n)


def _build_id(elf: ELFFile) -> str:
    for sec in elf.iter_sections():
        if sec.header.sh_type == "SHT_NOTE":
            for note in sec.iter_notes():
                if note["n_type"] == "NT_GNU_BUILD_ID":
                    return note["n_desc"]
    return ""


def _vaddr_to_offset(elf: ELFFile, vaddr: int) -> int | None:
    for seg in elf.iter_segments():
        h = seg.header
        if h.p_type == "PT_LOAD" and h.p_vaddr <= vaddr < h.p_vaddr + h.p_filesz:
            return vaddr - h.p_vaddr + h.p_offset
    return None


def _read_symbols(elf: ELFFile, into: dict[str, Symbol], offsets_from: ELFFile) -> bool:
    found_symtab = False
    for sec in elf.iter_sections():
        if not isinstance(sec, SymbolTableSection):
            continue
        found_symtab |= sec.name == ".symtab"
        for s in sec.iter_symbols():
            if s["st_info"]["type"] not in ("STT_FUNC", "STT_GNU_IFUNC") or not s["st_value"]:
                continue
            if s["st_shndx"] == "SHN_UNDEF":
                continue
            # .dynsym names may carry a version suffix in some toolchains' output ("f@@V1").
            name = s.name.split("@", 1)[0]
            if name in into:
                continue
            off = _vaddr_to_offset(offsets_from, s["st_value"])
            if off is not None:
                into[name] = Symbol(name, s["st_value"], s["st_size"], off)
    return found_symtab


def _debug_file_for(build_id: str, root: str) -> str | None:
    if len(build_id) < 3:
        return None
    for d in DEBUG_DIRS:
        for base in (root.rstrip("/") + d, d):
            p = os.path.join(base, ".build-id", build_id[:2], build_id[2:] + ".debug")
            if os.path.exists(p):
                return p
    return None


@lru_cache(maxsize=64)
def load_elf(path: str, root: str = "/") -> ElfInfo:
    """Read the symbols of one ELF file. `root` is the target's root (/proc/PID/root) for debug files."""
    try:
        f = open(path, "rb")
    except OSError as e:
        raise ProfinferError(f"cannot read {path}: {e.strerror}") from None
    with f:
        try:
            elf = ELFFile(f)
            symbols: dict[str, Symbol] = {}
            has_symtab = _read_symbols(elf, symbols, elf)
            bid = _build_id(elf)
            dwarf_path = path if elf.get_section_by_name(".debug_info") else None
            debug_file = None
            if not has_symtab or dwarf_path is None:
                debug_file = _debug_file_for(bid, root)
                if debug_file:
                    with open(debug_file, "rb") as df:
                        delf = ELFFile(df)
                        has_symtab |= _read_symbols(delf, symbols, elf)
                        if delf.get_section_by_name(".debug_info"):
                            dwarf_path = debug_file
        except (ELFError, ValueError) as e:
            raise ProfinferError(f"{path} is not a readable ELF file: {e}") from None
    return ElfInfo(path, bid, symbols, has_symtab, debug_file, dwarf_path)
