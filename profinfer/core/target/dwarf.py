"""Struct layouts and a function's facts from DWARF, cached by a digest of the DWARF itself
(a C++ library takes seconds to scan). A build id alone would not do: a tenant can give its
own file another library's build id, and the cache is shared by every process on the node.
A scan reads a file a tenant may have made: it runs away from the daemon's loop with a
deadline (parsing.py), and reads no more DWARF than MAX_DWARF_BYTES."""
from __future__ import annotations

import hashlib

from elftools.dwarf.ranges import BaseAddressEntry
from elftools.elf.elffile import ELFFile

from profinfer.core.target import parsing, procfs
from profinfer.core.target.buildcache import cache_dir, load_trusted_json, writable_dir, write_json
from profinfer.core.target.elfheaders import elf_file
from profinfer.core.base.errors import ProfinferError

parsing.preload(__name__)

MAX_DWARF_BYTES = 256 << 20     # its .debug_* sections together (llama.cpp's largest: ~60 MiB)


_in_memory: dict[str, object] = {}     # where the cache cannot be written
_MISSING = object()                    # not cached (a cached layout may be None: no such struct)
_digests: dict[tuple[int, int, int, int], str] = {}   # file identity -> its DWARF's digest


def _digest_of(f) -> str:
    """A digest of the .debug_* sections' bytes as the file stores them ("" without DWARF)."""
    elf = _elf(f)
    if elf is None:
        return ""
    h = hashlib.blake2b(digest_size=16)
    for sec in elf.iter_sections():
        if not sec.name.startswith(".debug_") or sec.header.sh_type == "SHT_NOBITS":
            continue
        h.update(sec.name.encode() + b"\0")
        f.seek(sec.header.sh_offset)
        left = sec.header.sh_size
        while left > 0:
            chunk = f.read(min(left, 1 << 20))
            if not chunk:
                break
            h.update(chunk)
            left -= len(chunk)
    return h.hexdigest()


def _digest(path: str) -> str:
    with _open(path) as f:
        return _digest_of(f)


def dwarf_digest(path: str) -> str:
    """The digest of the DWARF in `path`, remembered by the file's identity."""
    try:
        st = procfs.stat_file(path)
    except OSError as e:
        raise ProfinferError(f"cannot read {path}: {e.strerror}") from None
    identity = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    digest = _digests.get(identity)
    if digest is None:
        digest = _digests[identity] = parsing.run(("dwarf-digest", path, identity), __name__, "_digest", path)
        if len(_digests) > 256:
            _digests.pop(next(iter(_digests)))
    return digest


def _checked(digest: str, function: str, path: str, *args):
    """A scan (_SCANS[function](file, *args)) of the file only if its DWARF still has
    `digest`, read from the same descriptor: a file swapped after its digest was taken is
    not kept under it."""
    with _open(path) as f:
        if _digest_of(f) != digest:
            raise ProfinferError(f"{path} changed while it was read")
        return _SCANS[function](f, *args)


def _cached(what: str, function: str, path: str, *args):
    """A scan's result (None without DWARF), kept as JSON in the cache under the DWARF's
    digest and `what`."""
    digest = dwarf_digest(path)
    if not digest:
        return None
    name = f"{digest}.{what}.json"

    def compute():
        return parsing.run(("dwarf", name), __name__, "_checked", digest, function, path, *args)
    if name in _in_memory:
        return _in_memory[name]
    cached = load_trusted_json(cache_dir() / "layouts" / name, _MISSING)   # a layout decides what we read
    if cached is not _MISSING:
        return cached
    found = compute()
    directory = writable_dir("layouts")
    if directory is None:
        _in_memory[name] = found
        return found
    write_json(directory / name, found)
    return found


def struct_layout(path: str, struct: str) -> dict | None:
    """{"size": n, "members": {name: offset}, "nested": {name: size},
    "nested_members": {name: {member: offset}}} for a struct definition in the file's DWARF,
    or None when the file has no such definition."""
    return _cached(f"{struct}.v2", "_scan", path, struct.encode())


def _members(die) -> dict[str, int]:
    """{member name: offset} of a struct's data members."""
    out = {}
    for m in die.iter_children():
        ma = m.attributes
        if m.tag == "DW_TAG_member" and "DW_AT_name" in ma and "DW_AT_data_member_location" in ma:
            out[ma["DW_AT_name"].value.decode()] = ma["DW_AT_data_member_location"].value
    return out


def _elf(f) -> ELFFile | None:
    """The file's ELF, if it has DWARF no larger than we read."""
    elf = elf_file(f)
    if not elf.has_dwarf_info():
        return None
    size = sum(sec.header.sh_size for sec in elf.iter_sections() if sec.name.startswith(".debug_"))
    if size > MAX_DWARF_BYTES:
        raise ProfinferError(f"{size >> 20} MiB of DWARF: over the {MAX_DWARF_BYTES >> 20} MiB read")
    return elf


def _open(path: str):
    """The file, opened inside its process's root (procfs)."""
    try:
        return procfs.open_binary(path)
    except OSError as e:
        raise ProfinferError(f"cannot read {path}: {e.strerror}") from None


def _scan(f, name: bytes) -> dict | None:
    elf = _elf(f)
    if elf is None:
        return None
    for cu in elf.get_dwarf_info().iter_CUs():
        for die in cu.get_top_DIE().iter_children():
            if die.tag not in ("DW_TAG_structure_type", "DW_TAG_class_type"):
                continue
            a = die.attributes
            if "DW_AT_declaration" in a or "DW_AT_name" not in a or a["DW_AT_name"].value != name:
                continue
            members, nested, nested_members = _members(die), {}, {}
            for m in die.iter_children():
                ma = m.attributes
                if (m.tag == "DW_TAG_structure_type" and "DW_AT_name" in ma
                        and "DW_AT_byte_size" in ma):
                    nested[ma["DW_AT_name"].value.decode()] = ma["DW_AT_byte_size"].value
                    nested_members[ma["DW_AT_name"].value.decode()] = _members(m)
            size = a["DW_AT_byte_size"].value if "DW_AT_byte_size" in a else 0
            return {"size": size, "members": members, "nested": nested,
                    "nested_members": nested_members}
    return None


def function_facts(path: str, vaddr: int, structs: tuple[str, ...],
                   enum_prefix: str) -> dict | None:
    """From the compile unit that holds the function at `vaddr`: the address ranges of code
    inlined into it ({"inlined": [[low, high], ...]}), the members of `structs` as that unit
    defines them ({"structs": {name: {member: offset}}}), and its enumerators whose names
    start with `enum_prefix` ({"enums": {name: value}}). None without DWARF for it."""
    return _cached(f"fn{vaddr:x}.{'.'.join(structs)}.{enum_prefix}.v1", "_function_facts", path,
                   vaddr, tuple(structs), enum_prefix)


def _die_ranges(die, cu, range_lists) -> list[tuple[int, int]]:
    a = die.attributes
    if "DW_AT_low_pc" in a and "DW_AT_high_pc" in a:
        low, high = a["DW_AT_low_pc"].value, a["DW_AT_high_pc"]
        return [(low, high.value if high.form == "DW_FORM_addr" else low + high.value)]
    if "DW_AT_ranges" not in a or range_lists is None:
        return []
    at = a["DW_AT_ranges"]
    entries = (range_lists.get_range_list_at_offset(cu, at.value) if at.form == "DW_FORM_rnglistx"
               else range_lists.get_range_list_at_offset(at.value, cu=cu))
    top = cu.get_top_DIE().attributes
    base = top["DW_AT_low_pc"].value if "DW_AT_low_pc" in top else 0
    out = []
    for e in entries:
        if isinstance(e, BaseAddressEntry):
            base = e.base_address
            continue
        add = 0 if e.is_absolute else base
        out.append((e.begin_offset + add, e.end_offset + add))
    return out


def _function_facts(f, vaddr: int, structs: tuple[str, ...], enum_prefix: str) -> dict | None:
    elf = _elf(f)
    if elf is None:
        return None
    dw = elf.get_dwarf_info()
    aranges = dw.get_aranges()
    cu_offset = aranges.cu_offset_at_addr(vaddr) if aranges else None
    if cu_offset is None:
        return None
    cu = dw.get_CU_at(cu_offset)
    range_lists = dw.range_lists()
    wanted = {s.encode() for s in structs}
    out: dict = {"inlined": [], "structs": {}, "enums": {}}
    for die in cu.get_top_DIE().iter_children():
        a = die.attributes
        if die.tag == "DW_TAG_subprogram" and any(
                low <= vaddr < high for low, high in _die_ranges(die, cu, range_lists)):
            stack = list(die.iter_children())
            while stack:
                d = stack.pop()
                if d.tag == "DW_TAG_inlined_subroutine":
                    out["inlined"].extend(_die_ranges(d, cu, range_lists))
                else:
                    stack.extend(d.iter_children())
        elif (die.tag == "DW_TAG_structure_type" and "DW_AT_declaration" not in a
              and "DW_AT_name" in a and a["DW_AT_name"].value in wanted):
            out["structs"][a["DW_AT_name"].value.decode()] = _members(die)
        elif die.tag == "DW_TAG_enumeration_type":
            for e in die.iter_children():
                name = e.attributes.get("DW_AT_name")
                if (e.tag == "DW_TAG_enumerator" and name
                        and name.value.decode().startswith(enum_prefix)):
                    out["enums"][name.value.decode()] = e.attributes["DW_AT_const_value"].value
    return out


_SCANS = {"_scan": _scan, "_function_facts": _function_facts}
