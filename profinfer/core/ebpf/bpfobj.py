"""Build the BPF objects ahead of time, once, cached by content.

Compiling at attach time (BCC's way) cost 1.6-1.9 s of every attach; a precompiled object
loads in milliseconds. The object depends only on the program source, llamacpp.h, the
compiler and the architecture, never on the target: target facts go into its .rodata at
load time. setup.sh builds both variants; an attach on a machine where they are missing
builds them then (a fraction of a second with clang) and says nothing else changes.

    python -m profinfer.core.ebpf.bpfobj            # build (or find) every variant, print their paths
"""
from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
from profinfer.core.base import config
from profinfer.core.target import buildcache
from profinfer.core.base import registry
from profinfer.core.base.errors import ProfinferError

# The ring-buffer build is used from Linux 5.12 on (kernel.ring_buffer_supported): BPF ISA v3
# and atomics that return a value (compare-and-swap claims per-thread slots). The
# perf-buffer build is for older kernels and keeps the baseline ISA.
VARIANTS = {"ring": ["-mcpu=v3"], "perf": ["-DPI_PERF_BUFFER"]}
_ARCH = {"x86_64": "x86", "aarch64": "arm64"}


# Objects built ahead of time where nothing may be written or compiled at run time (the
# image's read-only root): looked at before the cache.
PREBUILT_ENV = "PROFINFER_BPF_PREBUILT"


def cache_dir() -> str:
    return str(buildcache.cache_dir() / "bpf")


def find_clang() -> str | None:
    for name in ["clang"] + [f"clang-{v}" for v in range(20, 13, -1)]:
        path = shutil.which(name)
        if path:
            return path
    return None


def _multiarch_include() -> str:
    multiarch = sysconfig.get_config_var("MULTIARCH") or f"{platform.machine()}-linux-gnu"
    return f"/usr/include/{multiarch}"


def object_path(source: str, variant: str = "ring") -> str:
    """Path of the compiled object for `source` (a BPF program of the core or of a plugin,
    by file name), building it if needed."""
    dirs = registry.bpf_dirs()
    src = registry.bpf_file(source)
    headers = sorted((f for d in dirs for f in d.iterdir() if f.name.endswith(".h")), key=lambda f: f.name)
    text = src.read_bytes() + b"".join(h.read_bytes() for h in headers)
    arch = _ARCH.get(platform.machine())
    if arch is None:
        raise ProfinferError(f"no BPF register mapping for {platform.machine()} in this profinfer")
    key = hashlib.sha256(text + repr((VARIANTS[variant], arch)).encode()).hexdigest()[:16]
    stem = os.path.splitext(os.path.splitext(source)[0])[0]
    name = f"{stem}-{variant}-{key}.o"
    for directory in (config.text(PREBUILT_ENV), cache_dir()):
        # loaded as root: only an object nobody else could have put there
        if directory and os.path.exists(os.path.join(directory, name)) and buildcache.trusted(
                os.path.join(directory, name)):
            return os.path.join(directory, name)
    clang = find_clang()
    if clang is None:
        raise ProfinferError("the BPF object is not built and there is no clang to build it: "
                             "apt-get install clang libbpf-dev, or run setup.sh")
    if not os.path.exists("/usr/include/bpf/bpf_helpers.h"):
        raise ProfinferError("the BPF object is not built and libbpf's headers are missing: "
                             "apt-get install libbpf-dev")
    directory = buildcache.writable_dir("bpf") or buildcache.private_dir()   # else for this process's life
    out = os.path.join(directory, name)
    tmp = f"{out}.{os.getpid()}.tmp"
    cmd = [clang, "-O2", "-g", "-Werror=implicit-function-declaration", "-target", "bpf", f"-D__TARGET_ARCH_{arch}", *VARIANTS[variant],
           *(f"-I{d}" for d in dirs), f"-I{_multiarch_include()}", "-c", str(src), "-o", tmp]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        first = next((l for l in done.stderr.splitlines() if "error" in l), done.stderr.strip()[:300])
        raise ProfinferError(f"building {source} failed: {first}")
    os.chmod(tmp, 0o644)   # whatever the umask: trusted when found again
    os.replace(tmp, out)   # atomic: a concurrent attach sees a whole object or none
    return out


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
