"""Build the BPF objects ahead of time, once, cached by content.

Compiling at attach time (BCC's way) cost 1.6-1.9 s of every attach; a precompiled object
loads in milliseconds. The object depends only on the program source, its headers, the
compiler and the architecture, never on the target: target facts go into its .rodata at
load time. An object is looked for, by its name (a hash of what it is built from: bpfbuild),
in $PROFINFER_BPF_PREBUILT, then among those the wheel ships (built by clang when the wheel
was: setup.py), then in the cache; else it is built here into the cache (a fraction of a
second with clang). setup.sh builds both variants into the cache of a source checkout.

    python -m profinfer.core.ebpf.bpfobj            # build (or find) every variant, print their paths
"""
from __future__ import annotations

import json
import os
import platform
import sys
from importlib import resources

from profinfer.core.base import config
from profinfer.core.target import buildcache
from profinfer.core.base import registry
from profinfer.core.base.errors import ProfinferError
from profinfer.core.ebpf.bpfbuild import MANIFEST, VARIANTS, BuildError, compile_object, find_clang, missing_tools
from profinfer.core.ebpf import bpfbuild

# Objects built ahead of time where nothing may be written or compiled at run time: looked
# at first.
PREBUILT_ENV = "PROFINFER_BPF_PREBUILT"
# The objects the wheel ships, in this package's folder of that name (setup.py builds them).
SHIPPED = "prebuilt"

# where each object returned came from: path -> "prebuilt", "shipped" or "built"
def cache_dir() -> str:
    return str(buildcache.cache_dir() / "bpf")


def shipped_dir() -> str:
    return str(resources.files(__package__).joinpath(SHIPPED))


def _name(source: str, variant: str) -> str:
    """The object's file name: what it is built from, hashed (bpfbuild.object_name)."""
    src = registry.bpf_file(source)
    arch = bpfbuild.arch()
    if arch is None:
        raise ProfinferError(f"no BPF register mapping for {platform.machine()} in this profinfer")
    return bpfbuild.object_name(source, src.read_bytes(), bpfbuild.included(src, registry.bpf_dirs()), variant, arch)


def _places() -> list[tuple[str, str | None]]:
    """Where an object is looked for, in order: (its origin, the folder)."""
    return [("prebuilt", config.text(PREBUILT_ENV)), ("shipped", shipped_dir()), ("built", cache_dir())]


def _found(name: str) -> tuple[str, str] | None:
    for origin, directory in _places():
        path = os.path.join(directory, name) if directory else None
        # loaded as root: only an object nobody else could have put there
        if path and os.path.exists(path) and buildcache.trusted(path):
            return origin, path
    return None


def object_path(source: str, variant: str = "ring") -> str:
    """Path of the compiled object for `source` (a BPF program of the core or of a plugin,
    by file name), building it if needed."""
    name = _name(source, variant)
    found = _found(name)
    if found:
        return found[1]
    clang = find_clang()
    why = missing_tools(clang)
    if why:
        raise ProfinferError(f"the BPF object is not built and {why}, or run setup.sh")
    directory = buildcache.writable_dir("bpf") or buildcache.private_dir()   # else for this process's life
    out = os.path.join(directory, name)
    try:
        compile_object(clang, str(registry.bpf_file(source)), [str(d) for d in registry.bpf_dirs()],
                       variant, bpfbuild.arch(), out)
    except BuildError as e:
        raise ProfinferError(str(e)) from None
    return out


def _shipped_said() -> str:
    try:
        with open(os.path.join(shipped_dir(), MANIFEST)) as f:
            m = json.load(f)
        return f"built {m['built']} by {m['clang']}"
    except (OSError, ValueError, KeyError):
        return "no record of their build"


def provenance() -> str:
    """Where this profinfer's BPF objects come from, in one line (nothing is built): e.g.
    "shipped in the wheel (built 2025-01-01 12:00 UTC by Debian clang version 14.0.6, in ...)",
    or each origin's count where they differ."""
    try:
        names = [_name(s, v) for s in sources() for v in VARIANTS]
    except ProfinferError as e:
        return f"unknown ({e})"
    where: dict[str, int] = {}
    for name in names:
        found = _found(name)
        where[found[0] if found else "missing"] = where.get(found[0] if found else "missing", 0) + 1
    missing = missing_tools(find_clang())
    said = {"prebuilt": f"prebuilt from ${PREBUILT_ENV} ({config.text(PREBUILT_ENV)})",
            "shipped": f"shipped in the wheel ({_shipped_said()}, in {shipped_dir()})",
            "built": f"built here by clang in {cache_dir()}",
            "missing": (f"not built yet (clang builds them at first use, in {cache_dir()})" if not missing
                        else f"not built, and {missing}")}
    if len(where) == 1:
        return said[next(iter(where))]
    return "; ".join(f"{n} of {len(names)} {said[o]}" for o, n in where.items())


def sources() -> list[str]:
    """Every BPF program of the core and of the registered plugins."""
    return sorted({f.name for d in registry.bpf_dirs() for f in d.iterdir() if f.name.endswith(".bpf.c")})


def main(argv: list[str]) -> int:
    names = argv or sources()
    try:
        for s in names:
            for v in VARIANTS:
                print(object_path(s, v))
    except ProfinferError as e:
        print(f"profinfer: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
