"""Kernel names for the CUDA level.

A launch passes its kernel as nvcc's host stub (CUDA 12: cudaLaunchKernel's `func`), as a
`cudaKernel_t` handle the stub got once from `__cudaGetKernel(&handle, hostFn)` (CUDA 13:
the stub's `__cudaLaunchKernel` goes on to cudaLaunchKernel with it), or as a driver
`CUfunction` from `cuModuleGetFunction(&f, module, name)`. The stub carries the kernel's
mangled name in the ELF symbols of the module that holds it, so a process that registered
its kernels long before profinfer attached still has them named: its stubs by address
(through its mappings and their load bias), and its CUDA 13 handles from each stub's static
`__handle`, read from its memory. What the registration calls show when they are seen fills
in the rest. A kernel that cannot be named is `kernel@<file>+0x<offset>` (an address in a
mapped file) or `CUfunction@0x<handle>`, never dropped.
"""
from __future__ import annotations

import bisect
import functools
import os
import re
from collections import deque
from dataclasses import dataclass, field

import cxxfilt
import numpy as np
from elftools.common.exceptions import ELFError

from profinfer.core.target import parsing, procfs
from profinfer.core.target.elfheaders import elf_file
from profinfer.core.base.errors import ProfinferError
from profinfer.core.target.parsing import NotReady
from profinfer.core.target.symbols import MAX_NAME_BYTES, MAX_SYMBOLS, MAX_TABLE_BYTES, SYM64, ElfInfo, load_elf

parsing.preload(__name__)      # its readings run in the parse worker: imported there before it is confined

_HANDLE_STATIC = re.compile(r"^_ZZ(L?)(\d+)__device_stub__(\w+)E8__handle$")
_STT_OBJECT = 1


def demangle(symbol: str) -> str:
    try:
        return cxxfilt.demangle(symbol)
    except cxxfilt.InvalidName:
        return symbol


@dataclass
class Mapping:
    start: int
    end: int
    offset: int
    path: str        # as the process sees it
    host_path: str   # where profinfer opens it


def executable_mappings(pid: int) -> list[Mapping]:
    """The process's executable file mappings, with their file offsets."""
    return [Mapping(m.start, m.end, m.offset, m.path, f"/proc/{pid}/root{m.path}")
            for m in procfs.file_mappings(pid) if "x" in m.perms]


_SORTED: dict[tuple[str, str], tuple[list[int], list]] = {}


def _sorted_functions(elf: ElfInfo) -> tuple[list[int], list]:
    key = (elf.path, elf.build_id)
    if key not in _SORTED:
        syms = sorted(elf.symbols.values(), key=lambda s: s.file_offset)
        _SORTED[key] = ([s.file_offset for s in syms], syms)
    return _SORTED[key]


def symbol_at(elf: ElfInfo, file_offset: int) -> tuple[str, int] | None:
    """The function symbol holding `file_offset`, and the offset into it."""
    offsets, syms = _sorted_functions(elf)
    i = bisect.bisect_right(offsets, file_offset) - 1
    if i < 0:
        return None
    s = syms[i]
    if file_offset >= s.file_offset + max(s.size, 1):
        return None
    return s.name, file_offset - s.file_offset


def load_segments(path: str) -> list[tuple[int, int, int]]:
    """(file offset, file size, vaddr) of the file's PT_LOAD segments (read in the parse
    worker: a tenant's file)."""
    with procfs.open_binary(path) as f:
        return [(s.header.p_offset, s.header.p_filesz, s.header.p_vaddr)
                for s in elf_file(f).iter_segments() if s.header.p_type == "PT_LOAD"]


def _load_bias(path: str, maps: list[Mapping]) -> int | None:
    """Where the file's virtual addresses are in the process (its load bias); ProfinferError
    while its headers are read (NotReady) or once they could not be."""
    loads = parsing.run(("load_segments", path), __name__, "load_segments", path)
    for m in maps:
        for offset, size, vaddr in loads:
            if offset <= m.offset < offset + max(size, 1):
                return m.start - m.offset + offset - vaddr
    return None


def handle_statics(path: str) -> list[tuple[int, str]]:
    """CUDA 13 stubs' static `__handle` variables in the file's .symtab: (vaddr, the kernel's
    host stub symbol)."""
    try:
        with procfs.open_binary(path) as f:
            elf = elf_file(f)
            sec = elf.get_section_by_name(".symtab")
            if sec is None:
                return []
            strtab = elf.get_section(sec.header.sh_link)
            if max(sec.header.sh_size, strtab.header.sh_size) > MAX_TABLE_BYTES:
                return []
            strtab = strtab.data()
            syms = np.frombuffer(sec.data(), SYM64)
            syms = syms[((syms["info"] & 0xF) == _STT_OBJECT) & (syms["value"] != 0)]
            out = []
            for name_off, value in zip(syms["name"].tolist(), syms["value"].tolist()):
                end = strtab.find(b"\0", name_off, name_off + MAX_NAME_BYTES)
                if end < 0:                # no NUL within a name's length: not a name
                    continue
                name = strtab[name_off:end].decode("utf-8", "replace")
                m = _HANDLE_STATIC.match(name)
                if m:
                    out.append((value, "_" + m.group(3)))
                    if len(out) >= MAX_SYMBOLS:       # what the daemon keeps: bounded
                        break
            return out
    except (OSError, ELFError, ValueError):
        return []


_NEEDS_CUDART: dict[str, bool] = {}


def forget_process(pid: int) -> None:
    """What was read through a process's /proc/PID/root paths goes with the process (a daemon
    sees thousands come and go; the next one with this pid is another process)."""
    prefix = f"/proc/{pid}/"
    for key in [k for k in _SORTED if k[0].startswith(prefix)]:
        del _SORTED[key]
    for key in [k for k in _NEEDS_CUDART if k.startswith(prefix)]:
        del _NEEDS_CUDART[key]


def cache_sizes() -> dict[str, int]:
    return {"kernel_symbol_tables": len(_SORTED), "cudart_links": len(_NEEDS_CUDART)}


def links_cudart(path: str) -> bool:
    """Whether a shared object links libcudart dynamically (its DT_NEEDED), read from its
    dynamic section alone (in the parse worker: a tenant's file)."""
    try:
        with procfs.open_binary(path) as f:       # inside the target's root
            dyn = elf_file(f).get_section_by_name(".dynamic")
            if not dyn or dyn.header.sh_size > MAX_TABLE_BYTES:
                return False
            return any(t.entry.d_tag == "DT_NEEDED" and t.needed.startswith("libcudart")
                       for t in dyn.iter_tags())
    except (OSError, ELFError, ValueError, AttributeError):
        return False


def needs_cudart(path: str) -> bool | None:
    """links_cudart, remembered per path; None while the worker reads it (asked again)."""
    if path not in _NEEDS_CUDART:
        try:
            _NEEDS_CUDART[path] = parsing.run(("links_cudart", path), __name__, "links_cudart", path)
        except NotReady:
            return None
        except ProfinferError:
            _NEEDS_CUDART[path] = False
    return _NEEDS_CUDART[path]


def _stub_kernel(elf: ElfInfo, stub_tail: str) -> str | None:
    """The kernel's host function whose mangled name begins the stub's: the stub of
    `_ZN2ns5scaleIfEEvPT_S1_i` is `__device_stub__ZN2ns5scaleIfEEvPT_S1_iPffi` (the kernel's
    name, then the stub's own parameters)."""
    best = None
    for name in elf.symbols:
        if stub_tail.startswith(name) and (best is None or len(name) > len(best)):
            best = name
    return best


def _as_its_tenant(method):
    """The method's readings of the process's files queued as its tenant's (a kernel named
    while the level's events are drained is asked outside any process's turn)."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with parsing.on_behalf_of_process(self.pid):
            return method(self, *args, **kwargs)
    return run


# A process's kernels named at most this many per table: a real one registers thousands
# (PyTorch's CUDA libraries: ~20k functions); a tenant's loop of registrations with distinct
# pointers would otherwise grow the agent without bound. Past it, new ones go unnamed.
MAX_NAMES = 1 << 16


@dataclass
class KernelNames:
    pid: int
    maps: list[Mapping] = field(default_factory=list)
    handles: dict[int, int] = field(default_factory=dict)      # cudaKernel_t -> host stub
    handle_names: dict[int, str] = field(default_factory=dict)  # handle -> mangled name (statics)
    functions: dict[int, str] = field(default_factory=dict)    # CUfunction -> name
    registered: dict[int, str] = field(default_factory=dict)   # host stub -> device name
    warnings: list[str] = field(default_factory=list)
    dropped: int = 0          # registrations past MAX_NAMES (or MAX_UNREAD waiting), left unnamed
    # registrations whose name is still to be read from memory: (name's address, host stub)
    unread: deque = field(default_factory=deque)
    unread_dropped: int = 0   # of them, past MAX_UNREAD waiting

    MAX_UNREAD = 4096         # waiting a process: past it, registrations are left unnamed

    def unread_later(self, name_addr: int, stub: int) -> None:
        if len(self.unread) >= self.MAX_UNREAD:
            if not self.unread_dropped:
                self.warnings.append(f"PID {self.pid} registered over {self.MAX_UNREAD} kernels whose names "
                                     "are still to be read: later ones are not named")
            self.dropped += 1
            self.unread_dropped += 1
            return
        self.unread.append((name_addr, stub))

    def read_one_unread(self) -> None:
        name_addr, stub = self.unread.popleft()
        name = self.read_string(name_addr)
        if name:
            self.put(self.registered, stub, name)

    def put(self, table: dict, key: int, value) -> None:
        """One name learned, where the table has room (a name known is replaced)."""
        if key in table or len(table) < MAX_NAMES:
            table[key] = value
            return
        if not self.dropped:
            self.warnings.append(f"PID {self.pid} registered over {MAX_NAMES} kernels of one kind: "
                                 "later ones are not named")
        self.dropped += 1

    def refresh(self) -> None:
        """Read the process's mappings again (a library loaded since); those of files it
        unmapped are kept, so that what it launched from them is still named."""
        current = executable_mappings(self.pid)
        if current:
            known = {(m.start, m.path) for m in current}
            self.maps = current + [m for m in self.maps if (m.start, m.path) not in known]
            self.maps.sort(key=lambda m: m.start)

    @_as_its_tenant
    def cuda_modules(self) -> list[str]:
        """The mapped files that link libcudart dynamically (an engine's CUDA library)."""
        seen = {}
        for m in self.maps:
            seen.setdefault(m.path, m.host_path)
        return [p for p, host in seen.items() if needs_cudart(host)]

    @_as_its_tenant
    def read_handle_statics(self, paths: list[str]) -> int:
        """The handles CUDA 13 stubs already hold (their kernels registered before attach),
        from the process's memory; returns how many were read."""
        n = 0
        try:
            mem = open(f"/proc/{self.pid}/mem", "rb")
        except OSError:
            return 0
        with mem:
            for path in paths:
                file_maps = [m for m in self.maps if m.path == path]
                try:      # every symbol of a tenant's file: read away from the daemon's loop
                    statics = parsing.run(("handle_statics", file_maps[0].host_path), __name__,
                                          "handle_statics", file_maps[0].host_path) if file_maps else []
                except ProfinferError:      # still being read (NotReady), or unreadable
                    statics = []
                if not statics:
                    continue
                try:
                    bias = _load_bias(file_maps[0].host_path, file_maps)
                    elf = load_elf(file_maps[0].host_path)
                except (OSError, ELFError, ProfinferError):
                    continue
                if bias is None:
                    continue
                for vaddr, stub_tail in statics:
                    try:
                        mem.seek(bias + vaddr)
                        value = int.from_bytes(mem.read(8), "little")
                    except (OSError, ValueError, OverflowError):
                        continue
                    kernel = _stub_kernel(elf, stub_tail)
                    if value and kernel:
                        self.put(self.handle_names, value, kernel)
                        n += 1
        return n

    def read_string(self, addr: int, limit: int = 512) -> str:
        """A C string in the process's memory ("" when unreadable)."""
        if not addr:
            return ""
        try:
            with open(f"/proc/{self.pid}/mem", "rb") as mem:
                mem.seek(addr)
                raw = mem.read(limit)
        except (OSError, ValueError, OverflowError):
            return ""
        return raw.split(b"\0", 1)[0].decode("utf-8", "replace")

    def _mapping(self, addr: int) -> Mapping | None:
        for m in self.maps:
            if m.start <= addr < m.end:
                return m
        return None

    def _name_at(self, addr: int) -> str | None:
        m = self._mapping(addr)
        if m is None:
            return None
        off = addr - m.start + m.offset
        try:
            found = symbol_at(load_elf(m.host_path), off)
        except ProfinferError:
            found = None
        if found and found[1] == 0:
            return demangle(found[0])
        return f"kernel@{os.path.basename(m.path)}+0x{off:x}"

    @_as_its_tenant
    def site(self, addr: int) -> str:
        """A code address as function+offset (a call site)."""
        m = self._mapping(addr)
        if m is None:
            return f"0x{addr:x}"
        off = addr - m.start + m.offset
        try:
            found = symbol_at(load_elf(m.host_path), off)
        except ProfinferError:
            found = None
        if found:
            return f"{demangle(found[0])}+0x{found[1]:x}"
        return f"{os.path.basename(m.path)}+0x{off:x}"

    @_as_its_tenant
    def kernel(self, func: int, driver: bool) -> str:
        if driver:
            name = self.functions.get(func)
            return name if name else f"CUfunction@0x{func:x}"
        if func in self.handle_names:
            return demangle(self.handle_names[func])
        stub = self.handles.get(func, func)
        name = self._name_at(stub)
        if name and not name.startswith("kernel@"):
            return name
        if stub in self.registered:          # ELF had no symbol there: as registered
            return demangle(self.registered[stub])
        return name or f"kernel@0x{func:x}"
