"""The CUDA runtimes the CUDA level is tested on, and programs built against them, cached
like the other workloads ($PROFINFER_CACHE, else ~/.cache/profinfer):

    <cache>/cuda/cudart-<release>/libcudart.so.12    CUDA 12's runtime, from PyPI's wheel
    <cache>/cuda/libcuda-<release>/libcuda.so.1      the driver library, from Debian's libcuda1
    <cache>/cuda/programs/<name>-<variant>-<hash>    a program built with the toolkit's nvcc

CUDA 13's runtime is the toolkit's (/usr/local/cuda: shared, and static, which nvcc links by
default). There is no GPU here: the calls fail (no driver), but they enter the functions the
level probes with their real arguments, and nvcc's programs register their kernels.

    python -m profinfer.cuda.workload      # fetch (or find) them, print their paths
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from ..buildcache import cache_dir, file_lock, run

CUDART12_PACKAGE, CUDART12_VERSION = "nvidia-cuda-runtime-cu12", "12.9.79"
LIBCUDA_PACKAGE = "libcuda1"           # Debian non-free
TOOLKIT = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda"))
VARIANTS = {"static": [], "shared": ["-cudart", "shared"]}   # nvcc's default is static


def _dir() -> Path:
    return cache_dir() / "cuda"


def nvcc() -> Path:
    for p in (TOOLKIT / "bin" / "nvcc", Path("/usr/local/bin/nvcc")):
        if p.exists():
            return p
    found = shutil.which("nvcc")
    if not found:
        raise RuntimeError("nvcc not found (the CUDA toolkit): set CUDA_HOME")
    return Path(found)


def toolkit_cudart() -> Path:
    """The toolkit's shared runtime (CUDA 13 here)."""
    libs = sorted((TOOLKIT / "lib64").glob("libcudart.so.*[0-9]"), key=lambda p: len(p.name))
    if not libs:
        raise RuntimeError(f"no libcudart.so.* in {TOOLKIT / 'lib64'}")
    return libs[0].resolve()


def ensure_cudart12() -> Path:
    """libcudart.so.12 from the PyPI wheel (what PyTorch's CUDA 12 builds load)."""
    dest = _dir() / f"cudart-{CUDART12_VERSION}"
    lib = dest / "libcudart.so.12"
    if lib.is_file():
        return lib
    with file_lock(_dir() / ".cudart12.lock", "libcudart.so.12"):
        if lib.is_file():
            return lib
        with tempfile.TemporaryDirectory() as tmp:
            run([sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check",
                 "--no-deps", "-d", tmp, f"{CUDART12_PACKAGE}=={CUDART12_VERSION}"], Path(tmp))
            wheel = next(Path(tmp).glob("*.whl"))
            with zipfile.ZipFile(wheel) as z:
                member = next(n for n in z.namelist() if n.endswith("/lib/libcudart.so.12"))
                dest.mkdir(parents=True, exist_ok=True)
                part = dest / "libcudart.so.12.part"
                part.write_bytes(z.read(member))
                part.rename(lib)
    return lib


def ensure_libcuda() -> Path:
    """libcuda.so.1 (the driver API library) from Debian's non-free libcuda1, unpacked here
    (installing it would pull in the kernel module's packages, which this machine cannot use)."""
    done = sorted(_dir().glob("libcuda-*/libcuda.so.1"))
    if done:
        return done[-1]
    with file_lock(_dir() / ".libcuda.lock", "libcuda.so.1"):
        done = sorted(_dir().glob("libcuda-*/libcuda.so.1"))
        if done:
            return done[-1]
        with tempfile.TemporaryDirectory() as tmp:
            run(["apt-get", "download", "-q", LIBCUDA_PACKAGE], Path(tmp))
            deb = next(Path(tmp).glob("*.deb"))
            version = deb.name.split("_")[1]
            run(["dpkg-deb", "-x", str(deb), "x"], Path(tmp))
            lib = next(p for p in (Path(tmp) / "x").rglob("libcuda.so.*[0-9]") if p.name != "libcuda.so.1")
            dest = _dir() / f"libcuda-{version}"
            dest.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(lib, dest / "libcuda.so.1.part")
            (dest / "libcuda.so.1.part").rename(dest / "libcuda.so.1")
    return dest / "libcuda.so.1"


def build_program(source: Path, variant: str = "static", extra: tuple[str, ...] = ()) -> Path:
    """`source` built with nvcc (variant: how cudart is linked), cached by content."""
    flags = ["-O2", "-g", "-std=c++17", *VARIANTS[variant], *extra]
    # the source and the headers beside it (what it includes with "")
    inputs = source.read_bytes() + b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))
    key = hashlib.sha256(inputs + " ".join(flags).encode()).hexdigest()[:12]
    out = _dir() / "programs" / f"{source.stem}-{variant}-{key}"
    if out.is_file():
        return out
    with file_lock(_dir() / "programs" / ".build.lock", f"{source.name} ({variant})"):
        if not out.is_file():
            part = out.with_suffix(".part")
            run([str(nvcc()), *flags, "-o", str(part), str(source), "-ldl", "-lpthread"], out.parent)
            part.rename(out)
    return out


def main() -> int:
    try:
        print(ensure_cudart12())
        print(ensure_libcuda())
        print(toolkit_cudart())
    except (RuntimeError, subprocess.CalledProcessError, OSError, StopIteration) as e:
        print(f"profinfer.cuda.workload: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
