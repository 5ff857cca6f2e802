"""The cache where the bundled workloads are built and generated ($PROFINFER_CACHE, else
~/.cache/profinfer), with what every engine's workload module uses to fill it: one builder at
a time per item (flock), and commands whose output is the build's progress report."""
from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator


def log(msg: str) -> None:
    # stderr, so that stdout stays clean for the paths the workload modules print.
    print(f"profinfer.workload: {msg}", file=sys.stderr, flush=True)


def cache_dir() -> Path:
    """Root of everything profinfer builds, downloads or remembers."""
    env = os.environ.get("PROFINFER_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "profinfer"


_unwritable: set[Path] = set()


def writable_dir(sub: str) -> Path | None:
    """cache_dir()/sub, made if missing; None where it cannot be written (a read-only root, a
    volume not mounted): the caller then keeps what it would cache in memory. Said once per
    directory, in one line: a cache is an optimisation, never a reason not to profile."""
    path = cache_dir() / sub
    if path in _unwritable:
        return None
    try:
        path.mkdir(parents=True, exist_ok=True)
        if not os.access(path, os.W_OK):
            raise PermissionError(f"{path} is not writable")
    except OSError as e:
        _unwritable.add(path)
        print(f"profinfer: warning: cache {path} cannot be written ({e.strerror or e}); "
              "keeping it in memory", file=sys.stderr, flush=True)
        return None
    return path


@contextlib.contextmanager
def file_lock(path: Path, what: str) -> Iterator[None]:
    """Hold an exclusive flock on `path` so that two processes never build `what` at once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"waiting for another process preparing {what} (lock {path})")
            fcntl.flock(f, fcntl.LOCK_EX)
        yield  # the lock is released when the file is closed


def run(cmd: list[str], cwd: Path) -> None:
    log("$ " + " ".join(cmd))
    t0 = time.monotonic()
    subprocess.run(cmd, cwd=cwd, check=True, stdout=sys.stderr)
    log(f"done in {time.monotonic() - t0:.0f}s")
