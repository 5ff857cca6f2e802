"""The daemon's GPU metrics from NVML, on a machine without a GPU: the real nvidia-ml-py
(pynvml) loads a stand-in libnvidia-ml.so.1 built here from fake_nvml.c, which answers from
a file this test writes, so that /metrics of a real daemon is compared with known NVML
answers: names, base units, labels, values. Then what goes wrong on real nodes: a GPU lost
while the daemon runs, NVML failing as a whole, an answer pynvml cannot decode, no driver
library at all, a library with no driver loaded. The daemon stays up and serves its other
metrics throughout, and says each change once."""
from __future__ import annotations

import ctypes
import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from daemon_helpers import Daemon, _get

HERE = Path(__file__).resolve().parent
GiB = 1 << 30
NVML_STALL_S = 2        # PROFINFER_NVML_STALL_S: an NVML call blocked this long turns GPU metrics off


@pytest.fixture(scope="module")
def fake_nvml_dir(tmp_path_factory) -> Path:
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler to build the stand-in libnvidia-ml.so.1")
    d = tmp_path_factory.mktemp("fake-nvml")
    subprocess.run([cc, "-Wall", "-Werror", "-O1", "-shared", "-fPIC", "-o", str(d / "libnvidia-ml.so.1"),
                    str(HERE / "fake_nvml.c")], check=True, capture_output=True, text=True)
    return d


class Answers:
    """The stand-in's answers file, replaced whole (the library reads it at each call)."""

    def __init__(self, path: Path):
        self.path = path

    def write(self, answers: dict[str, object]) -> None:
        tmp = self.path.with_suffix(".tmp")
        data = b"".join((k.encode() + b" " + (v if isinstance(v, bytes) else str(v).encode()) + b"\n")
                        for k, v in answers.items())
        tmp.write_bytes(data)
        os.replace(tmp, self.path)


def _fake_env(monkeypatch, libdir: Path, answers: Path) -> None:
    """The daemon (a child of this process) loads the stand-in: LD_LIBRARY_PATH comes before
    the system's library cache, so a real driver's library on a GPU machine is not used."""
    monkeypatch.setenv("LD_LIBRARY_PATH", f"{libdir}:{os.environ.get('LD_LIBRARY_PATH', '')}".rstrip(":"))
    monkeypatch.setenv("FAKE_NVML_CONFIG", str(answers))
    monkeypatch.setenv("PROFINFER_NVML_STALL_S", str(NVML_STALL_S))


def _metrics(d: Daemon) -> dict[tuple, float]:
    status, body = _get(d.url + "/metrics")
    assert status == 200
    out = {}
    for fam in text_string_to_metric_families(body.decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _gpu(m: dict[tuple, float]) -> dict[tuple, float]:
    return {k: v for k, v in m.items() if k[0].startswith("profinfer_gpu_")}


def _wait(d: Daemon, pred, what: str, timeout: float = 30) -> dict[tuple, float]:
    """/metrics, polled until pred holds (the daemon samples NVML once a scan, a second)."""
    deadline = time.monotonic() + timeout
    m = {}
    while time.monotonic() < deadline:
        assert d.proc.poll() is None, f"daemon exited:\n{d.text()}"
        m = _metrics(d)
        if pred(m):
            return m
        time.sleep(0.2)
    raise AssertionError(f"{what}: not within {timeout} s\n{json.dumps({str(k): v for k, v in _gpu(m).items()}, indent=1)}"
                         f"\n{d.text()}")


def _lines(d: Daemon, text: str) -> list[str]:
    return [line for line in d.text().splitlines() if text in line]


def _gpu_lines(text: str) -> list[str]:
    """What the daemon said about GPUs (its other lines: processes it found, if any)."""
    return [line for line in text.splitlines() if re.search(r"daemon: GPU (metrics|\d+:)", line)]


def _labels(gpu: str, uuid: str, **more) -> tuple:
    return tuple(sorted({"gpu": gpu, "uuid": uuid, **more}.items()))


UUID0 = "GPU-6c1b4b5e-0b4c-4d8e-9a2f-1c3d5e7f9a0b"
UUID1 = "GPU-0f9e8d7c-6b5a-4938-8271-605f4e3d2c1b"
H200 = 150754820096          # bytes, as NVML reports an H200's memory
GOOD = {
    "count": 2, "driver": "570.86.15",
    "0.name": "NVIDIA H200", "0.uuid": UUID0, "0.util": 37, "0.memutil": 12,
    "0.total": H200, "0.reserved": 527 << 20, "0.used": 41 * GiB + 123,
    "0.power": 412345,                                  # mW
    "0.procs": f"4242:{40 * GiB},4343:na,4444:{512 << 20}",   # 4343: not available (MIG)
    "1.name": "NVIDIA H200", "1.uuid": UUID1, "1.util": 5, "1.memutil": 0,
    "1.total": H200, "1.reserved": 527 << 20, "1.used": 1 << 20,
    "err.nvmlDeviceGetPowerUsage.1": 3,                  # NVML_ERROR_NOT_SUPPORTED on this one
    "err.nvmlDeviceGetMemoryInfo_v2.1": 13,              # as a driver before R510: FUNCTION_NOT_FOUND
}


def _expected(a: dict) -> dict[tuple, float]:
    """What /metrics must show for answers a: base units (ratio, bytes, watts), host pids."""
    out = {("profinfer_gpu_metrics_enabled", ()): 1.0}
    for i, uuid in (("0", a["0.uuid"]), ("1", a["1.uuid"])):
        lv = _labels(i, uuid)
        out[("profinfer_gpu_utilization_ratio", lv)] = a[f"{i}.util"] / 100
        out[("profinfer_gpu_memory_used_bytes", lv)] = float(a[f"{i}.used"])   # as nvidia-smi's
        if i == "1":          # an older driver's v1 answer: reserved memory counted as used
            out[("profinfer_gpu_memory_used_bytes", lv)] += a["1.reserved"]
        out[("profinfer_gpu_memory_total_bytes", lv)] = float(a[f"{i}.total"])
    out[("profinfer_gpu_power_watts", _labels("0", a["0.uuid"]))] = 412.345
    out[("profinfer_gpu_process_memory_bytes", _labels("0", a["0.uuid"], pid="4242"))] = float(40 * GiB)
    out[("profinfer_gpu_process_memory_bytes", _labels("0", a["0.uuid"], pid="4444"))] = float(512 << 20)
    return out


def test_nvml_answers_are_the_metrics_and_failures_mid_run_keep_the_daemon(fake_nvml_dir, tmp_path, monkeypatch):
    answers = Answers(tmp_path / "nvml-answers")
    answers.write(GOOD)
    _fake_env(monkeypatch, fake_nvml_dir, answers.path)
    d = Daemon(tmp_path)
    try:
        # the mapping: every GPU series, exactly; power not supported on GPU 1 is left out
        # quietly, a process whose memory NVML cannot tell is left out (not reported as 0),
        # memory used is NVML's v2 answer (without the reserved, as nvidia-smi and DCGM say it)
        # or, from a driver without it, the v1 answer
        want = _expected(GOOD)
        m = _wait(d, lambda m: _gpu(m) == want, "the GPU metrics equal NVML's answers")
        assert ("profinfer_processes_watched", ()) in m             # the daemon's own, beside them
        _, body = _get(d.url + "/metrics")
        for name in ("utilization_ratio", "memory_used_bytes", "memory_total_bytes", "power_watts",
                     "process_memory_bytes", "metrics_enabled"):
            assert f"# TYPE profinfer_gpu_{name} gauge" in body.decode()
        assert json.loads(_get(d.url + "/status")[1])["gpu"] == "on"
        assert [line.split("daemon: ", 1)[1] for line in _gpu_lines(d.text())] == [
            "GPU metrics on: NVML answers (driver 570.86.15)"]

        # sampled again at each scan: new answers, new values
        busy = {**GOOD, "0.util": 100, "0.used": 90 * GiB, "0.procs": f"4242:{89 * GiB}"}
        want = _expected(busy)
        del want[("profinfer_gpu_process_memory_bytes", _labels("0", UUID0, pid="4444"))]
        want[("profinfer_gpu_process_memory_bytes", _labels("0", UUID0, pid="4242"))] = float(89 * GiB)
        answers.write(busy)
        _wait(d, lambda m: _gpu(m) == want, "the GPU metrics follow NVML's new answers")

        # GPU 1 lost while the daemon runs (NVML_ERROR_GPU_IS_LOST for its handle and all):
        # its series go, GPU 0's stay, said once; back when it answers again
        answers.write({**busy, "1.lost": 1})
        gpu0 = {k: v for k, v in want.items() if ("gpu", "1") not in k[1]}
        _wait(d, lambda m: _gpu(m) == gpu0, "GPU 1's series gone, GPU 0's kept")
        answers.write(busy)
        _wait(d, lambda m: _gpu(m) == want, "GPU 1 back")
        assert len(_lines(d, "GPU 1: NVML: GPU is lost (what it does not answer is left out)")) == 1
        assert len(_lines(d, "GPU 1: answers again")) == 1

        # an answer pynvml cannot decode (a UUID that is not UTF-8): that device's trouble,
        # said once; its other values still there
        answers.write({**busy, "1.uuid": b"\xff\xfe-not-utf8"})
        _wait(d, lambda m: ("profinfer_gpu_memory_used_bytes", _labels("1", "")) in m,
              "GPU 1 without its UUID")
        assert len(_lines(d, "GPU 1: NVML: UnicodeDecodeError")) == 1
        answers.write(busy)
        _wait(d, lambda m: _gpu(m) == want, "GPU 1's UUID back")

        # an NVML call that blocks (the driver waiting on a GPU that stopped responding): GPU
        # metrics off after the stall limit, said once; the agent's loop and /healthz carry on
        answers.write({**busy, "block.nvmlDeviceGetUtilizationRates": 1})
        blocked = time.monotonic()
        off = {("profinfer_gpu_metrics_enabled", ()): 0.0}
        while _gpu(m := _metrics(d)) != off:
            assert _get(d.url + "/healthz")[0] == 200 and time.monotonic() - blocked < 30, d.text()
            time.sleep(0.2)
        # not before the limit (the sample under way may have begun a moment before the block)
        assert time.monotonic() - blocked >= NVML_STALL_S - 0.5, d.text()
        assert ("profinfer_processes_watched", ()) in m
        answers.write(busy)
        _wait(d, lambda m: _gpu(m) == want, "GPU metrics back once NVML answers")
        said = _lines(d, "GPU metrics are off")
        assert len(said) == 1 and said[0].endswith(
            f"GPU metrics are off: NVML has not answered for {NVML_STALL_S} s (a call blocks); the daemon's other "
            "metrics are unaffected (back when the call returns)"), said
        assert len(_lines(d, "GPU metrics on: NVML answers")) == 2

        # NVML fails as a whole (the device count: GPU is lost): GPU metrics off, said once,
        # the daemon up and serving its own metrics
        answers.write({**busy, "err.nvmlDeviceGetCount_v2": 15})
        m = _wait(d, lambda m: _gpu(m) == off, "GPU metrics off")
        assert ("profinfer_processes_watched", ()) in m and ("profinfer_collector_cpu_seconds_total", ()) in m
        assert json.loads(_get(d.url + "/status")[1])["gpu"] == "off: NVML stopped answering (NVML: GPU is lost)"
        time.sleep(3)                               # three more scans: still up, nothing more said
        assert d.proc.poll() is None and _get(d.url + "/healthz")[0] == 200
        assert _gpu(_metrics(d)) == off
        said = _lines(d, "GPU metrics are off: NVML stopped")
        assert len(said) == 1 and said[0].endswith(
            "GPU metrics are off: NVML stopped answering (NVML: GPU is lost); the daemon's other "
            "metrics are unaffected (NVML tried again every 60 s)"), said
    finally:
        d.stop()
    log = (tmp_path / "daemon.log").read_text()   # on, GPU 1 lost and back twice, off, on, off
    assert len(_gpu_lines(log)) == 8 and "Traceback" not in log, log


def test_daemon_stops_while_an_nvml_call_blocks(fake_nvml_dir, tmp_path, monkeypatch):
    """SIGTERM while the NVML thread is stuck in the driver: the daemon detaches and exits
    (the thread is not waited for)."""
    answers = Answers(tmp_path / "nvml-answers")
    answers.write(GOOD)
    _fake_env(monkeypatch, fake_nvml_dir, answers.path)
    d = Daemon(tmp_path)
    try:
        _wait(d, lambda m: _gpu(m) == _expected(GOOD), "the GPU metrics")
        answers.write({**GOOD, "block.nvmlDeviceGetMemoryInfo_v2": 1})
        _wait(d, lambda m: _gpu(m) == {("profinfer_gpu_metrics_enabled", ()): 0.0}, "GPU metrics off")
    finally:
        t0 = time.monotonic()
        d.stop()
        took = time.monotonic() - t0
    log = (tmp_path / "daemon.log").read_text()
    assert d.proc.returncode == 0 and "stopped: every probe detached" in log and took < 20, (took, log)


def _real_nvml_present() -> bool:
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
        return True
    except OSError:
        return False


@pytest.mark.parametrize("case", ["no library", "no driver loaded"])
def test_without_a_driver_gpu_metrics_are_off_said_once(case, fake_nvml_dir, tmp_path, monkeypatch):
    if case == "no library":
        if _real_nvml_present():
            pytest.skip("this machine has a driver's libnvidia-ml.so.1 (the stand-in's case covers it)")
        empty = tmp_path / "no-nvml"
        empty.mkdir()
        monkeypatch.setenv("LD_LIBRARY_PATH", str(empty))
        why = "no NVIDIA driver library (libnvidia-ml.so.1 not found)"
    else:              # the library is there (a container with it mounted), the driver is not
        answers = Answers(tmp_path / "nvml-answers")
        answers.write({"err.nvmlInitWithFlags": 9})         # NVML_ERROR_DRIVER_NOT_LOADED
        _fake_env(monkeypatch, fake_nvml_dir, answers.path)
        why = "NVML: Driver Not Loaded"
    d = Daemon(tmp_path)
    try:
        deadline = time.monotonic() + 30                # NVML's first answer, in /status
        while json.loads(_get(d.url + "/status")[1])["gpu"] != f"off: {why}":
            assert time.monotonic() < deadline and d.proc.poll() is None, d.text()
            time.sleep(0.2)
        m = _metrics(d)
        assert _gpu(m) == {("profinfer_gpu_metrics_enabled", ()): 0.0}
        assert ("profinfer_processes_watched", ()) in m and ("profinfer_collector_cpu_seconds_total", ()) in m
        time.sleep(3)                               # three more scans: still up, nothing more said
        assert d.proc.poll() is None and _get(d.url + "/healthz")[0] == 200
        said = _gpu_lines(d.text())
        assert len(said) == 1 and said[0].endswith(
            f"profinfer daemon: GPU metrics are off: {why}; the daemon's other metrics are "
            "unaffected (NVML tried again every 60 s)"), said
    finally:
        d.stop()
    log = (tmp_path / "daemon.log").read_text()
    assert "Traceback" not in log, log


def test_manifest_gives_the_pod_nvml():
    """The DaemonSet's pod asks the NVIDIA container runtime for the driver's NVML library
    (env), and names the runtime class as an option: commented, and valid once uncommented."""
    import kubernetes_validate
    import yaml
    manifest = HERE.parents[1] / "deploy" / "kubernetes" / "profinfer.yaml"
    text = manifest.read_text()

    def pod(t: str) -> dict:
        ds = next(d for d in yaml.safe_load_all(t) if d and d["kind"] == "DaemonSet")
        kubernetes_validate.validate(ds, kubernetes_validate.latest_version(), strict=True)
        return ds["spec"]["template"]["spec"]

    (c,) = pod(text)["containers"]
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all" and env["NVIDIA_DRIVER_CAPABILITIES"] == "utility"
    assert "runtimeClassName" not in pod(text)       # not every cluster has the class
    line = re.compile(r"^(\s*)# (runtimeClassName: nvidia)$", re.M)
    assert len(line.findall(text)) == 1
    assert pod(line.sub(r"\1\2", text))["runtimeClassName"] == "nvidia"


FAKE_SMI = r'''#!PYTHON
"""nvidia-smi's CSV answers (--format=csv,noheader,nounits) from the stand-in NVML's
answers file: memory in MiB (used as the driver says it: without the reserved since R510)."""
import os, sys
a = {}
for line in open(os.environ["FAKE_NVML_CONFIG"], "rb"):
    k, _, v = line.rstrip(b"\n").partition(b" ")
    a[k.decode()] = v.decode(errors="replace")
n = lambda k: int(a.get(k, "0"), 0)
q = next(x for x in sys.argv[1:] if x.startswith("--query-"))
for i in range(n("count")):
    old = a.get(f"err.nvmlDeviceGetMemoryInfo_v2.{i}") or os.environ.get("FAKE_SMI_V1_USED")
    extra = n(f"{i}.reserved") if old else 0        # a driver before R510: used with the reserved
    if q.startswith("--query-gpu="):
        print(f"{i}, {a[f'{i}.uuid']}, {(n(f'{i}.used') + extra) >> 20}, {n(f'{i}.total') >> 20}, {n(f'{i}.util')}")
    else:
        for p in filter(None, a.get(f"{i}.procs", "").split(",")):
            pid, b = p.split(":")
            print(f"{a[f'{i}.uuid']}, {pid}, {'[N/A]' if b == 'na' else int(b) >> 20}")
'''


def test_gpu_metrics_check_script(fake_nvml_dir, tmp_path, monkeypatch):
    """bench/gpu_metrics_check.py (gpu_check.sh's GPU metrics part) here, against the stand-in
    NVML and an nvidia-smi that answers from the same file: PASS where the daemon and
    nvidia-smi agree, FAIL where nvidia-smi says otherwise (memory used with the reserved
    counted, as the v1 query would say it), one FAIL line without nvidia-smi."""
    import sys
    answers = Answers(tmp_path / "nvml-answers")
    answers.write(GOOD)
    _fake_env(monkeypatch, fake_nvml_dir, answers.path)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text(FAKE_SMI.replace("PYTHON", sys.executable))
    (bin_dir / "nvidia-smi").chmod(0o755)
    check = [sys.executable, str(HERE.parents[1] / "bench" / "gpu_metrics_check.py"), "--samples", "2"]

    def run(path: str, **env) -> subprocess.CompletedProcess:
        return subprocess.run(check, capture_output=True, text=True, timeout=300,
                              env={**os.environ, "PATH": path, **env})

    ok = run(str(bin_dir))
    assert ok.returncode == 0 and "FAIL" not in ok.stdout and ok.stderr == "", ok.stdout + ok.stderr
    assert ok.stdout.count("PASS ") == 5, ok.stdout
    bad = run(str(bin_dir), FAKE_SMI_V1_USED="1")
    assert bad.returncode == 1 and bad.stderr == "", bad.stdout + bad.stderr
    assert [line for line in bad.stdout.splitlines() if line.startswith("FAIL")] == [
        "FAIL idle: memory used equals nvidia-smi's (1 MiB, and what it moved meanwhile)"], bad.stdout
    empty = tmp_path / "nothing"
    empty.mkdir()
    none = run(str(empty))
    assert none.returncode == 1 and none.stderr == "" and "Traceback" not in none.stdout, none.stdout + none.stderr
    assert [line for line in none.stdout.splitlines() if line.startswith("FAIL")] == [
        "FAIL the check ran: nvidia-smi not found (a GPU machine with NVIDIA's driver is needed)"], none.stdout
