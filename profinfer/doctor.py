"""`profinfer doctor`: check each thing profiling depends on and say how to fix it."""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile

from rich.console import Console
from rich.table import Table

from profinfer.core.base import config
from profinfer.core.ebpf import bpfobj, kernel, libbpf
from profinfer.core.ebpf import perfevents as perfcounters
from profinfer.core.base.errors import ProfinferError
from profinfer.core.plugin.tables import stepped_functions

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
    from profinfer.core.ebpf import libbpf
    from profinfer.core.calibration import probecost
    fd = libbpf.enable_run_time_stats() if os.geteuid() == 0 else -1
    if fd < 0:
        return WARN, "BPF run-time statistics refused (kernel < 5.8?): no profiler-cost line"
    os.close(fd)
    costs = probecost.cached()
    if costs is None:
        return WARN, "BPF run time is counted; probe trap cost not measured: run `profinfer calibrate`"
    return OK, (f"BPF run time counted; a probe hit costs {costs['emulated_ns'] / 1e3:.2f} µs "
                f"(emulated), {costs['stepped_ns'] / 1e3:.2f} µs (single-stepped) here")


WORKLOAD_TIMEOUT_S = 300
# a process that maps the files named on its command line, then waits for its stdin to close
_MAPPER = "import ctypes, sys; [ctypes.CDLL(p) for p in sys.argv[1:]]; print('mapped', flush=True); sys.stdin.read()"


def _placed(args: list[str]) -> tuple[dict[str, str], str]:
    """Run `profinfer ARGS --quiet --json FILE` (a real attach); the recording's meta, and
    the error it ended with ("" when it wrote its summary)."""
    with tempfile.TemporaryDirectory(prefix="profinfer-doctor.") as tmp:
        summary = os.path.join(tmp, "summary.json")
        cmd = [sys.executable, "-m", "profinfer.cli", args[0], "--quiet", "--json", summary, *args[1:]]
        # this very profinfer (run from a source tree, or installed), not another one on the path
        top = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (top, os.environ.get("PYTHONPATH"))))}
        try:
            run = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                 timeout=WORKLOAD_TIMEOUT_S, cwd=tmp, env=env)
        except subprocess.TimeoutExpired:
            return {}, f"no result in {WORKLOAD_TIMEOUT_S} s"
        if not os.path.exists(summary):
            lines = [l for l in run.stderr.splitlines() if l.strip()]
            return {}, lines[-1] if lines else f"exit status {run.returncode}"
        with open(summary) as f:
            return json.load(f).get("meta", {}), ""


def _placement_row(meta: dict[str, str], prefix: str = "") -> tuple[str, str]:
    if f"{prefix}probes_stepped" not in meta:
        return WARN, "the recording does not say where its probes sit"
    n, stepped = int(meta.get(f"{prefix}probes", 0)), int(meta[f"{prefix}probes_stepped"])
    where = stepped_functions(meta.get(f"{prefix}probes_stepped_at", ""))
    return ((OK, f"stepped probes: 0 of {n} (every probe on an instruction the kernel emulates)")
            if not stepped else
            (WARN, f"stepped probes: {stepped} of {n}, each hit single-stepped (~30x an emulated "
                   f"trap): {where}"))


def _check_demo(demo) -> tuple[str, str]:
    """Record the bundled workload briefly, as `profinfer demo` does, and say where its probes sit."""
    if demo.ready is not None and not demo.ready():
        return WARN, f"not built yet: `profinfer demo --engine {demo.name}` builds it, then this checks it"
    for _ in range(2):      # once more if it failed: a run let go before it was probed
        meta, error = _placed(["demo", "--engine", demo.name, "--tokens", "16", "-o", "demo.pftrace"])
        if not error:
            return _placement_row(meta)
    return FAIL, f"its recording failed: {error}"


def _check_cuda_runtime() -> tuple[str, str]:
    """Attach the cuda level to a process that maps the CUDA runtimes found here."""
    from profinfer.levels.cuda import workload
    files = workload.runtimes_here()
    if not files:
        return OK, "no CUDA runtime on this machine (nothing to check)"
    mapper = subprocess.Popen([sys.executable, "-c", _MAPPER, *map(str, files)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        if mapper.stdout.readline().strip() != "mapped":
            return WARN, f"cannot load {', '.join(map(str, files))} to check them"
        meta, error = _placed(["attach", "--pid", str(mapper.pid), "--levels", "cuda", "--duration", "0.5"])
    finally:
        mapper.kill()
        mapper.wait()
    if error:
        return FAIL, f"attaching to {', '.join(f.name for f in files)} failed: {error}"
    status, detail = _placement_row(meta, "cuda_")
    return status, f"{detail} ({', '.join(f.name for f in files)})"


def workload_checks() -> list[tuple[str, str, str]]:
    """Where the probes sit on each bundled workload, by a real attach: each demo, and the
    CUDA runtimes found here."""
    from profinfer.core.plugin.commands import demos
    if os.geteuid() != 0:
        return [("probes", WARN, "not root: the bundled workloads' probes are not checked")]
    rows = [(f"probes: {d.name}", *_check_demo(d)) for d in demos()]
    rows.append(("probes: CUDA runtime", *_check_cuda_runtime()))
    return rows


def checks(workloads: bool = True) -> list[tuple[str, str, str]]:
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
    said = bpfobj.provenance()      # as `profinfer --version` says
    rows.append(("BPF objects from", WARN if "not built, and" in said else OK, said))
    rows.append(("hardware PMU", *_check_hw_pmu()))
    rows.append(("cuda level", *((OK, "attach cookies (5.15+): the CUDA runtime's and driver's calls can be probed")
                                 if kernel.release_at_least(5, 15) else
                                 (WARN, "kernel < 5.15 (no attach cookies): --levels cuda does not work"))))
    rows.append(("profiler cost", *_check_cost_accounting()))
    rows.append(("kernel", OK, platform.release()))
    rows.append(("settings", OK, "; ".join(f"{name}={value}" for name, value in config.in_effect())
                 or "no PROFINFER_* setting: the defaults (docs/configuration.md)"))
    if workloads:
        rows += workload_checks()
    return rows


def run_doctor(workloads: bool = True) -> int:
    table = Table(title="profinfer doctor")
    for col in ("check", "status", "detail"):
        table.add_column(col)
    rows = checks(workloads)
    for name, status, detail in rows:
        style = {"ok": "green", "warn": "yellow"}.get(status, "red")
        table.add_row(name, f"[{style}]{status}[/]", detail)
    Console().print(table)
    return 1 if any(s == FAIL for _, s, _ in rows) else 0
