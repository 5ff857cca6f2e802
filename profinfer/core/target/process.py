"""Find the inference engine's libraries inside a target process.

The target may live in another mount namespace (containers) and may map files that were
deleted and replaced on disk (upgrades): every path returned here is one the kernel resolves
to the very inode the process has mapped, so uprobes land in the code that actually runs.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from profinfer.core.target import procfs
from profinfer.core.base.errors import ProfinferError


@dataclass(frozen=True)
class MappedFile:
    path: str         # path as the target sees it (inside its mount namespace)
    host_path: str    # path we open and attach to (resolves to the mapped inode)
    inode: int
    deleted: bool


def process_exists(pid: int) -> bool:
    return os.path.exists(f"/proc/{pid}/status")


def process_name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


MAX_THREADS_NAMED = 4096    # the thread count is the process's (a tenant's) to choose


def thread_names(pid: int) -> dict[int, str]:
    names = {}
    try:
        for t in procfs.first_entries(f"/proc/{pid}/task", MAX_THREADS_NAMED):
            try:
                names[int(t)] = Path(f"/proc/{pid}/task/{t}/comm").read_text().strip()
            except OSError:
                pass
    except OSError:
        pass
    return names


def mapped_files(pid: int) -> list[MappedFile]:
    """Executable file mappings of `pid`, one entry per file."""
    try:
        mappings = procfs.read_maps(pid)
    except FileNotFoundError:
        raise ProfinferError(f"no process with PID {pid}") from None
    except PermissionError:
        why = ("the kernel refuses it to root here: the process is another user namespace's, this "
               "one lacks CAP_SYS_PTRACE (root in a container), or a security module (AppArmor, "
               "SELinux) denies it" if os.geteuid() == 0 else "run as root")
        raise ProfinferError(f"cannot read /proc/{pid}/maps: permission denied; {why}") from None
    seen: dict[str, MappedFile] = {}
    for m in mappings:
        if "x" not in m.perms or m.path in seen:
            continue
        seen[m.path] = MappedFile(m.path, host_path(pid, m.path, m.inode, m.span, m.deleted, m.dev),
                                  m.inode, m.deleted)
    return list(seen.values())


def file_key(path: str) -> tuple[int, int]:
    """(device, inode): one file however it is reached (uprobes belong to the inode); what
    procfs opens (inside a target's root: nothing followed out of it, no FIFO waited on)."""
    st = procfs.stat_file(path)
    return st.st_dev, st.st_ino


def host_path(pid: int, path: str, inode: int, span: str, deleted: bool, dev: int | None = None) -> str:
    """Where we open the mapped file: through the target's root, where a container's file is
    at the path it uses, when what that path names inside that root (procfs.open_file: no link
    followed out of it, a regular file) is the mapped file, by device (when given) and inode."""
    via_root = f"/proc/{pid}/root{path}"
    if not deleted:
        try:
            st = procfs.stat_file(via_root, nofollow=True)    # the kernel's name for it
            if st.st_ino == inode and (dev is None or st.st_dev == dev):
                return via_root
        except PermissionError:
            # not ours to open (no CAP_SYS_PTRACE for its root, no CAP_DAC_READ_SEARCH for
            # another user's directory): map_files needs both too; the error names the root
            return via_root
        except OSError:
            pass
    # Deleted or replaced since it was mapped: map_files names the mapped inode itself.
    return f"/proc/{pid}/map_files/{span}"


def cpus_of(pid: int) -> int:
    """CPUs the process may run on (its affinity), else the machine's."""
    try:
        return len(os.sched_getaffinity(pid))
    except OSError:
        return os.cpu_count() or 1


class ProcessInfo:
    """The thread names and file mappings of the processes a collector watches, the latest
    read of each: a process that exited (a zombie) has none, and keeps what it had."""

    def __init__(self):
        self.thread_names: dict[int, str] = {}
        self.mappings: dict[int, list[procfs.FileMapping]] = {}

    def refresh(self, pid: int, mappings: bool = True) -> None:
        names = thread_names(pid)
        if names:
            self.thread_names.update(names)
        if mappings:
            self.note_mappings(pid)

    def note_mappings(self, pid: int) -> list[procfs.FileMapping]:
        """Read the process's mappings now; the last ones read (they outlive the process)."""
        found = procfs.file_mappings(pid)
        if found:
            self.mappings[pid] = found
        return self.mappings.get(pid, [])

    def forget(self, pid: int) -> None:
        self.mappings.pop(pid, None)
