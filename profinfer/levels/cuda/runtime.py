"""Where a process's CUDA runtime and driver API are, and which of their functions the
cuda level probes (levels/cuda/pack.toml's table, resolved against each file's symbols).

The runtime is any libcudart.so* the process maps, or a copy linked statically into an
executable (nvcc's default) or library, found by its symbols (.symtab: the static copy's
functions are local); the driver API is libcuda.so*. A statically linked copy in a
stripped file has no symbols to probe: the session says so, rather than finding nothing.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from profinfer.core.ebpf import layout
from profinfer.core.base.errors import ProfinferError
from profinfer.core.plugin.packs import Pack, is_engine_library
from profinfer.core.target.symbols import ElfInfo, load_elf

HEADER = "cuda.h"
_STATIC_PREFIXES = ("libcudart_static_", "cuda", "__cuda")


@dataclass(frozen=True)
class Api:
    index: int          # its attach cookie
    name: str
    cls: str            # pack.toml `class` (bpf/cuda.h PC_*)
    what: str           # launch, graph, copy, set, memory, sync, registration
    stream_slot: int | None
    handle_slot: int | None
    memory: str         # malloc/free: "device" or "host"
    returns: bool       # probed at return too

    @property
    def driver(self) -> bool:
        return self.name.startswith("cu") and not self.name.startswith("cuda")


def apis(pack: Pack) -> list[Api]:
    out = []
    for fn in pack.raw.get("function", ()):
        for name in fn["names"]:
            out.append(Api(len(out), name, fn["class"], fn["what"], fn.get("stream"),
                           fn.get("handle"), fn.get("memory", ""), bool(fn.get("returns"))))
    consts = layout.parse(header=HEADER)[0]
    if len(out) > consts["PC_MAX_APIS"]:
        raise ProfinferError(f"probe pack {pack.name} lists {len(out)} functions; "
                             f"the cuda level probes at most {consts['PC_MAX_APIS']}")
    for a in out:
        if f"PC_{a.cls.upper()}" not in consts:
            raise ProfinferError(f"probe pack {pack.name}: {a.name}: unknown class {a.cls!r}")
    return out


def class_number(cls: str) -> int:
    return layout.parse(header=HEADER)[0][f"PC_{cls.upper()}"]


@dataclass
class RuntimeFile:
    elf: ElfInfo
    host_path: str      # where profinfer attaches
    path: str           # as the process sees it
    static: bool        # a runtime linked into an executable or another library


def runtime_files(pack: Pack, lib_paths: list[tuple[str, str]], root: str = "/") -> tuple[list[RuntimeFile], list[str]]:
    """The CUDA runtime and driver files among (host path, target path) pairs: by name, else
    a file that defines the pack's marker (a static runtime; a stripped one cannot be found,
    which the session says). Returns (files, warnings)."""
    found, warnings = [], []
    for host, path in lib_paths:
        try:
            elf = load_elf(host, root)
        except ProfinferError as e:
            warnings.append(str(e))
            continue
        if is_engine_library(pack, path):
            found.append(RuntimeFile(elf, host, path, False))
        elif elf.find(pack.marker):
            found.append(RuntimeFile(elf, host, path, True))
    return found, warnings


def static_runtime_span(elf: ElfInfo) -> tuple[int, int] | None:
    """The file offsets a static runtime's code spans: the longest run of its functions in
    address order (one archive's objects, linked together; a few of its functions, static
    initialisers, land beside the program's own code and are left out)."""
    syms = sorted(elf.symbols.values(), key=lambda s: s.file_offset)
    best, start = (0, None, None), None
    for i, s in enumerate(syms + [None]):
        ours = s is not None and s.name.startswith(_STATIC_PREFIXES)
        if ours and start is None:
            start = i
        elif not ours and start is not None:
            if i - start > best[0]:
                best = (i - start, syms[start], syms[i - 1])
            start = None
    if best[1] is None:
        return None
    return best[1].file_offset, best[2].file_offset + best[2].size


def runtime_ranges(pid: int, files: list[RuntimeFile]) -> list[tuple[int, int]]:
    """The process's address ranges of CUDA runtime code (for the nested-call check):
    libcudart's executable mappings, and each static copy's span."""
    from profinfer.levels.cuda.names import executable_mappings
    maps = executable_mappings(pid)
    out = []
    for rf in files:
        if os.path.basename(rf.path).startswith("libcuda.so"):
            continue        # the driver itself: its calls are the ones checked
        span = static_runtime_span(rf.elf) if rf.static else None
        for m in maps:
            if m.path != rf.path:
                continue
            if span is None:
                out.append((m.start, m.end))
            else:
                a, b = max(span[0], m.offset), min(span[1], m.offset + m.end - m.start)
                if a < b:
                    out.append((m.start + a - m.offset, m.start + b - m.offset))
    return out
