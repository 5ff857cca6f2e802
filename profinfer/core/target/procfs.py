"""Open a file another process names, inside that process's root, without following anything
it controls out of that root, and hand the kernel that very file.

A watched process may be a tenant's container: paths it maps (/proc/PID/maps) are reached
through /proc/PID/root, where a plain open() resolves an absolute symlink against *our* root,
follows `..` out of it, and blocks on a FIFO. Here:

- `/proc/PID/root/<rest>` is opened with openat2(RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS)
  against an O_PATH descriptor of /proc/PID/root: symlinks (the last component's too: a
  loader's PT_INTERP, a debug file's build-id link) and `..` resolve inside the target's root,
  /proc magic links are refused; it must be a regular file. A path read from /proc/PID/maps
  is the file's own (the kernel's name for it), so it is opened with O_NOFOLLOW as well.
- `/proc/PID/map_files/<range>` (a mapping whose file was deleted or replaced) is the mapped
  file itself, as the kernel names it; it must be a regular file too.
- Anything else is a path of our own (a process we started): opened as it is, a regular file.

Every one is first opened O_PATH, which runs no driver's open: a tenant with CAP_MKNOD (the
default in Docker and containerd) can put a device node at any of these paths, and opening a
watchdog's node arms it. Only a regular file is then opened for reading, through the O_PATH
descriptor (/proc/self/fd/N: that very inode, nothing resolved again), O_NONBLOCK.

`pinned` gives a path the kernel resolves to the open descriptor (/proc/self/fd/N): a uprobe
is attached to the file that was opened and checked, never to a path resolved again, and
only if it is the file the probe's offsets were read from. For a
path inside a target's root the file must also be one the process maps, by (device, inode)
as /proc/PID/maps shows them.

Permissions (bench/results.md): opening /proc/PID/root of a process whose capabilities
are not a subset of ours, or of another user, needs CAP_SYS_PTRACE (the magic link's ptrace
check); /proc/PID/map_files needs CAP_CHECKPOINT_RESTORE (or CAP_SYS_ADMIN) as well.
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import itertools
import os
import platform
import re
import signal
import stat
from dataclasses import dataclass

from profinfer.core.base.errors import ProfinferError

_libc = ctypes.CDLL(None, use_errno=True)
_SYS_OPENAT2 = {"x86_64": 437, "aarch64": 437}.get(platform.machine(), 437)
RESOLVE_NO_XDEV = 0x01
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_BENEATH = 0x08
RESOLVE_IN_ROOT = 0x10

# matched whole (fullmatch, DOTALL): a tenant's path may hold a newline, before which `$`
# would stop and `.` would not reach, so that it fell through to a plain open of a host path
ROOT_PATH = re.compile(r"/proc/(\d+)/root(/.*)", re.DOTALL)
MAP_FILES_PATH = re.compile(r"/proc/\d+/map_files/[0-9a-f]+-[0-9a-f]+")
# pid -> a descriptor of its root, and a /proc/PID/map_files/... path -> an O_PATH descriptor
# of that file, given by whoever asked for the reading (the parse worker's daemon: the
# worker, confined, may open neither itself): descriptors_given
_GIVEN: dict[int | str, int] = {}


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


def openat2(dirfd: int, path: str, flags: int, resolve: int) -> int:
    """openat2(2) (Linux 5.6); OSError as os.open raises it."""
    how = _OpenHow(flags, 0, resolve)
    fd = _libc.syscall(_SYS_OPENAT2, dirfd, os.fsencode(path), ctypes.byref(how), ctypes.sizeof(how))
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), path)
    return fd


_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0)
_PATH_FLAGS = os.O_PATH | os.O_CLOEXEC


def open_in_root(pid: int, path: str, nofollow: bool = False) -> int:
    """`path` (absolute, as process `pid` sees it) opened inside its root: a regular file's
    descriptor, or OSError (ELOOP for a magic link, or with nofollow a symlink as the last
    component; EINVAL for what is not a regular file)."""
    full = f"/proc/{pid}/root{path}"         # what an error names
    given = _GIVEN.get(pid)
    if given is not None:
        root = os.dup(given)
    else:
        root = os.open(f"/proc/{pid}/root", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fd = openat2(root, path.lstrip("/") or ".", _PATH_FLAGS | (os.O_NOFOLLOW if nofollow else 0),
                     RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS)
    except OSError as e:
        raise OSError(e.errno, e.strerror, full) from None
    finally:
        os.close(root)
    return _regular(fd, full)


@contextlib.contextmanager
def descriptors_given(given: dict[int | str, int]):
    """Within: each process's root (pid -> a descriptor, closed after) used for its
    /proc/PID/root/... paths instead of opening /proc/PID/root, and each mapped file's
    (its /proc/PID/map_files/... path -> a descriptor) instead of opening that path."""
    _GIVEN.update(given)
    try:
        yield
    finally:
        for key, fd in given.items():
            _GIVEN.pop(key, None)
            os.close(fd)


def _regular(fd: int, path: str) -> int:
    """The O_PATH descriptor `fd` (closed here) opened for reading if it is a regular file:
    the same inode, checked, never a device's open run first."""
    try:
        st = os.fstat(fd)
        if stat.S_ISLNK(st.st_mode):        # O_PATH | O_NOFOLLOW gives the link itself
            raise OSError(errno.ELOOP, "a symbolic link", path)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", path)
        readable = os.open(f"/proc/self/fd/{fd}", _FLAGS)
    finally:
        os.close(fd)
    again = os.fstat(readable)
    if (again.st_dev, again.st_ino) != (st.st_dev, st.st_ino):    # cannot happen: same file
        os.close(readable)
        raise OSError(errno.ESTALE, "reopened as another file", path)
    return readable


def root_of(path: str) -> str | None:
    """/proc/PID/root for a path reached through another process (its root, its
    map_files), else None."""
    m = re.match(r"^/proc/(\d+)/(?:root|map_files)/", path)
    return f"/proc/{m.group(1)}/root" if m else None


def open_file(path: str, nofollow: bool = False) -> int:
    """A descriptor of the regular file `path` names: inside the target's root for
    /proc/PID/root/..., the mapped file for /proc/PID/map_files/..., else our own path."""
    m = ROOT_PATH.fullmatch(path)
    if m:
        return open_in_root(int(m.group(1)), m.group(2), nofollow)
    given = _GIVEN.get(path)          # a mapped file's descriptor, given (descriptors_given)
    if given is not None:
        return _regular(os.dup(given), path)
    return _regular(os.open(path, _PATH_FLAGS | (os.O_NOFOLLOW if nofollow else 0)), path)


def open_binary(path: str):
    """open_file as a binary file object (reads block normally: it is a regular file)."""
    fd = open_file(path)
    try:
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_regular(path: str, limit: int | None = None) -> bytes:
    """The bytes of the regular file `path` names (open_file: a FIFO, a device or a directory
    is refused, never waited on or read without end); OSError, or EFBIG past `limit` bytes."""
    with open_binary(path) as f:
        data = f.read() if limit is None else f.read(limit + 1)
    if limit is not None and len(data) > limit:
        raise OSError(errno.EFBIG, f"larger than {limit:,} bytes", path)
    return data


def stat_file(path: str, nofollow: bool = False) -> os.stat_result:
    """fstat of what open_file opens (the file we would read, not a path resolved again)."""
    fd = open_file(path, nofollow)
    try:
        return os.fstat(fd)
    finally:
        os.close(fd)


@dataclass(frozen=True, slots=True)
class FileMapping:
    start: int
    end: int
    perms: str
    offset: int      # in the file
    dev: int         # as stat gives it
    inode: int
    path: str        # as the process sees it, " (deleted)" dropped
    deleted: bool

    @property
    def span(self) -> str:
        """The address range as /proc/PID/maps writes it."""
        return f"{self.start:08x}-{self.end:08x}"


# A process's maps are its own to grow: up to vm.max_map_count (65530) mappings, each under a
# path of up to 4 KiB, some 250 MiB of text. Read at most this much of it, a line at a time
# (a vLLM process's are ~50 KiB: bench/results.md), and at most MAX_FILE_MAPPINGS mappings of
# files, each path kept once however many name it; what lies past either is not seen, the
# process's own loss (an engine it maps there is not found).
MAPS_READ_BYTES = 8 << 20
MAX_FILE_MAPPINGS = 16384


class FileMappings(list):
    """The mappings of files a maps text shows, in its order; `cut`: it went on past the
    bounds above."""
    cut = False


def read_maps(pid: int) -> FileMappings:
    """The process's mappings of files, as /proc/PID/maps shows them (the one place it is
    read), within the bounds above; OSError as open raises it."""
    with open(f"/proc/{pid}/maps", "rb") as f:
        return parse_maps(f)


def parse_maps(lines) -> FileMappings:
    """The mappings of files in a maps text's lines (bytes, as the kernel writes them), in
    its order, within the bounds above."""
    out, paths, perms, read = FileMappings(), {}, {}, 0
    for line in lines:
        read += len(line)
        if read > MAPS_READ_BYTES or len(out) >= MAX_FILE_MAPPINGS:
            out.cut = True
            break
        parts = line.rstrip(b"\n").split(None, 5)
        if len(parts) < 6 or not parts[5].startswith(b"/"):
            continue
        start, end = (int(x, 16) for x in parts[0].split(b"-"))
        major, minor = (int(x, 16) for x in parts[3].split(b":"))
        named = os.fsdecode(parts[5])
        path = named.removesuffix(" (deleted)")
        path = paths.setdefault(path, path)
        out.append(FileMapping(start, end, perms.setdefault(parts[1], parts[1].decode()),
                               int(parts[2], 16), os.makedev(major, minor), int(parts[4]), path,
                               path != named))
    return out


def file_mappings(pid: int) -> FileMappings:
    """The process's mappings of files (read_maps); none once it has gone."""
    try:
        return read_maps(pid)
    except OSError:
        return FileMappings()


def stat_fields(pid: int | str) -> list[str] | None:
    """/proc/PID/stat's fields after the command name (the state first: index 0 is the
    man page's field 3); None when unreadable. pid may be "PID/task/TID": a thread's."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def process_stat(pid: int) -> tuple[int, int] | None:
    """(start time in clock ticks since boot: a pid's identity with its number; virtual
    memory size: what a new mapping changes); None once it has exited (a zombie not yet
    reaped included)."""
    fields = stat_fields(pid)
    if fields is None or len(fields) < 21 or fields[0] in ("Z", "X"):
        return None
    return int(fields[19]), int(fields[20])


def exit_fd(pid: int, start: int) -> int:
    """An fd that polls readable when the process (pid, start) exits; -1 where the kernel
    has no pidfd (before 5.3: an exit is then seen when next looked for)."""
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        return -1
    st = process_stat(pid)
    if st is None or st[0] != start:      # another process by now
        os.close(fd)
        return -1
    return fd


def signal_process(pid: int, start: int, sig: int) -> bool:
    """Send `sig` to the process (pid, start) through a pidfd: never to a later process given
    its PID (the start time is checked on the pidfd's process, which keeps its PID until the
    fd is closed). Whether it was sent; False once it has exited. Before Linux 5.3 (no
    pidfd), by PID after the same check."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return False
    except (AttributeError, OSError):
        fd = -1
    try:
        st = process_stat(pid)
        if st is None or st[0] != start:      # another process by now
            return False
        if fd >= 0:
            signal.pidfd_send_signal(fd, sig)
        else:
            os.kill(pid, sig)
        return True
    except ProcessLookupError:
        return False
    finally:
        if fd >= 0:
            os.close(fd)


def first_entries(path: str, limit: int) -> list[str]:
    """The first `limit` names of a directory (a process's /proc/PID/fd or task: their
    number is a tenant's to choose, a million open files or threads), read lazily: the rest
    never listed. OSError as os.scandir raises it."""
    with os.scandir(path) as it:
        return [e.name for e in itertools.islice(it, limit)]


def mapped_identities(pid: int) -> set[tuple[int, int]]:
    """(device, inode) of every file the process maps (as its maps show them)."""
    return {(m.dev, m.inode) for m in file_mappings(pid)}


def check_mapped(fd: int, pid: int, path: str) -> None:
    """The open file must be one the process maps (same device and inode)."""
    st = os.fstat(fd)
    if (st.st_dev, st.st_ino) not in mapped_identities(pid):
        raise ProfinferError(f"{path} in process {pid} is not a file it maps (replaced since, "
                             "or another file behind a link): not probed")


_READ_AS: dict[str, tuple[int, int]] = {}     # path -> (device, inode) its symbols came from
_READ_AS_LIMIT = 4096


def read_as(path: str, file_id: tuple[int, int]) -> None:
    """`path`'s symbols (and so a probe's offsets) were read from the file `file_id`: a probe
    on `path` must land in that file, not in whatever the path names when it is attached."""
    _READ_AS.pop(path, None)
    _READ_AS[path] = file_id
    if len(_READ_AS) > _READ_AS_LIMIT:
        _READ_AS.pop(next(iter(_READ_AS)))


_OWN_FD = re.compile(r"/proc/self/fd/\d+")


@contextlib.contextmanager
def pinned(path: str, file_id: tuple[int, int] | None = None):
    """A name the kernel resolves to the file `path` names, opened and checked as open_file
    does, /proc/self/fd/N, valid inside the block. A uprobe attached there stays on that
    inode after the block. For a target's root: a file the process maps. And the file the
    probe's offsets were read from: `file_id` (device, inode; ElfInfo.file_id) when the
    caller has it, else the one read_as recorded for `path`; a path with neither is refused
    (the record is bounded: one evicted must not let any file through). A /proc/self/fd/N
    of the caller's is the file it holds and read."""
    try:
        fd = open_file(path)
    except OSError as e:
        raise ProfinferError(f"cannot open {path} to probe it: {e.strerror}") from None
    try:
        m = ROOT_PATH.fullmatch(path)
        if m:
            check_mapped(fd, int(m.group(1)), m.group(2))
        st = os.fstat(fd)
        want = file_id if file_id and file_id != (0, 0) else _READ_AS.get(path)
        if want is None and not _OWN_FD.fullmatch(path):
            raise ProfinferError(f"{path}: which file its symbols were read from is not known "
                                 "(read long ago): not probed")
        if want is not None and want != (st.st_dev, st.st_ino):
            raise ProfinferError(f"{path} names another file than the one its symbols were read "
                                 "from (replaced since): not probed")
        yield f"/proc/self/fd/{fd}"
    finally:
        os.close(fd)
