"""`profinfer doctor`: check each thing profiling depends on and say how to fix it."""
from __future__ import annotations

import ctypes
import os
import platform

from rich.console import Console
from rich.table import Table

from . import kernel
from .errors import ProfinferError

OK, WARN, FAIL = "ok", "warn", "FAIL"


def _check_bcc():
    try:
        bcc = kernel.import_bcc()
    except ProfinferError as e:
        return FAIL, str(e)
    return OK, f"BCC {getattr(bcc, '__version__', '?')} from {os.path.dirname(bcc.__file__)}"


def _check_headers():
    try:
        tree, what = kernel.kernel_headers()
    except ProfinferError as e:
        return FAIL, str(e)
    return (WARN if tree else OK), what


def _check_compile():
    try:
        kernel.require_root()
        bcc = kernel.import_bcc()
        kernel.prepare_bcc_environment()
        b = bcc.BPF(text="BPF_RINGBUF_OUTPUT(rb, 1); int f(void *ctx) { return 0; }")
        b.cleanup()
    except ProfinferError as e:
        return FAIL, str(e)
    except Exception as e:  # BCC reports compile errors as bare Exception
        return FAIL, f"BPF compile/load failed: {str(e).splitlines()[0] if str(e) else e!r}"
    return OK, "a BPF program with a ring buffer compiles and loads"


def _check_hw_pmu():
    # perf_event_open(PERF_TYPE_HARDWARE, PERF_COUNT_HW_CPU_CYCLES) on this thread, any CPU.
    class Attr(ctypes.Structure):
        _fields_ = [("type", ctypes.c_uint32), ("size", ctypes.c_uint32), ("config", ctypes.c_uint64),
                    ("rest", ctypes.c_uint8 * 112)]
    attr = Attr(0, ctypes.sizeof(Attr), 0)
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.syscall(298, ctypes.byref(attr), 0, -1, -1, 0)
    if fd >= 0:
        os.close(fd)
        return OK, "hardware counters (cycles) open"
    err = ctypes.get_errno()
    return WARN, (f"no hardware PMU ({os.strerror(err)}): only software perf events; "
                  "op-level hardware counters unavailable on this machine")


def checks() -> list[tuple[str, str, str]]:
    rows = []
    rows.append(("root", *((OK, "running as root") if os.geteuid() == 0 else
                           (FAIL, "not root: run with sudo"))))
    rows.append(("bcc", *_check_bcc()))
    rows.append(("kernel headers", *_check_headers()))
    rows.append(("BTF", *((OK, "/sys/kernel/btf/vmlinux present") if os.path.exists("/sys/kernel/btf/vmlinux")
                          else (WARN, "no kernel BTF: fine for uprobes"))))
    rows.append(("uprobe PMU", *((OK, "uprobes via perf_event_open: no tracefs needed, "
                                      "nothing survives profinfer") if kernel.uprobe_pmu()
                                 else (WARN, "no uprobe PMU: BCC falls back to tracefs uprobe_events"))))
    rows.append(("tracefs", *((OK, "mounted") if kernel.tracefs_mounted() else
                              (OK if kernel.uprobe_pmu() else FAIL,
                               "not mounted" + (" (not needed here)" if kernel.uprobe_pmu() else
                                                ": mount -t tracefs nodev /sys/kernel/tracing")))))
    rows.append(("BPF compile", *_check_compile()))
    rows.append(("hardware PMU", *_check_hw_pmu()))
    rows.append(("kernel", OK, platform.release()))
    return rows


def run_doctor() -> int:
    table = Table(title="profinfer doctor")
    for col in ("check", "status", "detail"):
        table.add_column(col)
    rows = checks()
    for name, status, detail in rows:
        style = {"ok": "green", "warn": "yellow"}.get(status, "red")
        table.add_row(name, f"[{style}]{status}[/]", detail)
    Console().print(table)
    return 1 if any(s == FAIL for _, s, _ in rows) else 0
