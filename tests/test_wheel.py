"""profinfer installed from its wheel, as a tool is: the image deploy/Containerfile makes (built
and cached by deploy/build-image.sh, the image test_pod runs) installs the wheel with pip on
Debian 12 with python3, python3-venv and libbpf1 alone. The wheel carries the BPF objects
clang compiled when it was built (setup.py). In a container of that image, where there is no
clang, no libbpf-dev and no kernel headers (checked there), `profinfer --version` says the
objects are the wheel's, and `profinfer attach` on a llama-server running in the same
container counts the tokens the server itself says it processed. A wheel without its
objects fails here: attach could not build them there.

The llama-server is the bundled llama.cpp build (the llama_build fixture), mounted read-only
at its own path (its RUNPATH). Of the libraries it links, the image lacks only those its
`ldd` finds missing there (libgomp.so.1, OpenMP): each is this machine's own file, mounted
read-only at its path. The container runs as the manifest's pod does (its capabilities alone,
no seccomp filter, no new privileges, a read-only root, tmpfs for /tmp and the cache, the
host's PID namespace: BPF names processes by their host pids), on the host's network, where
the test asks the server."""
from __future__ import annotations

import concurrent.futures
import json
import os
import re
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import free_port
from test_pod import _complete, _podman, _template

REPO = Path(__file__).resolve().parents[1]
CTR = "profinfer-wheel-test"
N_PREDICT = 8


@pytest.fixture(scope="module")
def image() -> str:
    done = subprocess.run([str(REPO / "deploy" / "build-image.sh")], capture_output=True, text=True,
                          timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip()


def _exec(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return _podman("exec", CTR, *args, check=check, timeout=120)


def _missing_libraries(image: str, server: Path, env: list[str]) -> list[str]:
    """This machine's files of the libraries llama-server links that the image lacks."""
    there = _podman("run", "--rm", "--volume", f"{server.parent.parent}:{server.parent.parent}:ro",
                    *env, "--entrypoint", "ldd", image, str(server)).stdout
    missing = set(re.findall(r"^\s*(\S+) => not found", there, re.M))
    here = subprocess.run(["ldd", str(server)], capture_output=True, text=True, check=True,
                          env={**os.environ, "LD_LIBRARY_PATH": str(server.parent)}).stdout
    found = dict(re.findall(r"^\s*(\S+) => (/\S+)", here, re.M))
    assert missing <= found.keys(), f"not found here either: {missing - found.keys()}"
    return [found[name] for name in sorted(missing)]


def _beside(lib: str) -> str:
    """Where the library goes in the container: its name, in its file's folder (/usr/lib/...,
    not through the /lib link)."""
    return os.path.join(os.path.dirname(os.path.realpath(lib)), os.path.basename(lib))


def test_wheel_without_a_compiler_attaches_and_counts_llama_server_tokens(image, llama_build, tiny_model):
    (spec,) = _template()["containers"]
    server = llama_build / "bin" / "llama-server"
    env = ["--env", f"LD_LIBRARY_PATH={server.parent}"]
    libs = _missing_libraries(image, server, env)
    args = ["--name", CTR, "--replace", "--pid", "host", "--network", "host", "--cap-drop", "ALL",
            *(a for cap in spec["securityContext"]["capabilities"]["add"] for a in ("--cap-add", cap)),
            "--security-opt", "seccomp=unconfined", "--security-opt", "no-new-privileges",
            "--read-only", "--read-only-tmpfs=false", "--tmpfs", "/tmp:rw,mode=1777",
            "--tmpfs", "/var/cache/profinfer:rw,mode=0755",
            "--volume", f"{llama_build}:{llama_build}:ro", "--volume", f"{tiny_model}:{tiny_model}:ro",
            *(a for lib in libs for a in ("--volume", f"{os.path.realpath(lib)}:{_beside(lib)}:ro")), *env]
    _podman("run", "--detach", *args, "--entrypoint", "sleep", image, "infinity")
    try:
        # no compiler, no libbpf headers, no kernel headers: nothing there could build an object
        absent = _exec("sh", "-c", "dpkg-query -W -f '${Package}\\n' 'clang*' 'llvm*' libbpf-dev 'linux-headers*' "
                       "2>/dev/null; ls -d /usr/include/bpf /usr/include/linux /lib/modules/*/build 2>/dev/null; "
                       "python -c 'from profinfer.core.ebpf import bpfbuild; print(bpfbuild.find_clang() or \"\")'; "
                       "dpkg-query -W -f '${Package}\\n' libbpf1", check=False).stdout.split()
        assert absent == ["libbpf1"], absent
        version = _exec("profinfer", "--version").stdout
        assert re.search(r"^BPF objects: shipped in the wheel \(built .* by .*clang.*, in "
                         r"/opt/profinfer/lib/python3[.\d]*/site-packages/profinfer/core/ebpf/prebuilt\)$",
                         version, re.M), version

        port = free_port()
        url = f"http://127.0.0.1:{port}"
        _podman("exec", "--detach", CTR, "sh", "-c", f"echo $$ > /tmp/server.pid; exec {server} -m {tiny_model} "
                f"-np 2 -c 1024 -t 2 --host 127.0.0.1 --port {port} >/tmp/server.log 2>&1")
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, _exec("cat", "/tmp/server.log", check=False).stdout[-3000:]
            time.sleep(0.2)
        pid = _exec("cat", "/tmp/server.pid").stdout.strip()

        attach = subprocess.Popen(
            ["podman", "exec", CTR, "sh", "-c", "echo $$ > /tmp/attach.pid; "
             f"exec profinfer attach --pid {pid} --quiet --json /tmp/summary.json"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "CONTAINERS_CONF": str(REPO / "deploy" / "containers.conf")})
        err = []
        try:
            for line in attach.stderr:
                err.append(line)
                if "attached" in line or line.startswith("profinfer: error"):
                    break
            assert "attached" in "".join(err), "".join(err)
            with concurrent.futures.ThreadPoolExecutor(2) as pool:
                replies = list(pool.map(lambda i: _complete(url, i), range(2)))
            # the container shares the host's PID namespace: its pid is this machine's
            os.kill(int(_exec("cat", "/tmp/attach.pid").stdout), signal.SIGINT)
            _, rest = attach.communicate(timeout=60)
        finally:
            if attach.poll() is None:
                attach.kill()
        assert attach.returncode == 0, "".join(err) + rest
        summary = json.loads(_exec("cat", "/tmp/summary.json").stdout)
        print(f"counted in the container: {summary['tokens']}; the server's timings: "
              f"{[(r['timings']['prompt_n'], r['timings']['predicted_n']) for r in replies]}")
        # the server samples each request's first token from its prompt's last batch and
        # never decodes its last one: predicted_n - 1 decode tokens a request
        assert summary["tokens"]["prefill"] == sum(r["timings"]["prompt_n"] for r in replies)
        assert summary["tokens"]["decode"] == sum(r["timings"]["predicted_n"] - 1 for r in replies)
        # the objects attach loaded were the wheel's: none was built into the cache
        assert "bpf" not in _exec("ls", "-A", "/var/cache/profinfer").stdout.split()
    finally:
        _podman("rm", "-f", "-t", "0", CTR, check=False)
