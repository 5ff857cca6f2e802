"""The daemon's GPU metrics against nvidia-smi, on a GPU machine (bench/gpu_check.sh runs it).

A daemon is started on a loopback port; once its GPU metrics are on, each sample reads
`nvidia-smi --query-gpu`, the daemon's /metrics, and nvidia-smi again, and compares by GPU
(index and UUID): memory total and used equal nvidia-smi's in MiB (used: within what it moved
between the two nvidia-smi reads, plus 1 MiB), utilization within --util-tol points (both
sample a changing load at different instants: one sample of --samples may miss). With a load
command after `--`, the same again while it runs, and its process's GPU memory against
`nvidia-smi --query-compute-apps`. Prints PASS/FAIL lines; exit 0 when every check passes.

    .venv/bin/python bench/gpu_metrics_check.py [--samples 5] [--util-tol 10] [-- LOAD_CMD...]
"""
from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

MiB = 1 << 20
GPU_FIELDS = ("index", "uuid", "memory.used", "memory.total", "utilization.gpu")


class CheckError(Exception):
    """Something the check cannot go on without: said in one FAIL line."""


def smi(args: list[str]) -> list[list[str]]:
    try:
        p = subprocess.run(["nvidia-smi", *args, "--format=csv,noheader,nounits"],
                           capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        raise CheckError("nvidia-smi not found (a GPU machine with NVIDIA's driver is needed)") from None
    except subprocess.TimeoutExpired:
        raise CheckError("nvidia-smi did not answer within 60 s") from None
    if p.returncode != 0:
        raise CheckError(f"nvidia-smi {' '.join(args)}: exit {p.returncode}: "
                         f"{(p.stdout + p.stderr).strip().splitlines()[-1:] or ''}")
    return [[f.strip() for f in line.split(",")] for line in p.stdout.splitlines() if line.strip()]


def smi_gpus() -> dict[str, dict]:
    """nvidia-smi's GPUs by UUID: index, memory used and total (MiB), utilization (percent)."""
    out = {}
    for row in smi([f"--query-gpu={','.join(GPU_FIELDS)}"]):
        if len(row) != len(GPU_FIELDS):
            raise CheckError(f"nvidia-smi --query-gpu: unexpected line {row}")
        idx, uuid, used, total, util = row

        def num(v: str) -> float | None:
            try:
                return float(v)
            except ValueError:        # [N/A], [Not Supported]
                return None
        out[uuid] = {"index": idx, "used": num(used), "total": num(total), "util": num(util)}
    return out


def smi_apps() -> dict[tuple[str, int], float]:
    """nvidia-smi's compute processes: (GPU UUID, pid) -> MiB."""
    out = {}
    for row in smi(["--query-compute-apps=gpu_uuid,pid,used_memory"]):
        try:
            out[(row[0], int(row[1]))] = float(row[2])
        except (IndexError, ValueError):
            continue                  # [N/A] memory (MIG): not compared
    return out


def scrape(url: str) -> dict[tuple, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def daemon_gpus(m: dict[tuple, float]) -> dict[str, dict]:
    """The daemon's GPU series by UUID, in nvidia-smi's units (MiB, percent)."""
    out: dict[str, dict] = {}
    units = {"profinfer_gpu_memory_used_bytes": ("used", 1 / MiB),
             "profinfer_gpu_memory_total_bytes": ("total", 1 / MiB),
             "profinfer_gpu_utilization_ratio": ("util", 100)}
    for (name, labels), v in m.items():
        lv = dict(labels)
        if name in units:
            key, scale = units[name]
            out.setdefault(lv["uuid"], {"index": lv["gpu"]})[key] = v * scale
        elif name == "profinfer_gpu_process_memory_bytes":
            out.setdefault(lv["uuid"], {"index": lv["gpu"]}).setdefault("procs", {})[int(lv["pid"])] = v / MiB
    return out


class Checks:
    def __init__(self):
        self.results: list[tuple[str, bool, str]] = []

    def add(self, name: str, ok: bool, detail: str = "") -> None:
        self.results.append((name, ok, detail))
        print(("PASS " if ok else "FAIL ") + name + (f": {detail}" if detail else ""), flush=True)

    def ok(self) -> bool:
        return all(ok for _, ok, _ in self.results)


def within(v: float | None, a: float | None, b: float | None, tol: float) -> bool:
    if v is None or a is None or b is None:
        return False
    return min(a, b) - tol <= v <= max(a, b) + tol


def fmt(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.0f}"


def compare(url: str, phase: str, samples: int, util_tol: float, checks: Checks,
            load_pid: int | None = None) -> None:
    ids_ok, total_ok, used_ok, util_hits, proc_ok = True, True, True, [], True
    shown = []
    for k in range(samples):
        before, m, after = smi_gpus(), scrape(url), smi_gpus()
        mine = daemon_gpus(m)
        if {u: g["index"] for u, g in mine.items()} != {u: g["index"] for u, g in before.items()}:
            ids_ok = False
            shown.append(f"daemon {sorted((g['index'], u) for u, g in mine.items())} vs nvidia-smi "
                         f"{sorted((g['index'], u) for u, g in before.items())}")
            break
        hits = True
        for uuid, s1 in before.items():
            d, s2 = mine[uuid], after[uuid]
            total_ok &= within(d.get("total"), s1["total"], s2["total"], 1)
            used_ok &= within(d.get("used"), s1["used"], s2["used"], 1)
            if s1["util"] is not None:         # [Not Supported] on some boards: not compared
                hits &= within(d.get("util"), s1["util"], s2["util"], util_tol)
            shown.append(f"GPU {s1['index']}: used {fmt(d.get('used'))}/{fmt(s1['used'])} MiB, total "
                         f"{fmt(d.get('total'))}/{fmt(s1['total'])} MiB, util {fmt(d.get('util'))}/{fmt(s1['util'])}%")
        util_hits.append(hits)
        if load_pid is not None:
            apps = smi_apps()
            for (uuid, pid), mib in apps.items():
                if pid == load_pid:
                    got = mine.get(uuid, {}).get("procs", {}).get(pid)
                    proc_ok &= got is not None and abs(got - mib) <= 1
                    shown.append(f"PID {pid} on {uuid}: {'n/a' if got is None else f'{got:.1f}'}/{mib:g} MiB")
            proc_ok &= any(pid == load_pid for _, pid in apps)
        if k < samples - 1:                    # a second between samples, none after the last
            time.sleep(1)
    print("\n".join(f"  {phase} (daemon/nvidia-smi): {s}" for s in shown), flush=True)
    checks.add(f"{phase}: the daemon's GPUs (index, uuid) are nvidia-smi's", ids_ok)
    if not ids_ok:
        return
    checks.add(f"{phase}: memory total equals nvidia-smi's (1 MiB)", total_ok)
    checks.add(f"{phase}: memory used equals nvidia-smi's (1 MiB, and what it moved meanwhile)", used_ok)
    checks.add(f"{phase}: utilization within {util_tol:g} points of nvidia-smi's",
               sum(util_hits) >= len(util_hits) - 1, f"{sum(util_hits)} of {len(util_hits)} samples")
    if load_pid is not None:
        checks.add(f"{phase}: the load's GPU memory equals nvidia-smi's compute-apps (1 MiB)", proc_ok)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=5)
    ap.add_argument("--util-tol", type=float, default=10.0, help="percentage points")
    ap.add_argument("--log", type=Path, help="the daemon's log (default: a temporary file)")
    ap.add_argument("load", nargs="*", help="a command that loads the GPU, after --")
    a = ap.parse_args()
    checks = Checks()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    tmp = Path(tempfile.mkdtemp(prefix="profinfer-gpu-metrics-"))
    log_path = a.log or tmp / "daemon.log"
    log = open(log_path, "w+")
    daemon = subprocess.Popen([sys.executable, "-m", "profinfer.cli", "daemon", "--listen", f"127.0.0.1:{port}",
                               "--token-file", str(tmp / "token"), "--levels", "token"],
                              stdout=log, stderr=log)
    load = None
    try:
        deadline, m = time.monotonic() + 60, {}
        while time.monotonic() < deadline and daemon.poll() is None:
            try:
                m = scrape(url)
                if m.get(("profinfer_gpu_metrics_enabled", ())) == 1 and daemon_gpus(m):
                    break
            except OSError:
                pass
            time.sleep(0.5)
        log.flush()
        said = [line.split("daemon: ", 1)[-1] for line in log_path.read_text().splitlines() if "daemon: GPU" in line]
        on = m.get(("profinfer_gpu_metrics_enabled", ())) == 1 and bool(daemon_gpus(m))
        checks.add("the daemon's GPU metrics are on", on, "; ".join(said) or f"see {log_path}")
        if on:
            compare(url, "idle", a.samples, a.util_tol, checks)
            if a.load:
                load = subprocess.Popen(a.load, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                deadline = time.monotonic() + 120       # until it holds GPU memory
                while time.monotonic() < deadline and load.poll() is None:
                    if any(pid == load.pid for _, pid in smi_apps()):
                        break
                    time.sleep(0.5)
                time.sleep(2)                           # past its start: a steady load
                if load.poll() is None:
                    compare(url, "under load", a.samples, a.util_tol, checks, load_pid=load.pid)
                checks.add("under load: the load ran through the samples", load.poll() is None,
                           "" if load.poll() is None else f"it exited ({load.returncode}) first: make it longer")
    except CheckError as e:
        checks.add("the check ran", False, str(e))
    finally:
        if load is not None and load.poll() is None:
            load.kill()
            load.wait()
        daemon.terminate()
        try:
            daemon.wait(timeout=30)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()
        log.close()
    if "Traceback" in log_path.read_text():
        checks.add("the daemon logged no traceback", False, str(log_path))
    return 0 if checks.ok() else 1


if __name__ == "__main__":
    sys.exit(main())
