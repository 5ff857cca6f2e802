"""The CUDA runtimes the CUDA level is tested on, and programs built against them, cached
like the other workloads ($PROFINFER_CACHE, else ~/.cache/profinfer):

    <cache>/cuda/cudart-<release>/libcudart.so.12    CUDA 12's runtime, from PyPI's wheel
    <cache>/cuda/libcuda-<release>/libcuda.so.1      the driver library, from Debian's libcuda1
    <cache>/cuda/programs/<name>-<variant>-<hash>    a program built with the toolkit's nvcc

CUDA 13's runtime is the toolkit's (shared, and static, which nvcc links by default): the
toolkit in $CUDA_HOME or /usr/local/cuda when it has nvcc, else one installed from PyPI's
wheels (nvcc, its crt headers and cicc, the runtime's headers and libraries) into

    <cache>/cuda/toolkit-<nvcc version>/nvidia/cu13

There is no GPU here: the calls fail (no driver), but they enter the functions the level
probes with their real arguments, and nvcc's programs register their kernels.

    python -m profinfer.levels.cuda.workload      # fetch (or find) them, print their paths
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

from profinfer.core.target.buildcache import cache_dir, file_lock, log, run

CUDART12_PACKAGE, CUDART12_VERSION = "nvidia-cuda-runtime-cu12", "12.9.79"
LIBCUDA_PACKAGE = "libcuda1"           # Debian non-free
SYSTEM_TOOLKIT = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda"))
# CUDA 13 from PyPI when no toolkit is installed: what nvcc needs to build and link (statically
# and against the shared runtime) the test programs
TOOLKIT_WHEELS = {"nvidia-cuda-nvcc": "13.0.88", "nvidia-cuda-crt": "13.0.88",
                  "nvidia-nvvm": "13.0.88", "nvidia-cuda-runtime": "13.0.96",
                  "nvidia-cuda-cccl": "13.0.85", "nvidia-cuda-culibos": "13.0.85"}
VARIANTS = {"static": [], "shared": ["-cudart", "shared"]}   # nvcc's default is static


def _dir() -> Path:
    return cache_dir() / "cuda"


def _pypi_toolkit() -> Path:
    return _dir() / f"toolkit-{TOOLKIT_WHEELS['nvidia-cuda-nvcc']}" / "nvidia" / "cu13"


def _installed() -> Path | None:
    """The toolkit installed on this machine: $CUDA_HOME, /usr/local/cuda, or the one around
    the nvcc on PATH."""
    if (SYSTEM_TOOLKIT / "bin" / "nvcc").is_file():
        return SYSTEM_TOOLKIT
    found = shutil.which("nvcc")
    if found and (Path(found).resolve().parent.parent / "include" / "cuda_runtime.h").is_file():
        return Path(found).resolve().parent.parent
    return None


def toolkit() -> Path:
    """The CUDA 13 toolkit: the installed one, else PyPI's wheels in the cache (installed once
    here: about 100 MB downloaded)."""
    found = _installed()
    if found:
        return found
    root = _pypi_toolkit()
    if (root / ".complete").is_file():
        return root
    with file_lock(_dir() / ".toolkit.lock", "the CUDA toolkit (PyPI)"):
        if (root / ".complete").is_file():
            return root
        target = root.parent.parent
        shutil.rmtree(target, ignore_errors=True)
        log(f"no CUDA toolkit installed: nvcc and CUDA 13's runtime from PyPI into {target}")
        run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check",
             "--no-deps", "--target", str(target), *(f"{n}=={v}" for n, v in TOOLKIT_WHEELS.items())],
            _dir())
        # the layout nvcc.profile expects (targets/<arch>/{include,lib}), lib64, and the
        # unversioned runtime that `-cudart shared` links with
        arch = root / "targets" / "x86_64-linux"
        arch.mkdir(parents=True, exist_ok=True)
        for name in ("include", "lib"):
            (arch / name).symlink_to(Path("..") / ".." / name)
        (root / "lib64").symlink_to("lib")
        (root / "lib" / "libcudart.so").symlink_to("libcudart.so.13")
        (root / ".complete").write_text(" ".join(f"{n}=={v}" for n, v in TOOLKIT_WHEELS.items()) + "\n")
    return root


def nvcc() -> Path:
    return toolkit() / "bin" / "nvcc"


def toolkit_cudart() -> Path:
    """The toolkit's shared runtime (CUDA 13 here)."""
    lib64 = toolkit() / "lib64"
    libs = sorted(lib64.glob("libcudart.so.*[0-9]"), key=lambda p: len(p.name))
    if not libs:
        raise RuntimeError(f"no libcudart.so.* in {lib64}")
    return libs[0].resolve()


def runtimes_here() -> list[Path]:
    """The CUDA runtime and driver libraries this machine has (ldconfig's) and those in
    profinfer's cache, without downloading any: one of each file name."""
    found: dict[str, Path] = {}
    try:
        listed = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        listed = ""
    for line in listed.splitlines():
        name, _, path = line.strip().partition(" => ")
        name = name.split(" ", 1)[0]
        if name.startswith(("libcudart.so.", "libcuda.so.")) and os.path.isfile(path):
            found.setdefault(name, Path(path))
    for path in sorted(_dir().glob("cudart-*/libcudart.so.*")) + sorted(_dir().glob("libcuda-*/libcuda.so.1")):
        found.setdefault(path.name, path)
    return list(found.values())


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
    if variant == "shared":   # the toolkit's runtime found without the loader's configuration
        flags += ["-Xlinker", f"-rpath={toolkit_cudart().parent}"]
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
        print(nvcc())
        print(toolkit_cudart())
    except (RuntimeError, subprocess.CalledProcessError, OSError, StopIteration) as e:
        print(f"profinfer.levels.cuda.workload: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
