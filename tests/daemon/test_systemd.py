"""The systemd unit (deploy/systemd/profinfer.service) started by systemd, as a host starts
it: systemd boots as PID 1 in a container (the profinfer image plus Debian's systemd package,
built here and cached by content), the unit file is installed as it is shipped, and
`systemctl start profinfer` runs it. Then, from outside the daemon (the kernel's /proc, the
cgroup files, the program's own log):

- its sandbox is in force: a seccomp filter, no new privileges, the unit's capabilities and no
  others, a /tmp of its own, a read-only root, /proc/sys and /sys/fs/cgroup read-only, the
  memory and task limits in its cgroup, no device but the pseudo ones (and GPUs');
- it watches a CUDA program started beside it, and counts its calls as the program logs them;
- POST /capture with the token works, its trace written in the service's private /tmp.

The container is privileged (systemd needs it to build the sandbox: namespaces, mounts,
seccomp, cgroups); the unit's own CapabilityBoundingSet bounds the daemon, which is checked.
The container's PID namespace is its own (systemd must be PID 1), while the daemon's BPF names
processes by their host pids: the workload gets the same pid in both (same_pid.py), as every
process has on a host.

`systemd-analyze security --offline=true deploy/systemd/profinfer.service` (systemd 252):
exposure 7.3 MEDIUM before this sandbox, 3.3 OK with it (bench/results.md)."""
from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest

from daemon_helpers import cuda_log_counts, series
from profinfer.levels.cuda import workload as cuda_workload

from test_daemon_cuda import PROGRAM as CUDA_PROGRAM
from test_pod import _podman

REPO = Path(__file__).resolve().parents[2]
UNIT = REPO / "deploy" / "systemd" / "profinfer.service"
SAME_PID = Path(__file__).with_name("same_pid.py")
IMAGE = "localhost/profinfer-systemd:test"
CTR = "profinfer-systemd-test"
URL = "http://127.0.0.1:9464"          # the unit's --listen, inside the container
ENV = {**os.environ, "CONTAINERS_CONF": str(REPO / "deploy" / "containers.conf")}
# the image: the daemon's, with systemd as its init (and curl, libstdc++ for the test program)
CONTAINERFILE = """FROM {base}
RUN apt-get update && apt-get install -y --no-install-recommends systemd systemd-sysv curl libstdc++6 \\
    && rm -rf /var/lib/apt/lists/*
ENTRYPOINT ["/lib/systemd/systemd"]
"""
# The image's BPF objects are its wheel's, found by the package itself: nothing is added to
# the unit.


def _image() -> str:
    """The systemd image, rebuilt only when its base or its Containerfile changed."""
    base = subprocess.run([str(REPO / "deploy" / "build-image.sh")], capture_output=True, text=True,
                          timeout=1800)
    assert base.returncode == 0, base.stderr[-3000:]
    base_name = base.stdout.strip()
    text = CONTAINERFILE.format(base=base_name)
    base_id = _podman("image", "inspect", "--format", "{{.Id}}", base_name).stdout.strip()
    content = hashlib.sha256((base_id + text).encode()).hexdigest()[:16]
    have = _podman("image", "inspect", "--format", '{{index .Labels "profinfer.content"}}', IMAGE,
                   check=False).stdout.strip()
    if have != content:
        with tempfile.TemporaryDirectory() as ctx:
            (Path(ctx) / "Containerfile").write_text(text)
            _podman("build", "--pull=never", "--label", f"profinfer.content={content}", "-t", IMAGE, ctx,
                    timeout=900)
    return IMAGE


def _exec(*args: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
    return _podman("exec", CTR, *args, check=check, timeout=timeout)


def _journal() -> str:
    return _exec("journalctl", "-u", "profinfer", "--no-pager", "-o", "cat", check=False).stdout[-4000:]


def _unit_value(key: str) -> str:
    (value,) = re.findall(rf"^{key}=(.*)$", UNIT.read_text(), re.M)
    return value.strip()


def _http(path: str, token: str | None = None, method: str = "GET", out: str = "-",
          timeout: float = 30) -> tuple[int, bytes]:
    """curl inside the container (the daemon listens on its loopback): (status, body)."""
    args = ["curl", "-s", "-X", method, "-o", out, "-w", "\n%{http_code}", "--max-time", str(int(timeout))]
    if token:
        args += ["-H", f"Authorization: Bearer {token}"]
    done = subprocess.run(["podman", "exec", CTR, *args, URL + path], capture_output=True, env=ENV,
                          timeout=timeout + 30)
    body, _, code = done.stdout.rpartition(b"\n")
    return int(code or 0), body


@pytest.fixture(scope="module")
def unit():
    image = _image()
    program = cuda_workload.build_program(CUDA_PROGRAM, "shared")
    cudart = cuda_workload.toolkit_cudart().parent       # its RUNPATH: mounted where it points
    libcuda = cuda_workload.ensure_libcuda()
    _podman("run", "--detach", "--replace", "--name", CTR, "--privileged", "--systemd=always",
            "--cgroupns=private",
            "--volume", f"{program}:/work/program:ro", "--volume", f"{cudart}:{cudart}:ro",
            "--volume", f"{libcuda.parent}:/work/libcuda:ro",
            "--volume", f"{SAME_PID}:/work/same_pid.py:ro", image)
    try:
        deadline = time.monotonic() + 60
        while _exec("systemctl", "is-system-running", check=False).stdout.strip() not in ("running", "degraded"):
            assert time.monotonic() < deadline, _podman("logs", CTR, check=False).stdout[-3000:]
            time.sleep(0.5)
        _podman("cp", str(UNIT), f"{CTR}:/etc/systemd/system/profinfer.service")
        # the node's bpffs, as a host's systemd mounts it at boot (the container has none)
        _exec("sh", "-c", "mountpoint -q /sys/fs/bpf || mount -t bpf bpf /sys/fs/bpf")
        _exec("systemctl", "daemon-reload")
        _exec("systemctl", "start", "profinfer")
        deadline = time.monotonic() + 60
        while True:
            try:
                if _http("/healthz", timeout=5)[0] == 200:
                    break
            except (subprocess.TimeoutExpired, ValueError):
                pass
            assert time.monotonic() < deadline, "/healthz did not answer:\n" + _journal()
            assert _exec("systemctl", "is-active", "profinfer", check=False).stdout.strip() in (
                "active", "activating"), _journal()
            time.sleep(0.5)
        pid = int(_exec("systemctl", "show", "-p", "MainPID", "--value", "profinfer").stdout)
        token = _exec("cat", "/run/profinfer/token").stdout.strip()
        yield {"pid": pid, "token": token, "libcuda": "/work/libcuda/" + libcuda.name}
    finally:
        _podman("rm", "-f", "-t", "5", CTR, check=False)


def _status(pid: int) -> dict[str, str]:
    text = _exec("cat", f"/proc/{pid}/status").stdout
    return dict(l.split(":", 1) for l in text.splitlines() if ":" in l)


def _mounts(pid: int) -> dict[str, set[str]]:
    """Its mount namespace: each mount point's options (the last mount on a path wins)."""
    out = {}
    for line in _exec("cat", f"/proc/{pid}/mountinfo").stdout.splitlines():
        f = line.split()
        out[f[4]] = set(f[5].split(","))
    return out


def test_the_unit_runs_in_its_sandbox(unit):
    pid = unit["pid"]
    assert _exec("systemctl", "is-active", "profinfer").stdout.strip() == "active"
    status = _status(pid)
    assert status["Seccomp"].strip() == "2"               # a filter: SystemCallFilter, ...
    assert status["NoNewPrivs"].strip() == "1"
    # its capabilities are the unit's, as systemd-analyze numbers them, and no others
    names = _unit_value("CapabilityBoundingSet").split()
    numbers = subprocess.run(["systemd-analyze", "capability", *names], capture_output=True, text=True,
                             check=True).stdout.split("\n", 1)[1].split()[1::2]
    want = sum(1 << int(n) for n in numbers)
    assert len(numbers) == len(names)
    for field in ("CapEff", "CapPrm", "CapBnd"):
        assert int(status[field], 16) == want, (field, status[field], hex(want))
    # a /tmp of its own (not the container's), writable; the rest read-only but its own dirs
    mounts = _mounts(pid)
    for ro in ("/", "/proc/sys", "/sys/fs/cgroup", "/sys/fs/cgroup/memory"):
        assert "ro" in mounts[ro], (ro, mounts)
    for rw in ("/tmp", "/var/tmp", "/run/profinfer", "/var/cache/profinfer"):
        assert "rw" in mounts[rw], rw
    # ProtectKernelLogs: the kernel's log mounted over (inaccessible); ProtectHostname: a UTS
    # namespace of its own
    assert "/proc/kmsg" in mounts and "/dev/kmsg" in mounts
    # the node's maps (the processes a `record` follows, those discovery holds), pinned by the
    # privileged ExecStartPre (profinfer.core.ebpf.make_pins) where the daemon's sandbox keeps
    # /sys/fs/bpf read-only
    assert "ro" in mounts["/sys/fs/bpf"]
    for pin in ("recorded", "held"):
        assert _exec("stat", "-c", "%a %u %U", f"/sys/fs/bpf/profinfer/{pin}").stdout.split() == ["600", "0", "root"]
    assert _exec("readlink", f"/proc/{pid}/ns/uts").stdout != _exec("readlink", "/proc/1/ns/uts").stdout
    ours = _exec("stat", "-c", "%d:%i", "/tmp").stdout
    its = _exec("stat", "-L", "-c", "%d:%i", f"/proc/{pid}/root/tmp").stdout
    assert ours != its
    # the limits, in its cgroup (cgroup v1 here: memory and pids controllers)
    cgroups = dict(l.split(":", 2)[1:] for l in _exec("cat", f"/proc/{pid}/cgroup").stdout.splitlines())
    limit = _exec("cat", f"/sys/fs/cgroup/memory{cgroups['memory']}/memory.limit_in_bytes").stdout.strip()
    assert int(limit) == int(_exec("systemctl", "show", "-p", "MemoryMax", "--value", "profinfer").stdout)
    assert int(limit) == 512 << 20 and _unit_value("MemoryMax") == "512M"
    tasks = _exec("cat", f"/sys/fs/cgroup/pids{cgroups['pids']}/pids.max").stdout.strip()
    assert tasks == _unit_value("TasksMax")
    # its devices: the pseudo ones only (and GPUs', none here). A shell in its device cgroup
    # opens /dev/null but not the kernel's log device (refused by the cgroup: EPERM)
    devices = f"/sys/fs/cgroup/devices{cgroups['devices']}"
    probe = _exec("sh", "-c", f"echo $$ > {devices}/cgroup.procs || exit 3; head -c0 /dev/null || exit 4; "
                              "exec head -c0 /dev/kmsg", check=False)
    assert probe.returncode == 1 and "Operation not permitted" in probe.stderr, probe
    # systemd read every directive (one it cannot parse is ignored with a warning, and the
    # service starts without it)
    verify = _exec("systemd-analyze", "verify", "profinfer.service", check=False)
    assert verify.returncode == 0 and not verify.stderr.strip(), verify.stderr
    # nothing the sandbox refused (seccomp: EPERM, or ENOSYS; a read-only mount)
    journal = _journal()
    assert not re.search("Function not implemented|Operation not permitted|Read-only file system|Traceback",
                         journal), journal


class Program:
    """The CUDA test program (linked to the shared runtime) in the container, its pid the same there and on the host,
    waiting for /work/go-N before its calls, with libcuda loaded before it waits: the daemon, in
    the container's PID namespace, finds processes by scanning /proc alone (no discovery from
    the kernel to hold a process at a later dlopen; that is tests/daemon/test_node_discovery.py's)."""

    def __init__(self, unit, repeat: int, log: str):
        self.go = f"/tmp/go-{time.monotonic_ns()}"
        self.log = log
        self.proc = subprocess.Popen(
            ["podman", "exec", CTR, "python3", "/work/same_pid.py", Path("/proc/sys/kernel/pid_max").read_text().strip(),
             "/work/program", "--log", log, "--repeat", str(repeat), "--libcuda", unit["libcuda"],
             "--libcuda-early", "--start-after", self.go],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
        line = self.proc.stdout.readline()
        assert line.startswith("pid "), (line, self.proc.stderr.read() if self.proc.poll() is not None else "")
        self.pid = int(line.split()[1])
        assert self.proc.stdout.readline().startswith("ready ")
        # the same pid in both namespaces (the host's /proc shows it too, as the program)
        exe, program = os.stat(f"/proc/{self.pid}/exe"), os.stat(cuda_workload.build_program(CUDA_PROGRAM, "shared"))
        assert (exe.st_dev, exe.st_ino) == (program.st_dev, program.st_ino)

    def start(self) -> None:
        _exec("touch", self.go)

    def kill(self) -> None:
        _exec("sh", "-c", f"kill -9 {self.pid}", check=False)
        self.proc.wait(timeout=30)


def _watched(unit, pid: int, timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [p for p in json.loads(_http("/status", unit["token"])[1])["processes"] if p["pid"] == pid]
        groups = [g for g in json.loads(_http("/status", unit["token"])[1])["shared_probes"]
                  if g["engine"] == "CUDA" and pid in g["processes"]]
        if found and "cuda" in found[0]["levels"] and any("libcuda.so" in f for g in groups for f in g["files"]):
            return found[0]
        time.sleep(0.3)
    raise AssertionError(f"PID {pid} not watched at the cuda level:\n{_journal()}")


def test_it_counts_a_cuda_program_as_the_program_logs(unit, tmp_path):
    p = Program(unit, 2, "/tmp/calls.jsonl")
    try:
        assert _watched(unit, p.pid)["engine"] == "CUDA"
        p.start()
        assert p.proc.wait(timeout=60) == 0, p.proc.stderr.read()
    finally:
        p.kill()
    log = tmp_path / "calls.jsonl"
    log.write_text(_exec("cat", p.log).stdout)
    kernels, copied, graphs = cuda_log_counts(log)
    assert kernels and copied

    def got(text):
        return ({k: int(v) for k, v in series(text, "profinfer_cuda_kernel_launches_total", p.pid, "kernel").items()},
                {k: int(v) for k, v in series(text, "profinfer_cuda_copy_bytes_total", p.pid, "kind").items()})

    deadline, text = time.monotonic() + 30, ""
    while time.monotonic() < deadline:
        text = _http("/metrics")[1].decode()
        if got(text) == (dict(kernels), dict(copied)):
            break
        time.sleep(0.5)
    assert got(text) == (dict(kernels), dict(copied)), _journal()
    assert series(text, "profinfer_cuda_graph_launches_total", p.pid, None) == {"": graphs}
    assert sum(series(text, "profinfer_events_lost_total", p.pid, None).values()) == 0


def test_a_capture_writes_its_trace_in_the_private_tmp(unit, tmp_path):
    """A program calling for minutes (killed afterwards), captured for 2 s at the cuda level:
    the capture's temporary directory appears in the service's own /tmp (systemd's
    /tmp/systemd-private-*-profinfer.service-*/tmp on the host's side), and goes; the trace is
    the program's calls."""
    from profinfer.exporters.trace_reader import read_trace
    p = Program(unit, 100000, "/tmp/long-calls.jsonl")
    private = "/tmp/systemd-private-*-profinfer.service-*/tmp"
    try:
        _watched(unit, p.pid)
        p.start()
        result = {}
        t = threading.Thread(target=lambda: result.setdefault("r", _http(
            f"/capture?pid={p.pid}&seconds=2&levels=cuda", unit["token"], "POST", out="/tmp/captured.pftrace",
            timeout=240)))
        t.start()
        seen = set()
        while t.is_alive():
            seen |= set(_exec("sh", "-c", f"ls -A {private}", check=False).stdout.split())
            time.sleep(0.1)
        t.join()
        code, body = result["r"]
        assert code == 200, (_exec("head", "-c", "500", "/tmp/captured.pftrace", check=False).stdout, _journal())
        assert any(name.startswith("profinfer-capture-") for name in seen), seen
        assert _exec("sh", "-c", f"ls -A {private}").stdout.strip() == ""     # and gone
        assert _exec("systemctl", "is-active", "profinfer").stdout.strip() == "active"
    finally:
        p.kill()
    trace = tmp_path / "captured.pftrace"
    trace.write_bytes(subprocess.run(["podman", "exec", CTR, "cat", "/tmp/captured.pftrace"],
                                     capture_output=True, check=True, env=ENV).stdout)
    prof = read_trace(trace)
    calls = [c for c in prof.cuda_calls if c.what != "registration"]
    assert prof.pid == p.pid and calls and {c.pid for c in calls} == {p.pid}
    # each call one the program logs (each repeat makes the same calls), launches among them
    logged = [json.loads(l) for l in _exec("head", "-n", "2000", p.log).stdout.splitlines()[:-1]]
    assert {c.api for c in calls} <= {d["fn"] for d in logged}
    kernels = {c.kernel for c in calls if c.api.startswith("cudaLaunch")}
    assert kernels and kernels <= {d["kernel"] for d in logged if d["fn"].startswith("cudaLaunch")}
