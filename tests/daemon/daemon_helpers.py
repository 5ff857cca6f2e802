"""What the daemon's tests share: the daemon run as its command, a llama.cpp workload
waiting on a FIFO for its prompt (so that the daemon finds it before it decodes), HTTP."""
from __future__ import annotations

import json
from collections import Counter
import os
import subprocess
import sys
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


def _get(url: str, token: str | None = None, method: str = "GET", timeout: float = 30):
    req = urllib.request.Request(url, method=method,
                                 headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


class Daemon:
    def __init__(self, tmp_path: Path, extra: tuple[str, ...] = (), prefix: tuple[str, ...] = (),
                 env: dict | None = None, host: str = "127.0.0.1"):
        """prefix: what runs the daemon's command (setpriv with a capability set). With
        PROFINFER_TEST_DAEMON_CAPS=manifest every daemon test runs with the manifest's.
        host: the address it listens on (reached at 127.0.0.1 all the same)."""
        if not prefix and os.environ.get("PROFINFER_TEST_DAEMON_CAPS") == "manifest":
            prefix = tuple(with_caps(manifest_caps()))
        self.tmp_path = tmp_path
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.token_file = tmp_path / "token"
        self.log = open(tmp_path / "daemon.log", "w+")
        self.proc = subprocess.Popen([*prefix, *PROFINFER, "daemon", "--listen", f"{host}:{self.port}",
                                      "--token-file", str(self.token_file), *extra],
                                     stderr=self.log, stdout=self.log, env=env)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if _get(self.url + "/healthz")[0] == 200:
                    break
            except OSError:
                pass
            assert self.proc.poll() is None, self.text()
            time.sleep(0.1)
        self.token = self.token_file.read_text().strip()
        assert (self.token_file.stat().st_mode & 0o777) == 0o600

    def text(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def watched(self, pid: int, timeout: float = 15) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            status = json.loads(_get(self.url + "/status")[1])
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

    def __init__(self, llama_build, model, llama_env, tmp_path: Path, n: int = 24):
        self.fifo = tmp_path / f"prompt-{time.monotonic_ns()}"
        os.mkfifo(self.fifo)
        cmd = completion_cmd(llama_build, model, n=n)
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
