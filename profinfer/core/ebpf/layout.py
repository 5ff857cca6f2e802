"""numpy dtypes for the BPF event structs, parsed from their BPF headers (their single definition)."""
from __future__ import annotations

import re
from functools import lru_cache

import numpy as np

from profinfer.core.base import registry

_TYPES = {"u8": "u1", "u16": "<u2", "u32": "<u4", "s32": "<i4", "u64": "<u8", "s64": "<i8", "char": "S1"}
_STRUCT = re.compile(r"struct\s+(\w+)\s*\{(.*?)\};", re.S)
_FIELD = re.compile(r"^\s*(?:struct\s+)?(\w+)\s+(\w+)(?:\[(\w+)\])?\s*;")
_DEFINE = re.compile(r"^#define\s+(\w+)\s+(0x[0-9a-fA-F]+|\d+)[uU]?\s*(?:/\*.*?\*/)?\s*$", re.M)


_INCLUDE = re.compile(r'^#include "(\w+\.h)"\s*$', re.M)


def header_text(header: str) -> str:
    """A BPF header of the core or of a plugin, with the local headers it includes inlined."""
    text = registry.bpf_file(header).read_text()
    return _INCLUDE.sub(lambda m: header_text(m.group(1)), text)


@lru_cache(maxsize=8)
def parse(text: str | None = None, header: str = "transport.h") -> tuple[dict[str, int], dict[str, np.dtype]]:
    """Return (#define constants, {struct name: dtype}) from `text`, else from `header`
    (an engine's event header; transport.h alone for the core's objects)."""
    text = text if text is not None else header_text(header)
    consts = {k: int(v, 0) for k, v in _DEFINE.findall(text)}
    dtypes: dict[str, np.dtype] = {}
    for name, body in _STRUCT.findall(re.sub(r"/\*.*?\*/", "", text, flags=re.S)):
        fields = []
        for decl in body.split(";"):
            m = _FIELD.match(decl + ";")
            if not m:
                continue
            ctype, fname, count = m.groups()
            base = dtypes[ctype] if ctype in dtypes else np.dtype(_TYPES[ctype])
            n = int(consts.get(count, count)) if count else 0
            if ctype == "char":
                fields.append((fname, f"S{n or 1}"))
            else:
                fields.append((fname, base, (n,)) if n else (fname, base))
        dt = np.dtype(fields, align=True)
        if dt.itemsize != sum(dt.fields[f][0].itemsize for f in dt.names):
            raise ValueError(f"struct {name} in {header} has implicit padding")
        dtypes[name] = dt
    return consts, dtypes
