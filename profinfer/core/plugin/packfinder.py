"""Which packs' files a process maps: the engine it runs (in it or in a descendant), and the
runtime levels' libraries beside it. Used by the session and by the daemon's discovery."""
from __future__ import annotations

import os

import psutil

from profinfer.core.target import process
from profinfer.core.base.errors import ProfinferError
from profinfer.core.plugin.packs import Pack, is_engine_library
from profinfer.core.target.symbols import load_elf


def engine_files(pack: Pack, pid: int, files: list, new_image: bool,
                 executables_seen: dict[tuple, bool]) -> list[tuple[str, str]]:
    """The engine's files among those `pid` maps (`files`), as (path to open, path in the
    target): its libraries by name, or, for a new image without them, the executable if it
    defines the marker (a statically linked engine). executables_seen remembers that per file
    and marker, so that a script that runs the same commands again does not have each one's
    symbols read again."""
    libs = [(m.host_path, m.path) for m in files if is_engine_library(pack, m.path)]
    if libs or not new_image or not pack.marker:
        return libs
    try:
        exe = os.readlink(f"/proc/{pid}/exe").removesuffix(" (deleted)")
    except OSError:
        return []
    main = next((m for m in files if m.path == exe), None)
    if main is None:
        return []
    try:
        key = (process.file_key(main.host_path), pack.marker)
    except OSError:
        return []
    if key not in executables_seen:
        elf = load_elf(main.host_path, f"/proc/{pid}/root")
        executables_seen[key] = bool(elf.find(pack.marker))
        if not elf.has_symtab:
            executables_seen[("stripped", main.path)] = False
    return [(main.host_path, main.path)] if executables_seen[key] else []


def stripped_note(executables_seen: dict[tuple, bool]) -> str:
    """What to add to "no engine found" when an executable looked at had no .symtab."""
    paths = sorted(k[1] for k in executables_seen if k[0] == "stripped")
    if not paths:
        return ""
    return (f"; stripped (no .symtab): {', '.join(paths)}: an engine or runtime linked into it "
            "statically has no symbols to find it by")


def find_engine(packs: list[Pack], pid: int, new_image: bool,
                executables_seen: dict[tuple, bool]) -> tuple[Pack, list[tuple[str, str]]] | None:
    """The first pack whose files `pid` maps now, and those files."""
    found = find_packs(packs, pid, new_image, executables_seen)
    return found[0] if found else None


def find_packs(packs: list[Pack], pid: int, new_image: bool,
               executables_seen: dict[tuple, bool]) -> list[tuple[Pack, list[tuple[str, str]]]]:
    """The packs whose files `pid` maps now, with those files (its mappings read once): the
    first engine among them (a process runs one), and every level's."""
    files = process.mapped_files(pid)
    out, engine_found = [], False
    for pack in packs:
        if engine_found and not pack.level:
            continue
        libs = engine_files(pack, pid, files, new_image, executables_seen)
        if libs:
            out.append((pack, libs))
            engine_found |= not pack.level
    return out


def engine_process(packs: list[Pack], pid: int) -> tuple[Pack, int, list[tuple[str, str]]]:
    """The engine in `pid`, else in the first of its descendants that runs one (vLLM's API
    server runs the model in a child): (pack, that process, its engine files)."""
    seen: dict[tuple, bool] = {}
    found = find_engine(packs, pid, True, seen)
    if found:
        return found[0], pid, found[1]
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        children = []
    for child in sorted(children, key=lambda c: c.pid):
        try:
            found = find_engine(packs, child.pid, True, seen)
        except (OSError, ProfinferError):
            continue
        if found:
            return found[0], child.pid, found[1]
    raise ProfinferError(
        f"no known engine in process {pid}" + (f" or its {len(children)} descendants" if children else "")
        + " (" + "; ".join(f"{p.engine}: {', '.join(p.libraries)}" + (f" or {p.marker}" if p.marker else "")
                           for p in packs) + ")")
