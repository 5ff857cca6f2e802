"""The node's processes that a `record` follows, shared with every daemon on the node.

A record's follower stops a process at each exec and loader change until its probes are on;
a daemon's discovery stops processes that map an engine until it has looked at them. The
kernel does not count stops: the daemon's SIGCONT would let a recorded process run while the
record still attaches. So the followers keep their processes in one BPF map pinned in bpffs
(PIN_DIR/recorded), tgid -> start time (clock ticks since boot, /proc/PID/stat's 22nd field: a reused PID
is not taken for the process that had it), and discovery does not hold those (its BPF
`may_stop`, bpf/discover.bpf.c); the follower's BPF adds forked children and removes exited
processes (bpf/follow*.bpf.c). The map is an LRU: entries a crashed record left are dropped
in time, and match no later process meanwhile.

Only root can write it: the pin's folder is root's, mode 0700 (a pin found otherwise is not
trusted). Without bpffs at /sys/fs/bpf there is nothing to share: each side keeps a private
map and a daemon may hold a recorded process (said once by the daemon).
"""
from __future__ import annotations

import os
import stat
import sys
from typing import Callable

from profinfer.core import layout, libbpf, procfs
from profinfer.core.errors import ProfinferError

BPFFS = "/sys/fs/bpf"
PIN_DIR = f"{BPFFS}/profinfer"
MAP_NAME = "recorded"           # the objects' map (bpf/recorded.bpf.h), pinned by that name
_START_TIME_FIELD = 19          # procfs.stat_fields' index of field 22, starttime


def _shape() -> tuple[int, int, int, int]:
    consts = layout.parse(header="transport.h")[0]
    return libbpf.BPF_MAP_TYPE_LRU_HASH, 4, 8, consts["PI_MAX_RECORDED"]


def bpffs_mounted() -> bool:
    try:
        with open("/proc/self/mounts") as f:
            return any(line.split()[1:3] == [BPFFS, "bpf"] for line in f)
    except OSError:
        return False


def _root_only(path: str, folder: bool) -> str | None:
    """Why `path` may not be trusted (None: root's, and nobody else may write it)."""
    st = os.lstat(path)
    kind = stat.S_ISDIR(st.st_mode) if folder else stat.S_ISREG(st.st_mode)
    if not kind or st.st_uid != 0 or st.st_mode & (0o077 if folder else 0o022):
        return f"{path} is not root's alone (mode {stat.filemode(st.st_mode)}, uid {st.st_uid})"
    return None


def open_shared(warn: Callable[[str], None], pin_dir: str = PIN_DIR) -> int | None:
    """A descriptor of the node's map, made and pinned if none is; None where it cannot be
    shared (no bpffs: silently; otherwise said by `warn`). pin_dir: the tests' own."""
    if not bpffs_mounted() or os.sysconf("SC_CLK_TCK") != 100:   # transport.h's PI_NS_PER_TICK
        return None
    pin = f"{pin_dir}/{MAP_NAME}"
    try:
        os.mkdir(pin_dir, 0o700)
    except FileExistsError:
        pass
    except OSError as e:
        warn(f"cannot make {pin_dir} ({e.strerror}): a daemon on this node may hold recorded processes")
        return None
    try:
        why = _root_only(pin_dir, folder=True)
        for _ in range(3):          # another record or daemon may pin it between our two calls
            if why is not None:
                break
            try:
                fd = libbpf.pinned(pin)
            except FileNotFoundError:
                fd = _create_and_pin(pin)
                if fd is None:
                    continue
                return fd
            why = _root_only(pin, folder=False)
            if why is None and libbpf.map_shape(fd) == _shape():
                return fd
            os.close(fd)
            if why is None:         # another version's: ours replaces it (its users keep theirs)
                warn(f"{pin} was made by another version of profinfer: replaced")
                os.unlink(pin)
        else:
            why = f"{pin} keeps changing"
    except (OSError, ProfinferError) as e:
        why = str(e)
    warn(f"{why}: not used; a daemon on this node may hold recorded processes")
    return None


def _create_and_pin(pin: str) -> int | None:
    kind, key, value, entries = _shape()
    fd = libbpf.create_map(kind, MAP_NAME, key, value, entries)   # reuse_fd takes its name
    try:
        libbpf.pin(fd, pin)
    except FileExistsError:
        os.close(fd)
        return None
    os.chmod(pin, 0o600)
    return fd


def start_time(pid: int) -> int | None:
    """The process's start time as `recorded` holds it; None once it is gone."""
    fields = procfs.stat_fields(pid)
    return int(fields[_START_TIME_FIELD]) if fields and len(fields) > _START_TIME_FIELD else None


def add(fd: int, pid: int) -> None:
    start = start_time(pid)
    if start is not None:
        libbpf.map_update(fd, pid.to_bytes(4, "little"), start.to_bytes(8, "little"))


def remove(fd: int, pid: int) -> None:
    """Remove `pid` unless it is another process now (whose PID may be another record's)."""
    key = pid.to_bytes(4, "little")
    value = libbpf.map_lookup(fd, key, 8)
    start = start_time(pid)
    if value is not None and (start is None or int.from_bytes(value, "little") == start):
        libbpf.map_delete(fd, key)


def main() -> int:
    """Make the node's map, or find it made: a service manager's privileged step before a
    sandboxed daemon, which opens it but cannot pin it where /sys/fs/bpf is read-only to it
    (systemd's ProtectKernelTunables). Says why not, and exits 0 all the same."""
    said: list[str] = []
    fd = open_shared(said.append)
    for line in said:
        print(f"profinfer: {line}", file=sys.stderr)
    if fd is not None:
        os.close(fd)
    return 0


if __name__ == "__main__":
    sys.exit(main())
