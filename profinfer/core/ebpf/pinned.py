"""BPF maps pinned in bpffs for every profinfer on the node (a record's followed processes,
the processes a daemon's discovery holds): made once, found by the others, outliving each.

Only root can write them: their folder is root's, mode 0700 (a pin found otherwise is not
trusted), and a pin of another shape (another version's) is replaced, its users keeping theirs;
where its entries still matter, it stays pinned under another name (REPLACED).
"""
from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import stat
import time
from typing import Callable

from profinfer.core.ebpf import kernel, libbpf
from profinfer.core.target import procfs
from profinfer.core.base.errors import ProfinferError

BPFFS = "/sys/fs/bpf"
PIN_DIR = f"{BPFFS}/profinfer"
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
MS_NOSUID, MS_NODEV, MS_NOEXEC = 2, 4, 8
LOCK_WAIT_S = 10               # the pin folder's lock is held for a few calls: one held longer is stuck
REPLACED = "_replaced_"        # NAME_replaced_MAP_ID: another version's map of NAME, kept (bpffs refuses dots)


def bpffs_mounted() -> bool:
    try:
        with open("/proc/self/mounts") as f:
            return any(line.split()[1:3] == [BPFFS, "bpf"] for line in f)
    except OSError:
        return False


def mount_bpffs() -> tuple[bool, str | None]:
    """bpffs mounted at BPFFS where nothing is (an empty folder), as systemd mounts it at boot
    and bpftool at a pin (mode 0700, nosuid, nodev, noexec): a host whose init did not (a
    minimal VM's) still shares the node's maps. Only in the host's mount namespace, where the
    mount is the one every process started from it sees (_not_the_hosts_mounts): in a
    container's own (a pod's hostPath) it would be the container's alone. The folder is
    locked around the look and the mount, so that two processes starting at once make one
    mount, not one hiding the other.
    (whether it was mounted now, why it is not there: None when it is)."""
    if bpffs_mounted():
        return False, None
    why = _not_the_hosts_mounts()
    if why is not None:
        return False, f"no bpffs at {BPFFS}, and {why}"
    try:
        fd = os.open(BPFFS, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as e:
        return False, f"no bpffs at {BPFFS}: {e.strerror}"
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        if bpffs_mounted():
            return False, None
        if os.listdir(fd):
            return False, f"{BPFFS} holds files but no bpffs"
        if _libc.mount(b"bpf", BPFFS.encode(), b"bpf", MS_NOSUID | MS_NODEV | MS_NOEXEC, b"mode=0700") != 0:
            return False, f"no bpffs at {BPFFS}, and it cannot be mounted: {os.strerror(ctypes.get_errno())}"
        return True, None
    except OSError as e:
        return False, f"no bpffs at {BPFFS}: {e.strerror}"
    finally:
        os.close(fd)


PF_KTHREAD = 0x00200000         # /proc/PID/stat's flags: a kernel thread


def _mount_ns(pid: int | str) -> int | None:
    try:
        return os.stat(f"/proc/{pid}/ns/mnt").st_ino
    except OSError:
        return None


def _is_kthreadd(pid: int) -> bool:
    """PID `pid` of the /proc here is the kernel's thread creator (a kernel thread, parent 0)."""
    fields = procfs.stat_fields(pid)
    try:
        with open(f"/proc/{pid}/comm") as f:
            name = f.read().strip()
    except OSError:
        return False
    return (name == "kthreadd" and fields is not None and len(fields) > 6 and fields[1] == "0"
            and int(fields[6]) & PF_KTHREAD != 0)


def _not_the_hosts_mounts() -> str | None:
    """Why this process's mount namespace may not be the host's (None: it is), where a bpffs
    mounted is every process's, not a container's alone. Only in the host's PID namespace (in
    another, PID 1 is a container's init, whose mounts are the container's); there, judged
    against PID 1's mount namespace, or where that cannot be read (a VM's init that is not
    dumpable, or holds capabilities we lack), against kthreadd's: a kernel thread always runs
    in the host's first mount namespace."""
    if not kernel.in_host_pid_namespace():
        return "this process is not in the host's PID namespace"
    mine = _mount_ns("self")
    if mine is None:
        return "this process's mount namespace cannot be read"
    init = _mount_ns(1)
    if init is not None:
        return None if init == mine else "this process is not in PID 1's mount namespace"
    if _is_kthreadd(2):
        kernel_ns = _mount_ns(2)
        if kernel_ns is not None:
            return None if kernel_ns == mine else "this process is not in the host's mount namespace"
    return "neither PID 1's nor a kernel thread's mount namespace can be read here (another PID namespace?)"


def _root_only(path: str, folder: bool) -> str | None:
    """Why `path` may not be trusted (None: root's, and nobody else may write it)."""
    st = os.lstat(path)
    kind = stat.S_ISDIR(st.st_mode) if folder else stat.S_ISREG(st.st_mode)
    if not kind or st.st_uid != 0 or st.st_mode & (0o077 if folder else 0o022):
        return f"{path} is not root's alone (mode {stat.filemode(st.st_mode)}, uid {st.st_uid})"
    return None


def open_shared(name: str, shape: tuple[int, int, int, int], warn: Callable[[str], None],
                without: str, pin_dir: str = PIN_DIR,
                keep: Callable[[int], bool] | None = None) -> int | None:
    """A descriptor of the node's map `name` of `shape` (kind, key size, value size, entries),
    made and pinned if none is (bpffs mounted first where it is not, and said: mount_bpffs);
    None where it cannot be shared (no bpffs: silently, the caller says what that costs;
    otherwise said by `warn`, with `without`: what that costs). keep: shown another
    version's map, True where it stays pinned as NAME_replaced_ID (replaced_pins) rather
    than unpinned. pin_dir: the tests' own. The folder is locked meanwhile: two replacers
    at once would each replace the other's."""
    mounted, why = mount_bpffs()
    if mounted:
        warn(f"mounted bpffs at {BPFFS} (there was none): the node's maps are shared there")
    if why is not None:
        return None
    pin = f"{pin_dir}/{name}"
    try:
        os.mkdir(pin_dir, 0o700)
    except FileExistsError:
        pass
    except OSError as e:
        warn(f"cannot make {pin_dir} ({e.strerror}): {without}")
        return None
    said: list[str] = []            # told once the folder is unlocked (a log may block)
    try:
        why = _root_only(pin_dir, folder=True)
        fd = None
        if why is None:
            with _folder_locked(pin_dir, said):
                fd, why = _find_or_make(pin, name, shape, keep, said)
    except (OSError, ProfinferError) as e:
        fd, why = None, str(e)
    for line in said:
        warn(line)
    if fd is None:
        warn(f"{why}: not used; {without}")
    return fd


@contextlib.contextmanager
def _folder_locked(pin_dir: str, said: list[str]):
    """The pin folder locked against other profinfers' replacing (two replacers at once
    would each replace the other's); where one holds it past LOCK_WAIT_S (stopped
    meanwhile), not waited for any longer: said, and done unlocked."""
    fd = os.open(pin_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        deadline = time.monotonic() + LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    said.append(f"{pin_dir} stayed locked by another profinfer for {LOCK_WAIT_S:g} s: "
                                "its maps opened without the lock")
                    break
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)


def _find_or_make(pin: str, name: str, shape: tuple[int, int, int, int],
                  keep: Callable[[int], bool] | None, said: list[str]) -> tuple[int | None, str | None]:
    """(a descriptor of the map pinned at `pin`, made and pinned if none is, another shape's
    replaced; None) or (None, why not)."""
    for _ in range(3):          # a profinfer that took no lock may pin it between our two calls
        try:
            fd = libbpf.pinned(pin)
        except FileNotFoundError:
            fd = _create_and_pin(pin, name, shape)
            if fd is None:
                continue
            return fd, None
        try:
            why = _root_only(pin, folder=False)
            if why is not None:
                return None, why
            if libbpf.map_shape(fd) == shape:
                ours, fd = fd, -1       # returned open, not closed below
                return ours, None
            # another version's: ours replaces it (its users keep theirs)
            map_id = libbpf.map_id(fd)
            kept = f"{pin}{REPLACED}{map_id}"
            wanted = keep is not None and keep(fd)
            if wanted and map_id is not None and not os.path.lexists(kept):
                os.rename(pin, kept)
                said.append(f"{pin} was made by another version of profinfer: replaced, kept as {kept}")
            else:
                os.unlink(pin)
                said.append(f"{pin} was made by another version of profinfer: replaced"
                            + (" (in a layout this version cannot read: what it holds is not looked "
                               "after here)" if keep is not None and not wanted else ""))
        except FileNotFoundError:   # replaced by another meanwhile: looked at again
            pass
        finally:
            if fd >= 0:
                os.close(fd)
    return None, f"{pin} keeps changing"


def replaced_pins(name: str, pin_dir: str = PIN_DIR) -> list[str]:
    """The pins of other versions' maps of `name` kept (open_shared's `keep`), those
    that may be trusted (root's alone, in a folder that is)."""
    try:
        if _root_only(pin_dir, folder=True) is not None:
            return []
        found = sorted(os.path.join(pin_dir, f) for f in os.listdir(pin_dir) if f.startswith(name + REPLACED))
        return [p for p in found if _root_only(p, folder=False) is None]
    except OSError:         # gone meanwhile: looked at on the next pass
        return []


def _create_and_pin(pin: str, name: str, shape: tuple[int, int, int, int]) -> int | None:
    kind, key, value, entries = shape
    fd = libbpf.create_map(kind, name, key, value, entries)   # reuse_fd takes its name
    try:
        libbpf.pin(fd, pin)
        os.chmod(pin, 0o600)
    except FileExistsError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return fd

