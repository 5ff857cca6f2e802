"""The cache where the bundled workloads are built and generated ($PROFINFER_CACHE, else
~/.cache/profinfer), with what every engine's workload module uses to fill it: one builder at
a time per item (flock), and commands whose output is the build's progress report.

What profinfer runs, loads or reads from it (BPF objects, as root; native binaries; struct
layouts and measurements, open_trusted) is used only if nobody but this user or root could
have put it there: the file and every directory on
its way from / (as given and as resolved) owned by root or the effective user, and none
writable by group or others (a sticky directory such as /tmp aside). Under `sudo -E` the
home cache is a user's: refused, said once, and built again in a private place."""
from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

from profinfer.core.base import config
from profinfer.core.target import procfs


def log(msg: str) -> None:
    # stderr, so that stdout stays clean for the paths the workload modules print.
    print(f"profinfer.workload: {msg}", file=sys.stderr, flush=True)


def cache_dir() -> Path:
    """Root of everything profinfer builds, downloads or remembers."""
    env = config.text("PROFINFER_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "profinfer"


_unwritable: set[Path] = set()
_distrusted: set[Path] = set()       # directories said to be refused
_private: tempfile.TemporaryDirectory | None = None


def _ancestry(path: str) -> list[str]:
    """/, then each directory down to `path`, then `path`."""
    out, cur = ["/"], "/"
    for part in Path(path).parts[1:]:
        cur = os.path.join(cur, part)
        out.append(cur)
    return out


def _writable_by_others(st: os.stat_result) -> str | None:
    if st.st_mode & 0o022 and not (stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX):
        return f"writable by {'others' if st.st_mode & 0o002 else 'group'}"
    return None


def untrusted(path: Path | str) -> str | None:
    """Why this process may not trust `path` (someone else could have written it or can swap
    it), or None when it may. Missing paths are for the caller to handle (OSError)."""
    uid = os.geteuid()
    given = os.path.abspath(path)
    for p in dict.fromkeys(_ancestry(given) + _ancestry(os.path.realpath(given))):
        st = os.lstat(p)
        if st.st_uid not in (0, uid):
            return f"{p} is owned by uid {st.st_uid}"
        if stat.S_ISLNK(st.st_mode):
            continue
        if why := _writable_by_others(st):
            return f"{p} is {why}"
    return None


def _refuse(where: Path, why: str, instead: str) -> None:
    """Say once per directory that what is in it is not used."""
    if where not in _distrusted:
        _distrusted.add(where)
        print(f"profinfer: warning: not using what is in {where}: {why} (someone other than "
              f"root or this user could have put it there); {instead}", file=sys.stderr, flush=True)


def trusted(path: Path | str) -> bool:
    """Whether `path` exists and may be trusted; a refusal is said once per directory."""
    try:
        why = untrusted(path)
    except OSError:
        return False
    if why is None:
        return True
    _refuse(Path(path) if os.path.isdir(path) else Path(path).parent, why, "building a private copy")
    return False


_AFRESH = "working it out afresh"


def open_trusted(path: Path | str):
    """The cached file `path` open for reading (a binary file object) if it may be trusted as
    `trusted` says, else None (missing, or refused: said once per directory). What is checked
    is the open file itself (its owner, its mode, a regular file, no link: O_NOFOLLOW), and
    the directories on its way: what is read is what was checked."""
    path = Path(path)
    try:
        fd = procfs.open_file(str(path), nofollow=True)
    except FileNotFoundError:
        return None
    except OSError as e:
        _refuse(path.parent, f"{path} cannot be opened as a regular file ({e.strerror})", _AFRESH)
        return None
    try:
        st = os.fstat(fd)
        if st.st_uid not in (0, os.geteuid()):
            why = f"{path} is owned by uid {st.st_uid}"
        elif what := _writable_by_others(st):
            why = f"{path} is {what}"
        else:
            why = untrusted(path.parent)
    except OSError as e:
        why = f"{path.parent}: {e.strerror}"
    if why is not None:
        os.close(fd)
        _refuse(path.parent, why, _AFRESH)
        return None
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def load_trusted_json(path: Path | str, missing=None):
    """The JSON in the cached file `path` if open_trusted gives it, else `missing` (absent,
    refused, or not JSON)."""
    f = open_trusted(path)
    if f is None:
        return missing
    with f:
        try:
            return json.load(f)
        except ValueError:
            return missing


def load_trusted_dict(path: Path | str) -> dict:
    """The JSON object in the cached file `path` (load_trusted_json), else {}."""
    try:
        found = load_trusted_json(path)
    except OSError:
        return {}
    return found if isinstance(found, dict) else {}


def store_entry(path: Path | str, key: str, entry) -> None:
    """`entry` kept under `key` in the cached JSON object at `path` (its other keys as they are
    now), written whole under a temporary name and renamed: a reader sees the old file or the
    new one."""
    cache = load_trusted_dict(path)
    cache[key] = entry
    os.makedirs(os.path.dirname(path), exist_ok=True)
    write_json(path, cache, indent=2)


def write_json(path: Path | str, value, indent: int | None = None) -> None:
    """`value` as JSON at `path`, written whole under a temporary name and renamed: a
    concurrent reader sees the old file or the new one, never part of it."""
    fd, tmp = tempfile.mkstemp(prefix=f"{os.path.basename(path)}.", suffix=".tmp",
                               dir=os.path.dirname(path) or ".")    # a name of its own: threads may write at once
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(value, f, indent=indent)
        os.chmod(tmp, 0o644)        # as open() would have made it (mkstemp's are 0600)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def private_dir() -> Path:
    """A directory of this process's own, gone when it exits: for what a cache that cannot be
    written or trusted would have held (in the first trusted temporary directory)."""
    global _private
    if _private is None:
        base = next((d for d in (tempfile.gettempdir(), "/tmp", "/dev/shm") if trusted(d)), None)
        _private = tempfile.TemporaryDirectory(prefix="profinfer-", dir=base)
    return Path(_private.name)


def writable_dir(sub: str) -> Path | None:
    """cache_dir()/sub, made if missing; None where it cannot be written (a read-only root, a
    volume not mounted) or trusted: the caller then keeps what it would cache in memory or
    in private_dir(). Said once per directory, in one line: a cache is an optimisation, never
    a reason not to profile. A cache root of our own that others may write (a Kubernetes
    emptyDir is 0777) is closed to them first: what they could have put in it is refused by
    its owner."""
    root = cache_dir()
    path = root / sub
    if path in _unwritable:
        return None
    try:
        path.mkdir(parents=True, exist_ok=True)
        if not os.access(path, os.W_OK):
            raise PermissionError(f"{path} is not writable")
        for p in (root, path):       # each only once the way to it is trusted
            if untrusted(p.parent) is not None:
                break
            _close_to_others(p)
    except OSError as e:
        _unwritable.add(path)
        print(f"profinfer: warning: cache {path} cannot be written ({e.strerror or e}); "
              "keeping it in memory", file=sys.stderr, flush=True)
        return None
    if not trusted(path):
        _unwritable.add(path)
        return None
    return path


def _close_to_others(directory: Path) -> None:
    """`directory`, if it is our own and others may write it, closed to them: through a
    descriptor of that very directory (O_NOFOLLOW: a link is left alone, never its target,
    such as a user's link to /tmp), and never a shared sticky one (/tmp itself)."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):     # a link: for `trusted` to judge
            return
        raise
    try:
        st = os.fstat(fd)
        if st.st_uid == os.geteuid() and st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            os.fchmod(fd, stat.S_IMODE(st.st_mode) & ~0o022)
    finally:
        os.close(fd)


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
