"""What the running kernel offers BPF: privileges, tracefs, the uprobe PMU, the ring buffer."""
from __future__ import annotations

import os
import platform
import re

from profinfer.core.base.errors import NotRootError, ProfinferError

UPROBE_PMU = "/sys/bus/event_source/devices/uprobe/type"


def require_root() -> None:
    if os.geteuid() != 0:
        raise NotRootError("profinfer needs root (CAP_BPF and CAP_PERFMON) to attach probes; "
                           "run it with sudo")


def tracefs_mounted() -> bool:
    for mnt in ("/sys/kernel/tracing", "/sys/kernel/debug/tracing"):
        if os.path.exists(os.path.join(mnt, "uprobe_events")):
            return True
    return False


def uprobe_pmu() -> bool:
    """perf_event_open can create uprobes itself: no tracefs, and they vanish with our fds."""
    return os.path.exists(UPROBE_PMU)


# The host's (initial) PID namespace has a fixed inode number (PROC_PID_INIT_INO). NSpid cannot
# tell: it starts at the namespace of the /proc mounted here (a container's own shows one entry).
INIT_PID_NS = f"pid:[{0xEFFFFFFC}]"


def in_host_pid_namespace() -> bool:
    try:
        return os.readlink("/proc/self/ns/pid") == INIT_PID_NS
    except OSError:
        return False


def release_at_least(major: int, minor: int) -> bool:
    nums = re.match(r"(\d+)\.(\d+)", platform.release())
    return bool(nums) and (int(nums.group(1)), int(nums.group(2))) >= (major, minor)


def ring_buffer_supported() -> bool:
    """Whether our ring-buffer build loads: BPF ring buffers arrived in Linux 5.8, and the
    atomics it uses that return a value (its wakeup accounting, claiming per-thread slots)
    in 5.12. The perf-buffer build serves older kernels."""
    return release_at_least(5, 12)


def event_buffer_kind(choice: str) -> str:
    """"ring" or "perf" for --buffer auto|ring|perf."""
    if choice == "auto":
        return "ring" if ring_buffer_supported() else "perf"
    if choice == "ring" and not ring_buffer_supported():
        raise ProfinferError(f"kernel {platform.release()} is older than 5.12, which profinfer's "
                             "ring-buffer build needs: use --buffer perf")
    return choice
