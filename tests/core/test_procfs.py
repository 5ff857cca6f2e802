"""Files a process names, opened inside its root (profinfer.core.target.procfs): a process in its own
mount namespace and root offers a symlink to a host file, a `..` way out, a FIFO, and a file
it does not map. None of them reaches the host's file, none blocks, and only a file it maps
can be probed."""
from __future__ import annotations

import errno
import os
import shutil
import stat
import struct
import subprocess
import sys
import ctypes
import time
from pathlib import Path

import pytest

from profinfer.core.target import procfs
from profinfer.core.base.errors import ProfinferError

HOST_FILE = Path("/etc/os-release")
DEBUG_FILE = "/usr/lib/debug/.build-id/ab/cdef0123.debug"


@pytest.fixture
def jailed(tmp_path):
    root = tmp_path / "root"
    (root / "bin").mkdir(parents=True)
    sleep = Path(shutil.which("sleep")).resolve()
    shutil.copy2(sleep, root / "bin" / "sleep")
    out = subprocess.run(["ldd", str(sleep)], capture_output=True, text=True, check=True).stdout
    for line in out.splitlines():
        parts = line.split()
        path = parts[2] if "=>" in parts and len(parts) > 2 else parts[0]
        if path.startswith("/"):
            dest = root / path.lstrip("/")
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(os.path.realpath(path), dest)
    (root / "etc").mkdir()
    (root / "etc" / "os-release").write_text("ID=jail\n")
    os.symlink(str(HOST_FILE), root / "abs-link")                  # absolute: its own /etc
    os.symlink("../../../../../../../../etc/os-release", root / "dotdot-link")
    os.symlink("/proc/self/root/etc/os-release", root / "magic-link")
    (root / "nl\n").mkdir()                          # a name with a newline in it (a PT_INTERP's)
    os.symlink(str(HOST_FILE), root / "nl\n" / "abs-link")
    os.mkfifo(root / "fifo")
    debug = root / DEBUG_FILE.lstrip("/")           # a device node where a debug file is looked for
    debug.parent.mkdir(parents=True)
    os.mknod(debug, stat.S_IFCHR | 0o600, os.makedev(1, 3))    # /dev/null's: harmless to open
    os.symlink(DEBUG_FILE, root / "dev-link")
    (root / "not-mapped").write_bytes(b"\x7fELF")
    proc = subprocess.Popen(["unshare", "--mount", "sh", "-c",
                             f"mount --make-rprivate / && mount --bind {root} {root} && cd {root} && "
                             "mkdir -p .host && pivot_root . .host && exec /bin/sleep 60"])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            if os.readlink(f"/proc/{proc.pid}/exe") == "/bin/sleep":
                break
        except OSError:
            pass
        time.sleep(0.05)
    yield proc.pid
    proc.kill()
    proc.wait()


def _read(path: str) -> bytes:
    with procfs.open_binary(path) as f:
        return f.read()


def test_links_resolve_inside_the_root(jailed):
    base = f"/proc/{jailed}/root"
    assert _read(f"{base}/etc/os-release") == b"ID=jail\n"
    assert _read(f"{base}/abs-link") == b"ID=jail\n"        # not the host's file
    assert _read(f"{base}/dotdot-link") == b"ID=jail\n"
    assert _read(f"{base}/nl\n/abs-link") == b"ID=jail\n"   # inside the root still
    with pytest.raises(OSError) as e:
        _read(f"{base}/magic-link")
    assert e.value.errno in (errno.ELOOP, errno.EXDEV, errno.ENOENT)
    with pytest.raises(OSError) as e:                        # a name from maps: no link at all
        procfs.open_file(f"{base}/abs-link", nofollow=True)
    assert e.value.errno == errno.ELOOP


def test_fifo_refused_at_once(jailed):
    t0 = time.monotonic()
    with pytest.raises(OSError) as e:
        _read(f"/proc/{jailed}/root/fifo")
    assert e.value.errno == errno.EINVAL and time.monotonic() - t0 < 1


class Opens:
    """Opens of one inode, as the kernel reports them (inotify IN_OPEN: an O_PATH descriptor
    runs no open and reports none)."""
    IN_OPEN = 0x20

    def __init__(self, path: Path):
        libc = ctypes.CDLL(None, use_errno=True)
        self.fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        assert self.fd >= 0 and libc.inotify_add_watch(self.fd, os.fsencode(path), self.IN_OPEN) >= 0

    def count(self) -> int:
        n = 0
        try:
            buf = os.read(self.fd, 65536)
        except BlockingIOError:
            return 0
        at = 0
        while at < len(buf):
            _, mask, _, length = struct.unpack_from("iIII", buf, at)
            n += bool(mask & self.IN_OPEN)
            at += 16 + length
        return n


def test_a_device_node_is_never_opened(jailed, tmp_path):
    """A tenant with CAP_MKNOD puts a character device where a debug file is looked for (and a
    link to it): refused as not a regular file without its driver's open ever running (for a
    watchdog that open arms it). Truth: the kernel's open events on the node."""
    node = tmp_path / "root" / DEBUG_FILE.lstrip("/")
    opens = Opens(node)
    os.close(os.open(node, os.O_RDONLY))
    assert opens.count() == 1                       # the watch sees a real open
    for path in (f"/proc/{jailed}/root{DEBUG_FILE}", f"/proc/{jailed}/root/dev-link", str(node)):
        for call in (procfs.open_file, procfs.stat_file, _read):
            with pytest.raises(OSError) as e:
                call(path)
            assert e.value.errno == errno.EINVAL, (call, path)
    with pytest.raises(ProfinferError, match="cannot open"):
        with procfs.pinned(f"/proc/{jailed}/root{DEBUG_FILE}"):
            pass
    assert opens.count() == 0
    os.close(procfs.open_file(f"/proc/{jailed}/root/etc/os-release"))     # a regular file still opens


def test_only_a_mapped_file_is_pinned(jailed):
    from profinfer.core.target.symbols import load_elf
    load_elf(f"/proc/{jailed}/root/bin/sleep")         # a probe's offsets come from its symbols
    with procfs.pinned(f"/proc/{jailed}/root/bin/sleep") as name:
        assert name.startswith("/proc/self/fd/")
        st = os.stat(name)
        assert (st.st_dev, st.st_ino) in procfs.mapped_identities(jailed)
    with pytest.raises(ProfinferError, match="not a file it maps"):
        with procfs.pinned(f"/proc/{jailed}/root/not-mapped"):
            pass
    with pytest.raises(ProfinferError, match="cannot open"):
        with procfs.pinned(f"/proc/{jailed}/root/fifo"):
            pass


def _swap_for_libc(jailed, tmp_path) -> str:
    """The process puts its C library (a file it maps) at its executable's path."""
    path = f"/proc/{jailed}/root/bin/sleep"
    libc = next(m.path for m in procfs.file_mappings(jailed) if "/libc.so" in m.path)
    root = tmp_path / "root"
    os.rename(root / "bin" / "sleep", root / "bin" / "sleep.old")
    os.link(root / libc.lstrip("/"), root / "bin" / "sleep")
    st = os.stat(root / "bin" / "sleep")
    assert (st.st_dev, st.st_ino) in procfs.mapped_identities(jailed)       # a file it maps
    old = os.stat(root / "bin" / "sleep.old")
    assert (st.st_dev, st.st_ino) != (old.st_dev, old.st_ino)
    return path


def test_a_probe_lands_in_the_file_its_symbols_came_from(jailed, tmp_path):
    """The process maps its executable and its C library. Once the executable's symbols are
    read, the process puts its C library at the executable's path: a file it maps, but not
    the one the probe's offsets came from. It is not pinned."""
    from profinfer.core.target.symbols import Symbol, load_elf
    elf = load_elf(f"/proc/{jailed}/root/bin/sleep")
    path = _swap_for_libc(jailed, tmp_path)
    with pytest.raises(ProfinferError, match="another file than the one its symbols were read"):
        with procfs.pinned(path):
            pass
    with pytest.raises(ProfinferError, match="replaced since"):            # nor its code read
        elf.code_bytes(Symbol("start", 0, 16, 0), 16)


def test_a_probe_is_refused_once_the_record_of_its_file_is_gone(jailed, tmp_path):
    """As above, and then the daemon reads the symbols of many other files (a busy node):
    what path -> file it remembers is bounded, and this path's record is dropped. The swapped
    file is still not pinned: not by the path alone, nor with the file the caller read."""
    from profinfer.core.target.symbols import load_elf
    elf = load_elf(f"/proc/{jailed}/root/bin/sleep")
    path = _swap_for_libc(jailed, tmp_path)
    for i in range(procfs._READ_AS_LIMIT):      # as load_elf records each file it reads
        procfs.read_as(f"/proc/1/root/other/{i}", (0, i))
    with pytest.raises(ProfinferError, match="not known"):
        with procfs.pinned(path):
            pass
    with pytest.raises(ProfinferError, match="another file than the one its symbols were read"):
        with procfs.pinned(path, elf.file_id):
            pass
    os.rename(tmp_path / "root" / "bin" / "sleep.old", tmp_path / "root" / "bin" / "sleep")
    with procfs.pinned(path, elf.file_id) as name:                          # its own file: pinned
        st = os.stat(name)
        assert (st.st_dev, st.st_ino) == elf.file_id


def test_one_reader_of_maps_and_stat(tmp_path):
    """The maps parser against the kernel's own text for this process (the file this test's
    interpreter runs is mapped, by its inode), and stat's fields after the command name
    (a name with a space and a parenthesis in it cannot shift them)."""
    import sys
    text = Path(f"/proc/{os.getpid()}/maps").read_text()       # the kernel's own text
    mappings = procfs.file_mappings(os.getpid())
    exe = os.path.realpath(sys.executable)
    st = os.stat(exe)
    mine = [m for m in mappings if m.path == exe]
    assert mine and all((m.dev, m.inode) == (st.st_dev, st.st_ino) for m in mine)
    assert all(m.span in text for m in mine)                 # as the kernel writes the range
    assert len(mappings) == sum(1 for line in text.splitlines() if " /" in line)
    oddly_named = tmp_path / "a) b ("              # its command name, as comm shows it
    oddly_named.symlink_to(shutil.which("sleep"))
    holder = subprocess.Popen([str(oddly_named), "30"])
    try:
        deadline = time.monotonic() + 10          # until it has exec'd
        while Path(f"/proc/{holder.pid}/comm").read_text().strip() != "a) b (":
            assert time.monotonic() < deadline
            time.sleep(0.01)
        fields = procfs.stat_fields(holder.pid)
        assert fields[0] in "SR" and int(fields[1]) == os.getpid()      # state, ppid
    finally:
        holder.kill()
        holder.wait()
    assert procfs.stat_fields(holder.pid) is None            # reaped: gone
    assert procfs.file_mappings(holder.pid) == []


def _stopped(pid: int) -> bool:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"


def test_a_signal_reaches_the_process_named_not_a_later_one_with_its_pid():
    """A process exits and a later one is given its PID (the kernel's ns_last_pid set so,
    as PID reuse does on a busy node): a signal meant for the first, by (pid, start time),
    is not sent; one meant for the second is, through a pidfd."""
    import signal
    first = subprocess.Popen(["sleep", "60"])
    pid = first.pid
    start = procfs.process_stat(pid)[0]
    first.kill()
    first.wait()
    time.sleep(0.05)            # a start time later by whole clock ticks (10 ms)
    later = None
    for _ in range(50):         # the PID given again: other forks on the machine may take it first
        Path("/proc/sys/kernel/ns_last_pid").write_text(str(pid - 1))
        p = subprocess.Popen(["sleep", "60"])
        if p.pid == pid:
            later = p
            break
        p.kill()
        p.wait()
    assert later is not None, f"PID {pid} was not given again in 50 forks"
    try:
        later_start = procfs.process_stat(pid)[0]
        assert later_start != start
        assert procfs.signal_process(pid, start, signal.SIGSTOP) is False
        time.sleep(0.1)
        assert not _stopped(pid)
        assert procfs.signal_process(pid, later_start, signal.SIGSTOP) is True
        deadline = time.monotonic() + 5
        while not _stopped(pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _stopped(pid)
    finally:
        later.kill()
        later.wait()
    assert procfs.signal_process(pid, later_start, signal.SIGCONT) is False     # gone


def test_many_open_files_are_listed_no_further_than_asked():
    """A process with 19,000 open descriptors (its own choice, as a tenant's; a million where
    the hard limit allows, this VM's is 20,000): the daemon's listing of them (a model file
    among its first ones) stops at what it asks for, while a whole listing names every one."""
    code = ("import os, resource, sys; hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]; "
            "resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard)); "
            "fd = os.open('/dev/null', os.O_RDONLY); [os.dup(fd) for _ in range(19000)]; "
            "print('ready', flush=True); sys.stdin.read()")
    p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        t0 = time.monotonic()
        first = procfs.first_entries(f"/proc/{p.pid}/fd", 4096)
        took = time.monotonic() - t0
        assert len(first) == 4096 and all(name.isdigit() for name in first)
        t0 = time.monotonic()
        assert len(os.listdir(f"/proc/{p.pid}/fd")) > 19000
        print(f"first 4096: {took * 1e3:.1f} ms; all: {(time.monotonic() - t0) * 1e3:.1f} ms")
    finally:
        p.kill()
        p.wait()
