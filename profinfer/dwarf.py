"""Struct layouts from DWARF, cached by build id (a C++ library takes seconds to scan)."""
from __future__ import annotations

import json
import os

from elftools.elf.elffile import ELFFile


def _cache_path(build_id: str, struct: str) -> str:
    base = os.environ.get("PROFINFER_CACHE") or os.path.expanduser("~/.cache/profinfer")
    return os.path.join(base, "layouts", f"{build_id}.{struct}.v2.json")


def struct_layout(path: str, build_id: str, struct: str) -> dict | None:
    """{"size": n, "members": {name: offset}, "nested": {name: size},
    "nested_members": {name: {member: offset}}} for a struct definition in the file's DWARF,
    or None when the file has no such definition."""
    cache = _cache_path(build_id, struct) if build_id else None
    if cache and os.path.exists(cache):
        with open(cache) as f:
            return json.load(f)
    found = _scan(path, struct.encode())
    if cache:
        os.makedirs(os.path.dirname(cache), exist_ok=True)
        with open(cache, "w") as f:
            json.dump(found, f)
    return found


def _members(die) -> dict[str, int]:
    """{member name: offset} of a struct's data members."""
    out = {}
    for m in die.iter_children():
        ma = m.attributes
        if m.tag == "DW_TAG_member" and "DW_AT_name" in ma and "DW_AT_data_member_location" in ma:
            out[ma["DW_AT_name"].value.decode()] = ma["DW_AT_data_member_location"].value
    return out


def _scan(path: str, name: bytes) -> dict | None:
    with open(path, "rb") as f:
        elf = ELFFile(f)
        if not elf.has_dwarf_info():
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
