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

from profinfer.core.target import parsing, procfs
from profinfer.core.target.elfheaders import elf_file
from profinfer.core.base.errors import ProfinferError

parsing.preload(__name__)

DEBUG_DIRS = ("/usr/lib/debug",)
# What is read of a file a tenant may have made: a symbol table's or string table's section
# header can claim any size (a sparse 50 GB file reads as zeros), a symbol any length.
MAX_TABLE_BYTES = 64 << 20     # a .symtab/.dynsym (2.8 M symbols) or its string table
MAX_CODE_BYTES = 1 << 20       # one function's code read to place or find calls
# What a reading keeps (and sends the daemon): function symbols of one file, and a name's
# length. Measured: libtorch_python 34k functions (longest name 973), vLLM's _C 19k,
# libllama 6k, libcudart 0.4k; a name without its NUL (a string table's end) is dropped.
MAX_SYMBOLS = 150_000
MAX_NAME_BYTES = 4096


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
    file_id: tuple[int, int] = (0, 0)   # (device, inode) of the file read

    def find(self, name: str) -> Symbol | None:
        return self.symbols.get(name)

    def needs(self, prefix: str) -> bool:
        return any(n.startswith(prefix) for n in self.needed)

    def code_bytes(self, sym: Symbol, n: int) -> bytes:
        with open_checked(self.path, self.file_id) as f:
            f.seek(sym.file_offset)
            return f.read(min(n, sym.size or n, MAX_CODE_BYTES))


def open_checked(path: str, file_id: tuple[int, int]):
    """The file (device, inode) `file_id` that `path` named when its symbols were read
    (procfs: inside the target's root, a regular file), as a binary file object;
    ProfinferError when the path names another by now."""
    try:
        f = procfs.open_binary(path)
    except OSError as e:
        raise ProfinferError(f"cannot read {path}: {e.strerror}") from None
    st = os.fstat(f.fileno())
    if file_id != (0, 0) and (st.st_dev, st.st_ino) != file_id:
        f.close()
        raise ProfinferError(f"{path} was replaced since its symbols were read: not used")
    return f


def _build_id(elf: ELFFile) -> str:
    for sec in elf.iter_sections():
        if sec.header.sh_type == "SHT_NOTE" and sec.header.sh_size <= 1 << 16:
            for note in sec.iter_notes():
                if note["n_type"] == "NT_GNU_BUILD_ID":
                    return note["n_desc"]
    return ""


# Elf64_Sym, parsed in bulk: a C++ library has tens of thousands of symbols, and decoding
# them one by one through pyelftools takes seconds.
SYM64 = np.dtype([("name", "<u4"), ("info", "u1"), ("other", "u1"), ("shndx", "<u2"),
                   ("value", "<u8"), ("size", "<u8")])
_STT_FUNC, _STT_GNU_IFUNC = 2, 10


def _data(sec, what: str) -> bytes:
    if sec.header.sh_size > MAX_TABLE_BYTES:
        raise ProfinferError(f"{what} of {sec.header.sh_size >> 20} MiB: over the "
                             f"{MAX_TABLE_BYTES >> 20} MiB read")
    return sec.data()


def _read_symbols(elf: ELFFile, into: dict[str, Symbol], offsets_from: ELFFile) -> bool:
    found_symtab = False
    loads = [(h.p_vaddr, h.p_vaddr + h.p_filesz, h.p_offset) for h in
             (seg.header for seg in offsets_from.iter_segments()) if h.p_type == "PT_LOAD"]
    for sec in elf.iter_sections():
        if sec.header.sh_type not in ("SHT_SYMTAB", "SHT_DYNSYM") or sec.header.sh_type == "SHT_NOBITS":
            continue
        found_symtab |= sec.name == ".symtab"
        strtab = _data(elf.get_section(sec.header.sh_link), "a string table")
        syms = np.frombuffer(_data(sec, "a symbol table"), SYM64)
        kind = syms["info"] & 0xF
        syms = syms[((kind == _STT_FUNC) | (kind == _STT_GNU_IFUNC)) & (syms["value"] != 0)
                    & (syms["shndx"] != 0)]
        for name_off, value, size in zip(syms["name"].tolist(), syms["value"].tolist(),
                                         syms["size"].tolist()):
            end = strtab.find(b"\0", name_off, name_off + MAX_NAME_BYTES)
            if end < 0:
                continue
            # .dynsym names may carry a version suffix in some toolchains' output ("f@@V1").
            name = strtab[name_off:end].split(b"@", 1)[0].decode("utf-8", "replace")
            if name in into:
                continue
            for lo, hi, off in loads:
                if lo <= value < hi:
                    into[name] = Symbol(name, value, size, value - lo + off)
                    break
            if len(into) >= MAX_SYMBOLS:
                raise ProfinferError(f"over {MAX_SYMBOLS} function symbols: not read")
    return found_symtab


def _open_debug_file(build_id: str, root: str):
    """The separate debug file for `build_id`, open (its path, a binary file object), or None.
    Looked for inside `root` only: for a target in a container, its own /usr/lib/debug, where
    the build-id link resolves inside its root (procfs); never the host's for its file."""
    if len(build_id) < 3:
        return None
    for d in DEBUG_DIRS:
        p = os.path.join(root.rstrip("/") + d, ".build-id", build_id[:2], build_id[2:] + ".debug")
        try:
            return p, procfs.open_binary(p)
        except OSError:
            pass
    return None


_ELF_CACHE: OrderedDict = OrderedDict()       # key -> (ElfInfo, its estimated bytes)
_ELF_CACHE_SIZE = 64
# what the cache may hold in all (live Python objects, ~ names + 200 bytes a symbol), well
# within the daemon's memory limit of 512 MiB (sizes in bench/results.md)
_ELF_CACHE_BYTES = 96 << 20
_elf_cache_bytes = 0
_ELF_KEYS: dict[tuple[str, str], tuple] = {}     # (path, root) -> the identity it had


def _weight(info: ElfInfo) -> int:
    return sum(map(len, info.symbols)) + 200 * len(info.symbols)


def load_elf(path: str, root: str = "/") -> ElfInfo:
    """Read the symbols of one ELF file. `root` is the target's root (/proc/PID/root) for debug
    files (for a path reached through a process, its root whatever is given). Remembered by
    file identity, not path: one library reached through many processes' /proc/PID/root (a
    daemon's) is read once."""
    global _elf_cache_bytes
    given = (path, root)
    root = procfs.root_of(path) or root
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
    cached = _ELF_CACHE.get(key)
    if cached is None:
        # a tenant's file: read away from the daemon's loop, with a deadline (parsing.py)
        info = parsing.run(("elf", key), __name__, "_read_elf", path, root)
        if key[:2] != info.file_id:
            raise ProfinferError(f"{path} was replaced while it was read: looked at again later")
        _ELF_CACHE[key] = (info, _weight(info))
        _elf_cache_bytes += _ELF_CACHE[key][1]
        while len(_ELF_CACHE) > 1 and (len(_ELF_CACHE) > _ELF_CACHE_SIZE or _elf_cache_bytes > _ELF_CACHE_BYTES):
            _elf_cache_bytes -= _ELF_CACHE.popitem(last=False)[1][1]
    else:
        info = cached[0]
        _ELF_CACHE.move_to_end(key)
    _ELF_KEYS[given] = key
    procfs.read_as(path, key[:2])      # what a probe on this path must land in
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
        st = os.fstat(f.fileno())
        try:
            elf = elf_file(f)
            symbols: dict[str, Symbol] = {}
            has_symtab = _read_symbols(elf, symbols, elf)
            bid = _build_id(elf)
            dynamic = elf.get_section_by_name(".dynamic")
            needed = tuple(t.needed for t in dynamic.iter_tags() if t.entry.d_tag == "DT_NEEDED") \
                if dynamic is not None and hasattr(dynamic, "iter_tags") else ()
            dwarf_path = path if elf.get_section_by_name(".debug_info") else None
            debug_file = None
            if not has_symtab or dwarf_path is None:
                found = _open_debug_file(bid, root)
                if found:
                    debug_file, df = found
                    with df:
                        delf = elf_file(df)
                        has_symtab |= _read_symbols(delf, symbols, elf)
                        if delf.get_section_by_name(".debug_info"):
                            dwarf_path = debug_file
        except (ELFError, ValueError) as e:
            raise ProfinferError(f"{path} is not a readable ELF file: {e}") from None
    return ElfInfo(path, bid, symbols, has_symtab, debug_file, dwarf_path, needed,
                   (st.st_dev, st.st_ino))
