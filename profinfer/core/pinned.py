"""BPF maps pinned in bpffs for every profinfer on the node (a record's followed processes,
the processes a daemon's discovery holds): made once, found by the others, outliving each.

Only root can write them: their folder is root's, mode 0700 (a pin found otherwise is not
trusted), and a pin of another shape (another version's) is replaced, its users keeping theirs.
"""
from __future__ import annotations

import ctypes
import os
import stat
from typing import Callable

from profinfer.core import libbpf
from profinfer.core.errors import ProfinferError

BPFFS = "/sys/fs/bpf"
PIN_DIR = f"{BPFFS}/profinfer"
_libc = ctypes.CDLL(None, use_errno=True)


def bpffs_mounted() -> bool:
    try:
        with open("/proc/self/mounts") as f:
            return any(line.split()[1:3] == [BPFFS, "bpf"] for line in f)
    except OSError:
        return False


def mount_bpffs() -> str | None:
    """bpffs mounted at BPFFS where nothing is (an empty folder), as systemd mounts it at boot
    and bpftool at a pin (mode 0700): a host whose init did not (a minimal VM's) still shares
    the node's maps. Why not, or None when it is there."""
    if bpffs_mounted():
        return None
    try:
        if os.listdir(BPFFS):
            return f"{BPFFS} holds files but no bpffs"
    except OSError as e:
        return f"{BPFFS}: {e.strerror}"
    if _libc.mount(b"bpf", BPFFS.encode(), b"bpf", 0, b"mode=0700") != 0:
        return f"cannot mount bpffs at {BPFFS}: {os.strerror(ctypes.get_errno())}"
    return None


def _root_only(path: str, folder: bool) -> str | None:
    """Why `path` may not be trusted (None: root's, and nobody else may write it)."""
    st = os.lstat(path)
    kind = stat.S_ISDIR(st.st_mode) if folder else stat.S_ISREG(st.st_mode)
    if not kind or st.st_uid != 0 or st.st_mode & (0o077 if folder else 0o022):
        return f"{path} is not root's alone (mode {stat.filemode(st.st_mode)}, uid {st.st_uid})"
    return None


def open_shared(name: str, shape: tuple[int, int, int, int], warn: Callable[[str], None],
                without: str, pin_dir: str = PIN_DIR) -> int | None:
    """A descriptor of the node's map `name` of `shape` (kind, key size, value size, entries),
    made and pinned if none is (bpffs mounted first where it is not: mount_bpffs); None where
    it cannot be shared (no bpffs: silently, the caller says what that costs; otherwise said by
    `warn`, with `without`: what that costs). pin_dir: the tests' own."""
    if mount_bpffs() is not None:
        return None
    pin = f"{pin_dir}/{name}"
    try:
        os.mkdir(pin_dir, 0o700)
    except FileExistsError:
        pass
    except OSError as e:
        warn(f"cannot make {pin_dir} ({e.strerror}): {without}")
        return None
    try:
        why = _root_only(pin_dir, folder=True)
        for _ in range(3):          # another record or daemon may pin it between our two calls
            if why is not None:
                break
            try:
                fd = libbpf.pinned(pin)
            except FileNotFoundError:
                fd = _create_and_pin(pin, name, shape)
                if fd is None:
                    continue
                return fd
            why = _root_only(pin, folder=False)
            if why is None and libbpf.map_shape(fd) == shape:
                return fd
            os.close(fd)
            if why is None:         # another version's: ours replaces it (its users keep theirs)
                warn(f"{pin} was made by another version of profinfer: replaced")
                os.unlink(pin)
        else:
            why = f"{pin} keeps changing"
    except (OSError, ProfinferError) as e:
        why = str(e)
    warn(f"{why}: not used; {without}")
    return None


def _create_and_pin(pin: str, name: str, shape: tuple[int, int, int, int]) -> int | None:
    kind, key, value, entries = shape
    fd = libbpf.create_map(kind, name, key, value, entries)   # reuse_fd takes its name
    try:
        libbpf.pin(fd, pin)
    except FileExistsError:
        os.close(fd)
        return None
    os.chmod(pin, 0o600)
    return fd

