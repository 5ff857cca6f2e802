"""`profinfer doctor`: check each thing profiling depends on and say how to fix it."""
from __future__ import annotations

import os
import platform

from rich.console import Console
from rich.table import Table

from profinfer.core import bpfobj, kernel, libbpf
from profinfer.core import perfevents as perfcounters
from profinfer.core.errors import ProfinferError

OK, WARN, FAIL = "ok", "warn", "FAIL"


def _check_libbpf():
    try:
        return OK, f"libbpf {libbpf.version()}"
    except ProfinferError as e:
        return FAIL, str(e)


def _check_object():
    """The precompiled BPF object exists (or can be built here) and the kernel verifies it."""
    try:
        path = bpfobj.object_path("llamacpp.bpf.c", kernel.event_buffer_kind("auto"))
    except ProfinferError as e:
        return FAIL, str(e)
    try:
        kernel.require_root()
        paths = [path, bpfobj.object_path("cuda.bpf.c", kernel.event_buffer_kind("auto"))]
        if os.path.exists("/sys/kernel/btf/vmlinux"):     # the sched object is CO-RE
            paths.append(bpfobj.object_path("sched.bpf.c", kernel.event_buffer_kind("auto")))
        programs = 0
        for p in paths:
            obj = libbpf.BpfObject(p)
            try:
                names = set(obj.program_names())
                obj.load(names)
                programs += len(names)
            finally:
                obj.close()
    except ProfinferError as e:
        return FAIL, str(e)
    return OK, (f"{len(paths)} objects in {os.path.dirname(path)}: {programs} programs load and "
                "verify (no compiler or kernel headers needed at attach)")


def _check_hw_pmu():
    fd = perfcounters._open(perfcounters.parse("cycles"), 0)
    if fd >= 0:
        os.close(fd)
        return OK, "hardware counters (cycles) open"
    return WARN, (f"no hardware PMU ({os.strerror(-fd)}): --counters falls back to software "
                  "events (task-clock, page-faults, context-switches, ...)")


def _check_btf():
    if os.path.exists("/sys/kernel/btf/vmlinux"):
        return OK, "/sys/kernel/btf/vmlinux present (the sched level relocates task_struct with it)"
    return WARN, "no kernel BTF: token/graph/op levels work; the sched level does not"


def _check_cost_accounting():
    from profinfer.core import libbpf, probecost
    fd = libbpf.enable_run_time_stats() if os.geteuid() == 0 else -1
    if fd < 0:
        return WARN, "BPF run-time statistics refused (kernel < 5.8?): no profiler-cost line"
    os.close(fd)
    costs = probecost.cached()
    if costs is None:
        return WARN, "BPF run time is counted; probe trap cost not measured: run `profinfer calibrate`"
    return OK, (f"BPF run time counted; a probe hit costs {costs['emulated_ns'] / 1e3:.2f} µs "
                f"(emulated), {costs['stepped_ns'] / 1e3:.2f} µs (single-stepped) here")


def checks() -> list[tuple[str, str, str]]:
    rows = []
    rows.append(("root", *((OK, "running as root") if os.geteuid() == 0 else
                           (FAIL, "not root: run with sudo"))))
    rows.append(("libbpf", *_check_libbpf()))
    rows.append(("BTF", *_check_btf()))
    rows.append(("event buffer", *((OK, "BPF ring buffer") if kernel.ring_buffer_supported() else
                                   (WARN, "kernel < 5.12: per-CPU perf buffers, not the BPF ring buffer"))))
    rows.append(("uprobe PMU", *((OK, "uprobes via perf_event_open: no tracefs needed, "
                                      "nothing survives profinfer") if kernel.uprobe_pmu()
                                 else (WARN, "no uprobe PMU: libbpf falls back to tracefs uprobe_events"))))
    rows.append(("tracefs", *((OK, "mounted") if kernel.tracefs_mounted() else
                              (OK if kernel.uprobe_pmu() else FAIL,
                               "not mounted" + (" (not needed here)" if kernel.uprobe_pmu() else
                                                ": mount -t tracefs nodev /sys/kernel/tracing")))))
    rows.append(("BPF object", *_check_object()))
    rows.append(("hardware PMU", *_check_hw_pmu()))
    rows.append(("cuda level", *((OK, "attach cookies (5.15+): the CUDA runtime's and driver's calls can be probed")
                                 if kernel.release_at_least(5, 15) else
                                 (WARN, "kernel < 5.15 (no attach cookies): --levels cuda does not work"))))
    rows.append(("profiler cost", *_check_cost_accounting()))
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
