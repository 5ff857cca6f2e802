"""How a BPF object is named and compiled, with the standard library alone.

bpfobj builds an object here at run time (into the cache) with this code, and the wheel's build
(setup.py, which has none of profinfer's dependencies) loads this file by its path to compile
the objects the wheel ships (`build_all`): the same name, the same command.

An object's name holds a hash of its program, the headers it includes (transitively, each as
the folders it is built with give it: `included`), its variant's flags and the architecture:
an object of that name is this source's, compiled so, whatever other plug-ins are installed
beside it (a plug-in's headers rename only the objects that include them).
"""
from __future__ import annotations

import datetime
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sysconfig
from pathlib import Path

# The ring-buffer build is used from Linux 5.12 on (kernel.ring_buffer_supported): BPF ISA v3
# and atomics that return a value (compare-and-swap claims per-thread slots). The
# perf-buffer build is for older kernels and keeps the baseline ISA.
VARIANTS = {"ring": ["-mcpu=v3"], "perf": ["-DPI_PERF_BUFFER"]}
ARCH = {"x86_64": "x86", "aarch64": "arm64"}
# what a folder of objects built ahead of time says of them (when, by which compiler)
MANIFEST = "BUILT.json"
HELPERS = "/usr/include/bpf/bpf_helpers.h"      # libbpf-dev


class BuildError(Exception):
    """One line: why an object could not be built."""


def arch() -> str | None:
    return ARCH.get(platform.machine())


def find_clang() -> str | None:
    for name in ["clang"] + [f"clang-{v}" for v in range(20, 13, -1)]:
        path = shutil.which(name)
        if path:
            return path
    return None


def missing_tools(clang: str | None) -> str | None:
    """What is missing to compile here (clang, libbpf's headers), or None."""
    if clang is None:
        return "there is no clang to build it: apt-get install clang libbpf-dev"
    if not os.path.exists(HELPERS):
        return "libbpf's headers are missing: apt-get install libbpf-dev"
    return None


def _multiarch_include() -> str:
    multiarch = sysconfig.get_config_var("MULTIARCH") or f"{platform.machine()}-linux-gnu"
    return f"/usr/include/{multiarch}"


_INCLUDE = re.compile(rb'^[ \t]*#[ \t]*include[ \t]+(?:"([^"]+)"|([A-Za-z_][A-Za-z0-9_]*))', re.M)
_NAMED = re.compile(rb'^[ \t]*#[ \t]*define[ \t]+([A-Za-z_][A-Za-z0-9_]*)[ \t]+"([^"]+)"', re.M)


def included(src, dirs: list) -> list[bytes]:
    """The text of each header `src` includes with quotes (or through a macro defined as a
    quoted name: `#define PI_ENGINE_EVENTS "llamacpp.h"`), transitively, as the first of `dirs`
    that holds it (the compiler's -I order), in their names' order. A name no folder holds is
    the system's (the compiler's own path): not hashed."""
    found: dict[str, bytes] = {}
    todo = [Path(str(src)).read_bytes()]
    macros: dict[bytes, bytes] = {}
    while todo:
        text = todo.pop()
        macros.update(_NAMED.findall(text))
        for quoted, macro in _INCLUDE.findall(text):
            raw = quoted or macros.get(macro)
            if raw is None:
                continue
            name = raw.decode()
            if name in found:
                continue
            path = next((os.path.join(str(d), name) for d in dirs if os.path.isfile(os.path.join(str(d), name))), None)
            if path is not None:
                found[name] = Path(path).read_bytes()
                todo.append(found[name])
    return [found[n] for n in sorted(found)]


def object_name(source: str, text: bytes, headers: list[bytes], variant: str, arch_name: str) -> str:
    """The object's file name: `source`'s stem, the variant, and a hash of the program's text,
    the headers' (in their file names' order), the variant's flags and the architecture."""
    key = hashlib.sha256(text + b"".join(headers) + repr((VARIANTS[variant], arch_name)).encode()).hexdigest()[:16]
    stem = os.path.splitext(os.path.splitext(source)[0])[0]
    return f"{stem}-{variant}-{key}.o"


def compile_object(clang: str, src: str, dirs: list[str], variant: str, arch_name: str, out: str) -> None:
    """Compile `src` (headers from `dirs`, in that order) into `out`, atomically, mode 0644."""
    tmp = f"{out}.{os.getpid()}.tmp"
    cmd = [clang, "-O2", "-g", "-Werror=implicit-function-declaration", "-target", "bpf",
           f"-D__TARGET_ARCH_{arch_name}", *VARIANTS[variant],
           *(f"-I{d}" for d in dirs), f"-I{_multiarch_include()}", "-c", src, "-o", tmp]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        first = next((l for l in done.stderr.splitlines() if "error" in l), done.stderr.strip()[:300])
        raise BuildError(f"building {os.path.basename(src)} failed: {first}")
    os.chmod(tmp, 0o644)   # whatever the umask: trusted when found again
    os.replace(tmp, out)   # atomic: a concurrent attach sees a whole object or none


def build_all(dirs: list[str], out_dir: str) -> list[str]:
    """Every program of `dirs` (the core's bpf folder first, then each plugin's), both
    variants, compiled into `out_dir` with a MANIFEST saying when and by which clang: the
    objects' file names."""
    clang = find_clang()
    why = missing_tools(clang)
    if why:
        raise BuildError(f"the BPF objects cannot be built: {why}")
    arch_name = arch()
    if arch_name is None:
        raise BuildError(f"no BPF register mapping for {platform.machine()} in this profinfer")
    files = sorted((Path(d) / f for d in dirs for f in os.listdir(d)), key=lambda f: f.name)
    os.makedirs(out_dir, exist_ok=True)
    names = []
    for src in (f for f in files if f.name.endswith(".bpf.c")):
        headers = included(src, dirs)
        for variant in VARIANTS:
            name = object_name(src.name, src.read_bytes(), headers, variant, arch_name)
            compile_object(clang, str(src), dirs, variant, arch_name, os.path.join(out_dir, name))
            names.append(name)
    version = subprocess.run([clang, "--version"], capture_output=True, text=True).stdout.splitlines()
    manifest = {"built": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                "clang": version[0].strip() if version else clang, "arch": arch_name, "objects": names}
    with open(os.path.join(out_dir, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=1)
    return names
