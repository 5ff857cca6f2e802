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
    """Root of everything the workloads build or download."""
    env = os.environ.get("PROFINFER_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "profinfer"


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
