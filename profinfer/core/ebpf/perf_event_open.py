"""perf_event_open(2): the attribute struct, as far as profinfer sets it, and the syscall.
Used by the counters (perfevents) and by libbpf.PerfBuffer for its BPF-output events."""
from __future__ import annotations

import ctypes
import errno
import os

PERF_TYPE_HARDWARE, PERF_TYPE_SOFTWARE, PERF_TYPE_HW_CACHE, PERF_TYPE_RAW = 0, 1, 3, 4
_SYS_PERF_EVENT_OPEN = {"x86_64": 298, "aarch64": 241}
_PERF_FLAG_FD_CLOEXEC = 8


class PerfEventAttr(ctypes.Structure):
    """struct perf_event_attr, as far as profinfer sets it (the rest stays zero)."""
    _fields_ = [("type", ctypes.c_uint32), ("size", ctypes.c_uint32), ("config", ctypes.c_uint64),
                ("sample_period", ctypes.c_uint64), ("sample_type", ctypes.c_uint64),
                ("read_format", ctypes.c_uint64), ("flags", ctypes.c_uint64),
                ("wakeup_events", ctypes.c_uint32), ("bp_type", ctypes.c_uint32),
                # uprobe PMU: config1 = pointer to the file's path, config2 = file offset
                ("config1", ctypes.c_uint64), ("config2", ctypes.c_uint64),
                ("rest", ctypes.c_uint8 * 56)]

    SIZE_VER5 = 112     # PERF_ATTR_SIZE_VER5: known to every kernel that has BPF


_libc = ctypes.CDLL(None, use_errno=True)


def perf_event_open(attr: PerfEventAttr, pid: int, cpu: int) -> int:
    """The perf_event_open syscall; returns the fd, or -errno."""
    nr = _SYS_PERF_EVENT_OPEN.get(os.uname().machine)
    if nr is None:
        return -errno.ENOSYS
    fd = _libc.syscall(nr, ctypes.byref(attr), pid, cpu, -1, _PERF_FLAG_FD_CLOEXEC)
    return fd if fd >= 0 else -ctypes.get_errno()
