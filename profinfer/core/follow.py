"""Follow what a recorded command becomes: the images it exec's, the processes it forks, and
the libraries their dynamic loaders map later (dlopen), so that an engine is probed before
its first call however it is started (`env X=1 llama-cli`, a shell script, Python loading
libllama with ctypes in a child process).

The BPF side (bpf/follow.bpf.c) keeps the set of followed processes in the kernel and stops a
followed process (SIGSTOP) at each exec and each library-list change its loader announces;
`changes()` hands those stops to the caller, which attaches what the new code needs and then
calls `resume()`. Engine probes are attached to library files, for every process, and their
programs run only for the processes in the shared `followed` map. The followed processes are
also in the node's `recorded` map (profinfer.core.ebpf.followed), which a daemon's discovery reads
so as not to hold them as well.
"""
from __future__ import annotations

import ctypes
import os
import signal
from dataclasses import dataclass

import numpy as np

from profinfer.core.ebpf import bpfobj, layout, libbpf, followed
from profinfer.core.target import parsing, procfs
from profinfer.core.target.arch.callsites import direct_calls
from profinfer.core.target.elfheaders import elf_file
from profinfer.core.base.errors import ProfinferError
from profinfer.core.target.parsing import NotReady

parsing.preload(__name__)

# glibc's loader calls this empty function after each change of its library list (mapped,
# not yet relocated, constructors not yet run): the debuggers' r_debug breakpoint.
LOADER_HOOK = "_dl_debug_state"
# ...which it calls twice per change: with the r_debug (the debuggers' struct, `_r_debug`)
# r_state RT_ADD before the change is complete, and RT_CONSISTENT once every new library is
# mapped. A library's code runs only after the second.
R_DEBUG = "_r_debug"
R_STATE_OFFSET = 24           # struct r_debug { int; link_map *; ElfW(Addr); enum r_state; }
RT_CONSISTENT = 0
TRACEPOINT_PROGRAMS = ("follow_exec", "follow_exit")
FORK_PROGRAM = "follow_fork"          # its own object: CO-RE, needs the kernel's BTF
SHARED_MAPS = ("followed", "events", "lost")
LOADER_PROGRAM = "loader_changed"
RING_PAGES = 16
PERF_PAGES_PER_CPU = 8


@dataclass(frozen=True)
class Change:
    tgid: int
    what: str        # "exec", "mapped" (both: the process is stopped), "fork", "exit"
    child: int = 0   # fork: the new process


# One larger than this is not a loader we hook (glibc's: ~250 KiB); PT_INTERP is a path.
MAX_LOADER_BYTES = 4 << 20
MAX_INTERP_BYTES = 4096


def interpreter(pid: int) -> str | None:
    """The dynamic loader named by the process's executable (PT_INTERP), as a path inside its
    root (/proc/PID/root/...: open it with procfs, which resolves it there); None for a static
    executable, or one that cannot be read. (/proc/PID/exe is the kernel's link to the
    executable it runs: a regular file, not a path the process names.)"""
    try:
        with open(f"/proc/{pid}/exe", "rb") as f:
            for seg in elf_file(f).iter_segments():
                if seg.header.p_type == "PT_INTERP" and seg.header.p_filesz <= MAX_INTERP_BYTES:
                    name = os.fsdecode(seg.data().split(b"\0", 1)[0])
                    return f"/proc/{pid}/root{name}" if name.startswith("/") else None
    except Exception:       # anything a tenant's file makes the ELF reader raise
        return None
    return None


def _loader_symbols(file: str) -> tuple[tuple[int, int] | None, int | None]:
    """An x86-64 loader's hook ((vaddr, file offset) of _dl_debug_state) and _r_debug's vaddr,
    from its dynamic symbols; (None, None) for another machine or class."""
    with open(file, "rb") as f:
        elf = elf_file(f)
        if elf.elfclass != 64 or elf["e_machine"] != "EM_X86_64":
            return None, None
        dynsym = elf.get_section_by_name(".dynsym")
        if dynsym is None:
            return None, None
        hook, r_debug = dynsym.get_symbol_by_name(LOADER_HOOK), dynsym.get_symbol_by_name(R_DEBUG)
        if not hook:
            return None, None
        vaddr = hook[0]["st_value"]
        offset = next((vaddr - seg["p_vaddr"] + seg["p_offset"] for seg in elf.iter_segments()
                       if seg["p_type"] == "PT_LOAD" and seg["p_vaddr"] <= vaddr < seg["p_vaddr"] + seg["p_filesz"]),
                      None)
        if offset is None:
            return None, None
        return (vaddr, offset), (r_debug[0]["st_value"] if r_debug else None)


def read_loader(path: str) -> tuple[tuple[int, int], tuple[int, int] | None, int | None, list[tuple[int, int]]]:
    """A tenant's loader, read (in the parsing worker: parsing.run): the (device, inode) read,
    its hook and _r_debug (_loader_symbols), and the hook's call sites (none: (None, None,
    [])). One descriptor for all of it, opened inside the process's root."""
    fd = procfs.open_file(path)
    try:
        st = os.fstat(fd)
        if st.st_size > MAX_LOADER_BYTES:
            raise ProfinferError(f"{st.st_size >> 20} MiB, not a loader this reads")
        file = f"/proc/self/fd/{fd}"
        hook, r_debug = _loader_symbols(file)
        return (st.st_dev, st.st_ino), hook, r_debug, direct_calls(file, hook[0]) if hook else []
    finally:
        os.close(fd)


def _load_address(pid: int, file: tuple[int, int]) -> int | None:
    """Where `pid` mapped the start (file offset 0) of the file (device, inode)."""
    return next((m.start for m in procfs.file_mappings(pid)
                 if (m.dev, m.inode) == file and m.offset == 0), None)


class LoaderHooks:
    """glibc's loader hook (_dl_debug_state) probed with one program of an object, once per
    loader file, and whether a process stopped there has finished changing its library list."""

    def __init__(self, obj: libbpf.BpfObject, program: str, table: str | None = None, table_size: int = 0):
        """table: a map of the object where each probed site's vaddr and its loader's _r_debug
        vaddr are written, at the index the program gets as its attach cookie
        (bpf/discover.bpf.c)."""
        self.obj, self.program, self.table = obj, program, table
        self.table_size = table_size
        self._sites = 0
        self._loaders: dict[tuple[int, int], int | None] = {}   # loader file: _r_debug's vaddr
        self._r_state: dict[int, int | None] = {}    # process: its r_debug.r_state's address
        self._unhookable: set[tuple[int, int]] = set()   # loaders without the hook (not glibc's)

    def watch(self, pid: int) -> None:
        """Hook the dynamic loader of `pid`'s current image (once per loader file). The loader
        is opened once, inside the process's root, and must be a file the process maps; it is
        read away from the caller's loop (parsing.run: NotReady while it is, then ask again),
        and the probes go on that very descriptor, once the reading is found to be of it."""
        self._r_state.pop(pid, None)      # a new image: its loader is mapped anew
        path = interpreter(pid)
        if path is None:          # a static executable: nothing is loaded later
            return
        try:
            fd = procfs.open_file(path)
        except OSError as e:
            raise ProfinferError(f"cannot open the loader {path}: {e.strerror}") from None
        try:
            procfs.check_mapped(fd, pid, path)
            st = os.fstat(fd)
            key = (st.st_dev, st.st_ino)
            if key in self._loaders or key in self._unhookable:
                return
            if st.st_size > MAX_LOADER_BYTES:
                self._unhookable.add(key)
                raise ProfinferError(f"the dynamic loader {path} is {st.st_size >> 20} MiB, not a "
                                     "loader this reads: libraries it loads later are not followed")
            self._hook(f"/proc/self/fd/{fd}", key, path, (st.st_size, st.st_mtime_ns))
        finally:
            os.close(fd)

    def _hook(self, file: str, key: tuple[int, int], path: str, version: tuple[int, int]) -> None:
        try:
            read, hook, r_debug, sites = parsing.run(("loader", key, version), __name__, "read_loader", path)
        except NotReady:
            raise
        except Exception as e:      # a tenant's file: whatever reading it raised, or its deadline
            self._unhookable.add(key)
            raise ProfinferError(f"the dynamic loader {path} cannot be read: {e}") from None
        if read != key:           # the path names another file by now: looked at again later
            raise ProfinferError(f"the dynamic loader {path} was replaced while it was read")
        if hook is None:
            self._unhookable.add(key)     # said once per loader file
            raise ProfinferError(f"the dynamic loader {path} has no {LOADER_HOOK} (not glibc's, or "
                                 "not x86-64): libraries it loads later (dlopen) cannot be followed")
        # its callers' `call` instructions (emulated), else its own first one (a `ret`,
        # single-stepped: far dearer, in every process that uses this loader)
        sites = sites or [hook]
        if self.table is not None and self._sites + len(sites) > self.table_size:
            self._unhookable.add(key)
            raise ProfinferError(f"{path}: more loader hook sites than {self.table_size}: not hooked")
        links = []
        try:
            for vaddr, offset in sites:
                if self.table is None:
                    links.append(self.obj.attach_uprobe(self.program, file, offset, -1))
                    continue
                index = self._sites + len(links)
                libbpf.map_update(self.obj.map_fd(self.table), index.to_bytes(4, "little"),
                                  vaddr.to_bytes(8, "little") + (r_debug or 0).to_bytes(8, "little"))
                links.append(self.obj.attach_uprobe(self.program, file, offset, -1, cookie=index))
        except ProfinferError:
            self.obj.detach_links(links)        # all of its sites or none
            raise
        if self.table is not None:
            self._sites += len(links)
        self._loaders[key] = r_debug

    def forget(self, pid: int) -> None:
        self._r_state.pop(pid, None)

    def settled(self, pid: int) -> bool:
        """Whether `pid`'s loader, stopped at its hook, has finished changing its library list
        (True when that cannot be read: then every stop is looked at)."""
        if pid not in self._r_state:      # once per image: a stop per dlopen reads 4 bytes
            self._r_state[pid] = self._r_state_address(pid)
        address = self._r_state[pid]
        if address is None:
            return True
        try:
            with open(f"/proc/{pid}/mem", "rb") as mem:
                mem.seek(address)
                return int.from_bytes(mem.read(4), "little") == RT_CONSISTENT
        except (OSError, ValueError):
            return True

    def _r_state_address(self, pid: int) -> int | None:
        """Where `pid`'s loader keeps r_debug.r_state, or None."""
        path = interpreter(pid)
        try:
            st = procfs.stat_file(path) if path else None
            vaddr = self._loaders.get((st.st_dev, st.st_ino)) if st else None
            base = _load_address(pid, (st.st_dev, st.st_ino)) if vaddr is not None else None
        except OSError:
            return None
        return None if base is None else base + vaddr + R_STATE_OFFSET

    def __len__(self) -> int:
        return len(self._loaders)


class Follower:
    def __init__(self, root_pid: int, buffer: str, warn=lambda msg: None):
        consts, dt = layout.parse(header="transport.h")
        self._names = {consts[f"PI_FOLLOW_{w.upper()}"]: w for w in ("exec", "mapped", "fork", "exit")}
        self._dt = dt["pi_follow_event"]
        self.obj = libbpf.BpfObject(bpfobj.object_path("follow.bpf.c", buffer))
        self.fork_obj: libbpf.BpfObject | None = None
        self._records: list[bytes] = []
        self.loaders = LoaderHooks(self.obj, LOADER_PROGRAM)
        self.processes = {root_pid}     # every process followed so far
        self._live = {root_pid}         # those that have not exited (their PIDs are theirs)
        self.forks_followed = os.path.exists("/sys/kernel/btf/vmlinux")
        config = np.zeros(1, dt["pi_core_config"]).tobytes()   # common.bpf.h: the core's pi_config
        self.recorded_fd = followed.open_shared(warn)     # None: each object has its own
        try:
            self.obj.set_rodata(config)
            if self.recorded_fd is not None:
                self.obj.reuse_map(followed.MAP_NAME, self.recorded_fd)
            if buffer == "ring":
                self.obj.set_max_entries("events", RING_PAGES * 4096)
            self.obj.load(set(TRACEPOINT_PROGRAMS) | {LOADER_PROGRAM})
            self._follow(root_pid)
            if self.forks_followed:
                self.fork_obj = libbpf.BpfObject(bpfobj.object_path("follow_fork.bpf.c", buffer))
                self.fork_obj.set_rodata(config)
                for name in SHARED_MAPS + (followed.MAP_NAME,):
                    self.fork_obj.reuse_map(name, self.obj.map_fd(name))
                self.fork_obj.load({FORK_PROGRAM})
                self.fork_obj.attach(FORK_PROGRAM)
            for prog in TRACEPOINT_PROGRAMS:
                self.obj.attach(prog)
            if buffer == "perf":       # every record wakes the reader: a process waits on it
                self._buf = self.obj.perf_buffer("events", PERF_PAGES_PER_CPU, 1, self._on_record,
                                                 lambda n: None)
            else:
                self._buf = self.obj.ring_buffer("events", self._on_record)
        except ProfinferError:
            self.close()
            raise

    def _on_record(self, data, size):
        self._records.append(ctypes.string_at(data, size))

    def fileno(self) -> int:
        return self._buf.fileno()

    def followed_map_fd(self) -> int:
        return self.obj.map_fd("followed")

    def changes(self) -> list[Change]:
        """What happened to followed processes since the last call, in order."""
        self._buf.consume()
        records, self._records = self._records, []
        out = []
        for rec in records:
            ev = np.frombuffer(rec[: self._dt.itemsize], self._dt, count=1)[0]
            change = Change(int(ev["tgid"]), self._names.get(int(ev["what"]), "?"), int(ev["child"]))
            if change.what == "fork":
                self.processes.add(change.child)
                self._live.add(change.child)
            elif change.what == "exit":     # its PID may be given to another process
                self._live.discard(change.tgid)
                self.loaders.forget(change.tgid)
            out.append(change)
        return out

    def _follow(self, pid: int) -> None:
        libbpf.map_update(self.obj.map_fd("followed"), pid.to_bytes(4, "little"), (1).to_bytes(4, "little"))
        followed.add(self.obj.map_fd(followed.MAP_NAME), pid)

    def add(self, pid: int) -> None:
        """Follow a process that already runs (a descendant of an attached process)."""
        self._follow(pid)
        self.processes.add(pid)
        self._live.add(pid)

    @staticmethod
    def resume(pid: int) -> None:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass

    def close(self) -> None:
        """Detach, then let every followed process still alive go: none is left stopped,
        whatever happened before (an exited one's PID may be another process's now)."""
        for name in ("fork_obj", "obj"):      # no stop, fork or record from here on
            obj = getattr(self, name, None)
            if obj is not None:
                obj.detach()
        if getattr(self, "_buf", None) is not None and self.obj is not None:
            self.changes()          # forks and exits not read yet (a fork's child is live)
        if self.obj is not None:    # a daemon may hold them from now on
            for pid in self._live:
                followed.remove(self.obj.map_fd(followed.MAP_NAME), pid)
        for name in ("fork_obj", "obj"):
            obj = getattr(self, name, None)
            if obj is not None:
                setattr(self, name, None)
                obj.close()
        if getattr(self, "recorded_fd", None) is not None:
            os.close(self.recorded_fd)
            self.recorded_fd = None
        for pid in self._live:
            self.resume(pid)
