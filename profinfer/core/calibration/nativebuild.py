"""Build profinfer's C microbenchmarks (profinfer/core/calibration/native/*.c) once, cached by content."""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from importlib import resources

from profinfer.core.target import buildcache
from profinfer.core.base.errors import ProfinferError


def cache_dir() -> str:
    return str(buildcache.cache_dir())


def build(source: str, flags: list[str]) -> str:
    """Path of the binary built from native/`source` with `flags` (gcc)."""
    src = resources.files(__package__).joinpath(f"native/{source}")
    digest = hashlib.sha256(src.read_bytes() + " ".join(flags).encode()).hexdigest()[:12]
    binary = f"{os.path.splitext(source)[0]}-{digest}"
    out = os.path.join(cache_dir(), "bin", binary)
    if os.path.exists(out) and buildcache.trusted(out):     # run as root: only one nobody else put there
        return out
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise ProfinferError("calibrate needs a C compiler: apt-get install gcc")
    out = os.path.join(buildcache.writable_dir("bin") or buildcache.private_dir(), binary)
    tmp = f"{out}.{os.getpid()}"
    done = subprocess.run([cc, *flags, str(src), "-o", tmp], capture_output=True, text=True)
    if done.returncode != 0:
        raise ProfinferError(f"building the microbenchmark {source} failed: "
                             f"{(done.stderr.strip().splitlines() or ['?'])[0]}")
    os.chmod(tmp, 0o755)
    os.replace(tmp, out)
    return out
