"""ELF symbol tables: .symtab, .dynsym (versioned) and separate debug info found by build-id.

Uprobes are placed by file offset, so every symbol is returned with the file offset of its
first byte, computed from the PT_LOAD segment that holds it.
"""
from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass, replace

import numpy as np
from elftools.common.exceptions import ELFError
from elftools.elf.elffile import ELFFile

from . import procfs
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

    needed: tuple[str, ...] = ()   # DT_NEEDED: the shared libraries it links

    def find(self, name: str) -> Symbol | None:
        return self.symbols.get(name)

    def needs(self, prefix: str) -> bool:
        return any(n.startswith(prefix) for n in self.needed)

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


# Elf64_Sym, parsed in bulk: a C++ library has tens of thousands of symbols, and decoding
# them one by one through pyelftools takes seconds.
SYM64 = np.dtype([("name", "<u4"), ("info", "u1"), ("other", "u1"), ("shndx", "<u2"),
                   ("value", "<u8"), ("size", "<u8")])
_STT_FUNC, _STT_GNU_IFUNC = 2, 10


def _read_symbols(elf: ELFFile, into: dict[str, Symbol], offsets_from: ELFFile) -> bool:
    found_symtab = False
    loads = [(h.p_vaddr, h.p_vaddr + h.p_filesz, h.p_offset) for h in
             (seg.header for seg in offsets_from.iter_segments()) if h.p_type == "PT_LOAD"]
    for sec in elf.iter_sections():
        if sec.header.sh_type not in ("SHT_SYMTAB", "SHT_DYNSYM") or sec.header.sh_type == "SHT_NOBITS":
            continue
        found_symtab |= sec.name == ".symtab"
        strtab = elf.get_section(sec.header.sh_link).data()
        syms = np.frombuffer(sec.data(), SYM64)
        kind = syms["info"] & 0xF
        syms = syms[((kind == _STT_FUNC) | (kind == _STT_GNU_IFUNC)) & (syms["value"] != 0)
                    & (syms["shndx"] != 0)]
        for name_off, value, size in zip(syms["name"].tolist(), syms["value"].tolist(),
                                         syms["size"].tolist()):
            end = strtab.find(b"\0", name_off)
            # .dynsym names may carry a version suffix in some toolchains' output ("f@@V1").
            name = strtab[name_off:end].split(b"@", 1)[0].decode("utf-8", "replace")
            if name in into:
                continue
            for lo, hi, off in loads:
                if lo <= value < hi:
                    into[name] = Symbol(name, value, size, value - lo + off)
                    break
    return found_symtab


def _debug_file_for(build_id: str, root: str) -> str | None:
    if len(build_id) < 3:
        return None
    for d in DEBUG_DIRS:
        for base in (root.rstrip("/") + d, d):
            p = os.path.join(base, ".build-id", build_id[:2], build_id[2:] + ".debug")
            try:
                procfs.stat_file(p)      # inside a target's root, what it names there
                return p
            except OSError:
                pass
    return None


_ELF_CACHE: OrderedDict = OrderedDict()
_ELF_CACHE_SIZE = 64
_ELF_KEYS: dict[tuple[str, str], tuple] = {}     # (path, root) -> the identity it had


def load_elf(path: str, root: str = "/") -> ElfInfo:
    """Read the symbols of one ELF file. `root` is the target's root (/proc/PID/root) for debug
    files. Remembered by file identity, not path: one library reached through many processes'
    /proc/PID/root (a daemon's) is read once."""
    given = (path, root)
    try:
        st = procfs.stat_file(path)
        if root != "/" and os.path.samestat(os.stat(root), os.stat("/")):
            root = "/"
        key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, root)
    except OSError as e:
        # a path read before, through a process that has exited since: what it held then
        key = _ELF_KEYS.get(given)
        if key not in _ELF_CACHE:
            raise ProfinferError(f"cannot read {path}: {e.strerror}") from None
    info = _ELF_CACHE.get(key)
    if info is None:
        info = _ELF_CACHE[key] = _read_elf(path, root)
        if len(_ELF_CACHE) > _ELF_CACHE_SIZE:
            _ELF_CACHE.popitem(last=False)
    else:
        _ELF_CACHE.move_to_end(key)
    _ELF_KEYS[given] = key
    if len(_ELF_KEYS) > 64 * _ELF_CACHE_SIZE:
        _ELF_KEYS.pop(next(iter(_ELF_KEYS)))
    if info.path != path:
        info = replace(info, path=path, dwarf_path=path if info.dwarf_path == info.path else info.dwarf_path)
    return info


def _read_elf(path: str, root: str) -> ElfInfo:
    try:
        f = procfs.open_binary(path)
    except OSError as e:
        raise ProfinferError(f"cannot read {path}: {e.strerror}") from None
    with f:
        try:
            elf = ELFFile(f)
            symbols: dict[str, Symbol] = {}
            has_symtab = _read_symbols(elf, symbols, elf)
            bid = _build_id(elf)
            dynamic = elf.get_section_by_name(".dynamic")
            needed = tuple(t.needed for t in dynamic.iter_tags() if t.entry.d_tag == "DT_NEEDED") \
                if dynamic is not None and hasattr(dynamic, "iter_tags") else ()
            dwarf_path = path if elf.get_section_by_name(".debug_info") else None
            debug_file = None
            if not has_symtab or dwarf_path is None:
                debug_file = _debug_file_for(bid, root)
                if debug_file:
                    with procfs.open_binary(debug_file) as df:
                        delf = ELFFile(df)
                        has_symtab |= _read_symbols(delf, symbols, elf)
                        if delf.get_section_by_name(".debug_info"):
                            dwarf_path = debug_file
        except (ELFError, ValueError) as e:
            raise ProfinferError(f"{path} is not a readable ELF file: {e}") from None
    return ElfInfo(path, bid, symbols, has_symtab, debug_file, dwarf_path, needed)
