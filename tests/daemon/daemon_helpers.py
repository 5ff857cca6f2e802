"""What the daemon's tests share: the daemon run as its command, a llama.cpp workload
waiting on a FIFO for its prompt (so that the daemon finds it before it decodes), HTTP."""
from __future__ import annotations

import json
from collections import Counter
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from conftest import PROMPT, completion_cmd, free_port as _free_port

CUDA_COPY_KINDS = {0: "H2H", 1: "H2D", 2: "D2H", 3: "D2D", 4: "Default"}

PROFINFER = [sys.executable, "-m", "profinfer.cli"]
MANIFEST = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes" / "profinfer.yaml"


def manifest_caps() -> list[str]:
    """The capabilities the DaemonSet's container is given (read from the manifest)."""
    import yaml
    ds = next(d for d in yaml.safe_load_all(MANIFEST.read_text()) if d and d["kind"] == "DaemonSet")
    (c,) = ds["spec"]["template"]["spec"]["containers"]
    sc = c["securityContext"]["capabilities"]
    assert sc["drop"] == ["ALL"]
    return list(sc["add"])


def with_caps(caps) -> list[str]:
    """setpriv: run as root with exactly these capabilities (the bounding set, as a container
    runtime sets it: root's permitted and effective sets become it; none inherited)."""
    return ["setpriv", "--bounding-set=-all" + "".join(f",+{c.lower()}" for c in caps),
            "--inh-caps=-all", "--ambient-caps=-all", "--"]


def _get(url: str, token: str | None = None, method: str = "GET", timeout: float = 30, context=None):
    req = urllib.request.Request(url, method=method,
                                 headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout, context=context) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


class Daemon:
    def __init__(self, tmp_path: Path, extra: tuple[str, ...] = (), prefix: tuple[str, ...] = (),
                 env: dict | None = None, cwd: Path | None = None, command: list[str] = PROFINFER,
                 listen: str = "127.0.0.1", url: str | None = None):
        """prefix: what runs the daemon's command (setpriv with a capability set). With
        PROFINFER_TEST_DAEMON_CAPS=manifest every daemon test runs with the manifest's.
        A PROFINFER_TOKEN in env is the token (no file made); url: where it is reached (an
        https:// one is checked against the certificate in extra's --tls-cert)."""
        if not prefix and os.environ.get("PROFINFER_TEST_DAEMON_CAPS") == "manifest":
            prefix = tuple(with_caps(manifest_caps()))
        self.tmp_path = tmp_path
        self.port = _free_port()
        self.url = f"{url or 'http://127.0.0.1'}:{self.port}"
        self.token_file = tmp_path / "token"
        self.log = open(tmp_path / "daemon.log", "w+")
        self.proc = subprocess.Popen([*prefix, *command, "daemon", "--listen", f"{listen}:{self.port}",
                                      "--token-file", str(self.token_file), *extra],
                                     stderr=self.log, stdout=self.log, env=env, cwd=cwd)
        self.context = None
        if self.url.startswith("https:"):
            import ssl
            self.context = ssl.create_default_context(cafile=extra[list(extra).index("--tls-cert") + 1])
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if _get(self.url + "/healthz", context=self.context)[0] == 200:
                    break
            except OSError:
                pass
            assert self.proc.poll() is None, self.text()
            time.sleep(0.1)
        self.token = extra[list(extra).index("--token") + 1] if "--token" in extra else (env or {}).get("PROFINFER_TOKEN")
        if not self.token:
            self.token = self.token_file.read_text().strip()
            assert (self.token_file.stat().st_mode & 0o777) == 0o600

    def text(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def watched(self, pid: int, timeout: float = 15) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            status = json.loads(_get(self.url + "/status", self.token, context=self.context)[1])
            found = [p for p in status["processes"] if p["pid"] == pid]
            if found:
                return found[0]
            time.sleep(0.1)
        raise AssertionError(f"PID {pid} not watched within {timeout} s:\n{self.text()}")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)
        self.log.close()


_STARTED: list[subprocess.Popen] = []


def kill_started() -> None:
    """What a test started and left waiting on its FIFO (a failed test) is killed."""
    while _STARTED:
        p = _STARTED.pop()
        if p.poll() is None:
            p.kill()
            p.wait()


class Workload:
    """llama-completion waiting for its prompt on a FIFO."""

    def __init__(self, llama_build, model, llama_env, tmp_path: Path, n: int = 24,
                 extra: tuple[str, ...] = ()):
        self.fifo = tmp_path / f"prompt-{time.monotonic_ns()}"
        os.mkfifo(self.fifo)
        cmd = completion_cmd(llama_build, model, n=n, extra=extra)
        i = cmd.index("-p")
        cmd[i:i + 2] = ["-f", str(self.fifo)]
        self.proc = subprocess.Popen(cmd, env=llama_env, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True)
        _STARTED.append(self.proc)

    def go(self, prompt: str = PROMPT) -> None:
        with open(self.fifo, "w") as f:
            f.write(prompt)

    def finish(self) -> str:
        _, err = self.proc.communicate(timeout=120)
        assert self.proc.returncode == 0, err
        return err


def series(text: str, name: str, pid: int, label: str | None) -> dict[str, float]:
    """One process's samples of a metric in a /metrics text, by the value of `label`."""
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{") and f'pid="{pid}"' in line:
            key = line.split(f'{label}="', 1)[1].split('"', 1)[0] if label else ""
            out[key] = float(line.rsplit(" ", 1)[1])
    return out


def cuda_log_counts(log: Path) -> tuple[Counter, Counter, int]:
    """What a CUDA test program's own log counts: launches by kernel, bytes by copy kind,
    graph launches (the daemon's metrics' terms)."""
    entries = [json.loads(l) for l in log.read_text().splitlines()]
    kernels = Counter(d_["kernel"] if d_["fn"].startswith("cuda") else f"CUfunction@{d_['func']}"
                      for d_ in entries if d_["fn"] in ("cudaLaunchKernel", "cudaLaunchKernelExC",
                                                         "cuLaunchKernel", "cuLaunchKernelEx"))
    copied: Counter = Counter()
    for e in entries:
        if e["fn"].startswith("cudaMemcpy"):
            copied[CUDA_COPY_KINDS[e["kind"]]] += e["bytes"]
        elif e["fn"].startswith("cudaMemset"):
            copied["memset"] += e["bytes"]
    return kernels, copied, sum(1 for e in entries if e["fn"] == "cudaGraphLaunch")


def runtime_spec(host: Path, container: str, pod_uid: str, pod: str, namespace: str,
                 runtime: str = "containerd") -> Path:
    """A container runtime's spec of a container in a pod, where and as the runtime writes it
    (containerd's CRI plugin: the bundle's config.json; CRI-O: its userdata config.json;
    cri-dockerd: docker's config.v2.json, the kubelet's labels), under `host` (the host's
    root the daemon is pointed at with PROFINFER_HOST_ROOT)."""
    if runtime == "containerd":
        spec = host / "run/containerd/io.containerd.runtime.v2.task/k8s.io" / container / "config.json"
        doc = {"ociVersion": "1.1.0", "annotations": {
            "io.kubernetes.cri.container-type": "container", "io.kubernetes.cri.container-name": "main",
            "io.kubernetes.cri.sandbox-id": "f" * 64, "io.kubernetes.cri.sandbox-uid": pod_uid,
            "io.kubernetes.cri.sandbox-name": pod, "io.kubernetes.cri.sandbox-namespace": namespace}}
    elif runtime == "cri-o":
        spec = host / "run/containers/storage/overlay-containers" / container / "userdata/config.json"
        doc = {"ociVersion": "1.0.2-dev", "annotations": {
            "io.kubernetes.container.name": "main", "io.kubernetes.cri-o.SandboxID": "f" * 64,
            "io.kubernetes.pod.uid": pod_uid, "io.kubernetes.pod.name": pod,
            "io.kubernetes.pod.namespace": namespace}}
    else:
        spec = host / "var/lib/docker/containers" / container / "config.v2.json"
        doc = {"ID": container, "Config": {"Labels": {
            "io.kubernetes.container.name": "main", "io.kubernetes.docker.type": "container",
            "io.kubernetes.pod.uid": pod_uid, "io.kubernetes.pod.name": pod,
            "io.kubernetes.pod.namespace": namespace}}}
    spec.parent.mkdir(parents=True)
    spec.write_text(json.dumps(doc))
    spec.chmod(0o644)
    return spec


_TENANT = """
import ctypes, os, sys
if sys.argv[2]:
    ctypes.CDLL(None).prctl(15, sys.argv[2].encode(), 0, 0, 0)   # PR_SET_NAME: its comm
ctypes.CDLL(sys.argv[1])
print("ready", os.getpid(), flush=True)
sys.stdin.read()
"""


def cudart_tenant(cudart: Path, python: str = sys.executable, comm: str = "", env: dict | None = None,
                  preexec_fn=None, prefix: tuple[str, ...] = ()) -> subprocess.Popen:
    """A process in its own mount namespace that loads a CUDA runtime (what the daemon
    watches: no GPU needed to load one) and waits, until its stdin closes, with a comm of
    its choosing. Its pid as its own PID namespace numbers it: `.ns_pid`."""
    proc = subprocess.Popen([*prefix, "unshare", "--mount", python, "-c", _TENANT, str(cudart), comm],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env=env if env is not None else {"PATH": "/usr/bin:/bin"}, preexec_fn=preexec_fn)
    _STARTED.append(proc)
    ready, pid = proc.stdout.readline().split()
    assert ready == "ready"
    proc.ns_pid = int(pid)
    return proc


class OtlpReceiver:
    """An OTLP/HTTP endpoint for metrics and logs: each request decoded with OpenTelemetry's
    protobufs."""

    def __init__(self):
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
        from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
        from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
        received = self.requests = []
        kinds = {"/v1/metrics": ExportMetricsServiceRequest, "/v1/logs": ExportLogsServiceRequest}

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                received.append((self.path, kinds[self.path].FromString(body)))
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def points(self, name: str) -> list:
        """Every data point of `name` received so far (delta temporality: each is what
        happened since the previous export)."""
        out = []
        for path, req in list(self.requests):
            if path != "/v1/metrics":
                continue
            for rm in req.resource_metrics:
                for sm in rm.scope_metrics:
                    for m in sm.metrics:
                        if m.name == name:
                            data = getattr(m, m.WhichOneof("data"))
                            assert data.aggregation_temporality == 1     # DELTA
                            out.extend(data.data_points)
        return out

    def events(self, name: str) -> list:
        """Every log record with event name `name` received so far."""
        return [r for path, req in list(self.requests) if path == "/v1/logs"
                for rl in req.resource_logs for sl in rl.scope_logs for r in sl.log_records if r.event_name == name]

    def close(self):
        self.server.shutdown()


def discovering_daemon(tmp_path, env: dict | None = None) -> Daemon:
    """A daemon whose discovery runs from the kernel (it holds processes that map an
    engine): the tests of what it finds and holds would say nothing otherwise."""
    d = Daemon(tmp_path, env=env)
    status = json.loads(_get(d.url + "/status")[1])
    assert "loaders_hooked" in status["discovery"], status["discovery"]
    return d
