"""A small ctypes binding of the system's libbpf (Debian libbpf1): load a precompiled BPF
object, attach its uprobes, read its maps, and drain its ring or perf buffer.

libbpf's own messages (verifier logs included) are captured rather than printed (cdll.py):
the last ones become the text of the error that is raised, so a failure is one clear line.
"""
from __future__ import annotations

import concurrent.futures
import ctypes
import os
import platform
import struct

from profinfer.core.base import config
from profinfer.core.ebpf import kernel
from profinfer.core.target import procfs
from profinfer.core.ebpf.perf_event_open import PERF_TYPE_SOFTWARE, PerfEventAttr
from profinfer.core.base.errors import ProfinferError
from profinfer.core.ebpf.cdll import PERF_EVENT_FN as _PERF_EVENT_FN, SAMPLE_FN as _SAMPLE_FN, \
    UprobeOpts as _UprobeOpts, failure as _failure, lib, libc as _libc, messages as _messages, \
    version  # noqa: F401 (libbpf.version(): the binding's public face)

_PERF_RECORD_LOST = 2
_PERF_RECORD_SAMPLE = 9
_LIBBPF_PERF_EVENT_CONT = -2

# The bpf syscall's link creation for uprobe-multi links (linux/bpf.h, newer than Debian 12's)
_SYS_BPF = {"x86_64": 321, "aarch64": 280}.get(platform.machine(), -1)
_BPF_LINK_CREATE = 28
BPF_TRACE_UPROBE_MULTI = 48
BPF_F_UPROBE_MULTI_RETURN = 1
_LINK_CREATE_SIZE = 64      # through link_create.uprobe_multi.pid
# links closed at once by detach (each close sleeps in the kernel, holding no CPU)
_DETACH_THREADS = 32


def uprobe_multi_ok() -> bool:
    """Whether uprobes are attached as uprobe-multi links (Linux 6.6). Those need CAP_BPF and
    CAP_PERFMON; a perf-event uprobe needs CAP_SYS_ADMIN since commit ba677dbe77af ("perf:
    Revert to requiring CAP_SYS_ADMIN for uprobes", 6.16, backported to stable releases).
    PROFINFER_UPROBE_LINKS=perf keeps perf-event uprobes (kernels that lack the links)."""
    return kernel.release_at_least(6, 6) and config.text("PROFINFER_UPROBE_LINKS") != "perf"


# syscall(2), typed for the bpf call
_bpf_syscall = _libc.syscall
_bpf_syscall.restype = ctypes.c_long
_bpf_syscall.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_uint]


# struct bpf_prog_info (linux/bpf.h, append-only ABI): run_time_ns and run_cnt, since 5.1
_PROG_INFO_RUN_TIME = 192
_PROG_INFO_SIZE = 208
_BPF_STATS_RUN_TIME = 0


BPF_STATS_SYSCTL = "/proc/sys/kernel/bpf_stats_enabled"


def enable_run_time_stats() -> int:
    """Make the kernel count every BPF program's run time (system-wide, a few ns a run) until
    the returned fd is closed; -1 where it refuses (before 5.8, or not permitted: the switch
    needs CAP_SYS_ADMIN). Where the node counts them already (sysctl
    kernel.bpf_stats_enabled=1, which needs no capability of ours), a descriptor of that
    sysctl stands for the switch: counted while it is open, closed as the switch is."""
    fd = lib().bpf_enable_stats(_BPF_STATS_RUN_TIME)
    if fd >= 0:
        return fd
    try:
        with open(BPF_STATS_SYSCTL) as f:
            if f.read().strip() == "1":
                return os.open(BPF_STATS_SYSCTL, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        pass
    return -1


class BpfObject:
    """One BPF object file: configure, load, attach; close() undoes everything."""

    def __init__(self, path: str):
        L = lib()
        _messages.clear()
        self._obj = L.bpf_object__open_file(path.encode(), None)
        if not self._obj:
            raise _failure(f"cannot open BPF object {path}")
        self._links: list[int] = []
        self._link_fds: list[int] = []   # links made by the bpf syscall directly
        self._buffers: list = []
        self._multi: set[str] = set()     # programs loaded as uprobe-multi programs

    def _map(self, name: str) -> int:
        m = lib().bpf_object__find_map_by_name(self._obj, name.encode())
        if not m:
            raise ProfinferError(f"BPF object has no map {name}")
        return m

    def program_names(self) -> list[str]:
        L, out, prog = lib(), [], None
        while True:
            prog = L.bpf_object__next_program(self._obj, prog)
            if not prog:
                return out
            out.append(L.bpf_program__name(prog).decode())

    def set_rodata(self, data: bytes) -> None:
        """Write the object's read-only globals (its `const volatile` configuration)."""
        size = ctypes.c_size_t()
        ptr = lib().bpf_map__initial_value(self._map(".rodata"), ctypes.byref(size))
        if not ptr or size.value != len(data):
            raise ProfinferError(f"BPF object's .rodata is {size.value} bytes, configuration is "
                                 f"{len(data)}: object and its header disagree (rebuild it)")
        ctypes.memmove(ptr, data, len(data))

    def reuse_map(self, map_name: str, fd: int) -> None:
        """Use another loaded object's map (by fd) for this object's map of the same name."""
        if lib().bpf_map__reuse_fd(self._map(map_name), fd):
            raise _failure(f"cannot share BPF map {map_name}")

    def set_max_entries(self, map_name: str, n: int) -> None:
        if lib().bpf_map__set_max_entries(self._map(map_name), n):
            raise _failure(f"cannot size BPF map {map_name}")

    def load(self, programs: set[str]) -> None:
        """Load only `programs` (the verifier's time is spent on what is attached). Where the
        kernel has uprobe-multi links, every uprobe program is made one (uprobe_multi_ok)."""
        L, prog = lib(), None
        multi = uprobe_multi_ok()
        while True:
            prog = L.bpf_object__next_program(self._obj, prog)
            if not prog:
                break
            name = L.bpf_program__name(prog).decode()
            L.bpf_program__set_autoload(prog, name in programs)
            section = (L.bpf_program__section_name(prog) or b"").decode()
            if multi and name in programs and section.startswith(("uprobe", "uretprobe")) \
                    and name not in self._multi:
                self.set_uprobe_multi(name)
        _messages.clear()
        if L.bpf_object__load(self._obj):
            raise _failure("the kernel refused the BPF programs")

    def attach_uprobe(self, program: str, path: str, file_offset: int, pid: int,
                      retprobe: bool = False, cookie: int | None = None,
                      file_id: tuple[int, int] | None = None) -> tuple[str, int]:
        """With a cookie (Linux 5.15), the program reads it with bpf_get_attach_cookie.
        Returns the link (for detach_links). A uprobe-multi program (Linux 6.6, see load)
        gets a uprobe-multi link of one offset; else a perf-event uprobe, which needs
        CAP_SYS_ADMIN on kernels with commit ba677dbe77af (6.16, and stable releases since
        2025-07). The file is the one `path` names, opened and checked (procfs.pinned): the file
        `file_id` (device, inode) the offsets were read from, when the caller has it."""
        if program in self._multi:
            return self.attach_uprobe_multi(program, path, [file_offset], [cookie or 0], pid,
                                            retprobe=retprobe, file_id=file_id)
        L = lib()
        prog = L.bpf_object__find_program_by_name(self._obj, program.encode())
        if not prog:
            raise ProfinferError(f"BPF object has no program {program}")
        _messages.clear()
        with procfs.pinned(path, file_id) as name:
            if cookie is None:
                link = L.bpf_program__attach_uprobe(prog, retprobe, pid, name.encode(), file_offset)
            else:
                opts = _UprobeOpts(sz=ctypes.sizeof(_UprobeOpts), bpf_cookie=cookie, retprobe=retprobe)
                link = L.bpf_program__attach_uprobe_opts(prog, pid, name.encode(), file_offset,
                                                         ctypes.byref(opts))
            if not link:
                err = _failure(f"uprobe {program} at {path}+{file_offset:#x}")
                if ctypes.get_errno() == 13:       # EACCES: perf_uprobe_event_init
                    err = ProfinferError(f"{err} (a perf-event uprobe needs CAP_SYS_ADMIN on this "
                                         "kernel; Linux 6.6+ attaches with uprobe-multi links, "
                                         "which need CAP_BPF and CAP_PERFMON only)")
                raise err
        self._links.append(link)
        return ("link", link)

    def set_uprobe_multi(self, program: str) -> None:
        """Before load: the program will be attached with attach_uprobe_multi (Linux 6.6)."""
        prog = self._program(program)
        if lib().bpf_program__set_expected_attach_type(prog, BPF_TRACE_UPROBE_MULTI):
            raise _failure(f"cannot make {program} a uprobe-multi program")
        self._multi.add(program)

    def attach_uprobe_multi(self, program: str, path: str, offsets: list[int], cookies: list[int],
                            pid: int, retprobe: bool = False,
                            file_id: tuple[int, int] | None = None) -> tuple[str, int]:
        """Probe many offsets of one file with one link (Linux 6.6; libbpf 1.3 wraps this call,
        Debian 12's 1.1 does not). Removing a uprobe waits for an RCU grace period, ~0.1 s
        here, once per link: hundreds of perf-event uprobes took 18 s to remove, one link
        takes one wait. pid > 0: only that process runs the program."""
        prog = self._program(program)
        fd = lib().bpf_program__fd(prog)
        n = len(offsets)
        offs = (ctypes.c_uint64 * n)(*offsets)
        cks = (ctypes.c_uint64 * n)(*cookies)
        attr = ctypes.create_string_buffer(_LINK_CREATE_SIZE)
        with procfs.pinned(path, file_id) as name:
            path_buf = ctypes.create_string_buffer(name.encode())
            struct.pack_into("<IIII", attr, 0, fd, 0, BPF_TRACE_UPROBE_MULTI, 0)
            struct.pack_into("<QQQQIII", attr, 16, ctypes.addressof(path_buf), ctypes.addressof(offs), 0,
                             ctypes.addressof(cks), n, BPF_F_UPROBE_MULTI_RETURN if retprobe else 0,
                             max(pid, 0))
            link = _bpf_syscall(_SYS_BPF, _BPF_LINK_CREATE, attr, _LINK_CREATE_SIZE)
            err = ctypes.get_errno()
        if link < 0:
            raise ProfinferError(f"uprobe-multi link for {program} at {len(offsets)} offsets of "
                                 f"{path}: {os.strerror(err)}")
        self._link_fds.append(link)
        return ("fd", link)

    def detach_links(self, links: list[tuple[str, int]]) -> None:
        """Close these links (from attach_uprobe, attach_uprobe_multi) before the rest."""
        for kind, link in links:
            if kind == "link" and link in self._links:
                self._links.remove(link)
                lib().bpf_link__destroy(link)
            elif kind == "fd" and link in self._link_fds:
                self._link_fds.remove(link)
                os.close(link)

    def _program(self, program: str):
        prog = lib().bpf_object__find_program_by_name(self._obj, program.encode())
        if not prog:
            raise ProfinferError(f"BPF object has no program {program}")
        return prog

    def attach(self, program: str) -> None:
        """Attach where the program's section says (raw tracepoints: by name, no tracefs)."""
        L = lib()
        prog = L.bpf_object__find_program_by_name(self._obj, program.encode())
        if not prog:
            raise ProfinferError(f"BPF object has no program {program}")
        _messages.clear()
        link = L.bpf_program__attach(prog)
        if not link:
            raise _failure(f"cannot attach {program}")
        self._links.append(link)

    def program_stats(self) -> dict[str, tuple[int, int]]:
        """Per loaded program, (ns run, runs) as the kernel counts them while run-time
        statistics are enabled (enable_run_time_stats); zeros when they are not."""
        L, out, prog = lib(), {}, None
        while True:
            prog = L.bpf_object__next_program(self._obj, prog)
            if not prog:
                return out
            fd = L.bpf_program__fd(prog)
            if fd < 0:
                continue
            info = ctypes.create_string_buffer(_PROG_INFO_SIZE)
            size = ctypes.c_uint32(_PROG_INFO_SIZE)
            if L.bpf_obj_get_info_by_fd(fd, info, ctypes.byref(size)) == 0 and size.value >= _PROG_INFO_SIZE:
                run_ns, runs = struct.unpack_from("<QQ", info.raw, _PROG_INFO_RUN_TIME)
                out[L.bpf_program__name(prog).decode()] = (run_ns, runs)

    @property
    def n_links(self) -> int:
        return len(self._links) + len(self._link_fds)

    def map_fd(self, name: str) -> int:
        return lib().bpf_map__fd(self._map(name))

    def map_sizes(self, name: str) -> tuple[int, int]:
        """(key size, value size) as the kernel has them: buffers are sized from these."""
        m = self._map(name)
        return lib().bpf_map__key_size(m), lib().bpf_map__value_size(m)

    def map_items(self, name: str):
        key_size, value_size = self.map_sizes(name)
        return map_items(self.map_fd(name), key_size, value_size)

    def ring_buffer(self, map_name: str, on_record) -> "RingBuffer":
        rb = RingBuffer(self.map_fd(map_name), on_record)
        self._buffers.append(rb)
        return rb

    def perf_buffer(self, map_name: str, pages_per_cpu: int, wakeup_events: int,
                    on_record, on_lost) -> "PerfBuffer":
        pb = PerfBuffer(self.map_fd(map_name), pages_per_cpu, wakeup_events, on_record, on_lost)
        self._buffers.append(pb)
        return pb

    def detach(self) -> None:
        """Detach every probe; maps and buffers stay, to be read once more. The links are
        closed together: each release waits out an RCU grace period in the kernel, and
        waits that overlap share one (bench/results.md)."""
        L = lib()
        closes = [lambda link=link: L.bpf_link__destroy(link) for link in self._links]
        closes += [lambda fd=fd: os.close(fd) for fd in self._link_fds]
        self._links, self._link_fds = [], []
        if not closes:
            return
        with concurrent.futures.ThreadPoolExecutor(min(len(closes), _DETACH_THREADS)) as pool:
            for done in [pool.submit(close) for close in closes]:
                done.result()

    def close(self) -> None:
        """Detach every probe (perf-event uprobes vanish with their fds), free buffers and maps."""
        L = lib()
        self.detach()
        for b in self._buffers:
            b.free()
        self._buffers = []
        if self._obj:
            L.bpf_object__close(self._obj)
            self._obj = None


class RingBuffer:
    def __init__(self, map_fd: int, on_record):
        self._cb = _SAMPLE_FN(lambda ctx, data, size: on_record(data, size) or 0)
        self._rb = lib().ring_buffer__new(map_fd, self._cb, None, None)
        if not self._rb:
            raise _failure("cannot open the BPF ring buffer")

    def poll(self, timeout_ms: int) -> None:
        lib().ring_buffer__poll(self._rb, timeout_ms)

    def consume(self) -> None:
        lib().ring_buffer__consume(self._rb)

    def fileno(self) -> int:
        """An fd that polls readable when records wait (for select with other buffers)."""
        return lib().ring_buffer__epoll_fd(self._rb)

    def free(self) -> None:
        if self._rb:
            lib().ring_buffer__free(self._rb)
            self._rb = None
        self._cb = None      # its closure holds the reader: no cycle left for the GC


class PerfBuffer:
    """Per-CPU perf buffers that wake the reader once per `wakeup_events` records."""

    def __init__(self, map_fd: int, pages_per_cpu: int, wakeup_events: int, on_record, on_lost):
        attr = PerfEventAttr()
        attr.type = PERF_TYPE_SOFTWARE
        attr.size = PerfEventAttr.SIZE_VER5
        attr.config = 10              # PERF_COUNT_SW_BPF_OUTPUT
        attr.sample_period = 1
        attr.sample_type = 1 << 10    # PERF_SAMPLE_RAW
        attr.wakeup_events = wakeup_events

        def on_event(ctx, cpu, header):
            kind = ctypes.c_uint32.from_address(header).value
            if kind == _PERF_RECORD_SAMPLE:
                size = ctypes.c_uint32.from_address(header + 8).value
                on_record(header + 12, size)
            elif kind == _PERF_RECORD_LOST:
                on_lost(ctypes.c_uint64.from_address(header + 16).value)
            return _LIBBPF_PERF_EVENT_CONT

        self._cb = _PERF_EVENT_FN(on_event)
        self._pb = lib().perf_buffer__new_raw(map_fd, pages_per_cpu, ctypes.byref(attr),
                                              self._cb, None, None)
        if not self._pb:
            raise _failure("cannot open the BPF perf buffers")

    def poll(self, timeout_ms: int) -> None:
        lib().perf_buffer__poll(self._pb, timeout_ms)

    def consume(self) -> None:
        lib().perf_buffer__consume(self._pb)

    def fileno(self) -> int:
        """An fd that polls readable when records wait (for select with other buffers)."""
        return lib().perf_buffer__epoll_fd(self._pb)

    def free(self) -> None:
        if self._pb:
            lib().perf_buffer__free(self._pb)
            self._pb = None
        self._cb = None


BPF_MAP_TYPE_HASH = 1
BPF_MAP_TYPE_LRU_HASH = 9


def create_map(map_type: int, name: str, key_size: int, value_size: int, max_entries: int) -> int:
    """A map owned by no object (its fd): objects loaded later share it with reuse_map."""
    _messages.clear()
    fd = lib().bpf_map_create(map_type, name.encode(), key_size, value_size, max_entries, None)
    if fd < 0:
        raise _failure(f"cannot create BPF map {name}")
    return fd


def pin(fd: int, path: str) -> None:
    """Pin a map (or any BPF object) in bpffs at `path` (OSError: EEXIST when one is there)."""
    if lib().bpf_obj_pin(fd, path.encode()):
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), path)


def pinned(path: str) -> int:
    """A descriptor of what is pinned at `path` in bpffs (OSError: ENOENT when nothing is)."""
    fd = lib().bpf_obj_get(path.encode())
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), path)
    return fd


# struct bpf_map_info (linux/bpf.h, append-only ABI): type, id, key_size, value_size,
# max_entries, map_flags
_MAP_INFO_SIZE = 24


def _map_info(fd: int) -> tuple[int, ...] | None:
    """bpf_map_info's first fields (type, id, key size, value size, max entries, flags);
    None if fd is no map."""
    info = ctypes.create_string_buffer(_MAP_INFO_SIZE)
    size = ctypes.c_uint32(_MAP_INFO_SIZE)
    if lib().bpf_obj_get_info_by_fd(fd, info, ctypes.byref(size)) or size.value < _MAP_INFO_SIZE:
        return None
    return struct.unpack_from("<6I", info.raw)


def map_shape(fd: int) -> tuple[int, int, int, int] | None:
    """(type, key size, value size, max entries) of a map; None if fd is no map."""
    info = _map_info(fd)
    return None if info is None else (info[0], *info[2:5])


def map_id(fd: int) -> int | None:
    """The kernel's id of a map (unique while it lives); None if fd is no map."""
    info = _map_info(fd)
    return None if info is None else info[1]


def map_lookup(fd: int, key: bytes, value_size: int) -> bytes | None:
    value = ctypes.create_string_buffer(value_size)
    if lib().bpf_map_lookup_elem(fd, key, value):
        return None
    return value.raw


def map_update(fd: int, key: bytes, value: bytes) -> None:
    if lib().bpf_map_update_elem(fd, key, value, 0):
        raise _failure("BPF map update")


def map_delete(fd: int, key: bytes) -> None:
    lib().bpf_map_delete_elem(fd, key)     # a key already gone is no error here


def map_items(fd: int, key_size: int, value_size: int):
    """(key, value) pairs of a hash map, as bytes."""
    key, nxt = None, ctypes.create_string_buffer(key_size)
    while lib().bpf_map_get_next_key(fd, key, nxt) == 0:
        key = nxt.raw
        value = map_lookup(fd, key, value_size)
        if value is not None:
            yield key, value
