"""A process in a container as the daemon meets one: its own mount namespace and root (an
unshared chroot holding its own copy of llama.cpp's libraries and the model), a cgroup as a
Kubernetes node's container runtime makes one (kubepods pod slice, CRI container scope), and
the runtime's spec of the container on the host (containerd's bundle config.json). It is found,
probed through /proc/PID/root, counted, and labelled with its container, pod and namespace,
without any Kubernetes API."""
from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from conftest import PROMPT, llama_log_drain, llama_perf
from daemon_helpers import Daemon, _STARTED, _get, kill_started, runtime_spec


@pytest.fixture(autouse=True)
def _no_workload_left():
    yield
    kill_started()


DRAIN = "llama_log_drain.so"     # conftest.llama_log_drain, copied into the container's root
POD_UID = "7a1f3c2e-5b6d-4e8f-9a0b-1c2d3e4f5a6b"
CONTAINER = "c0ffee" + "0123456789abcdef" * 3 + "abcdefabcd"
CGROUP = (Path("/sys/fs/cgroup/unified") / "kubepods.slice" / f"kubepods-pod{POD_UID.replace('-', '_')}.slice"
          / f"cri-containerd-{CONTAINER}.scope")


def _copy_with_deps(binary: Path, root: Path, env) -> None:
    """The binary and every shared library it loads (ldd), at /pi/bin and /pi/lib in root;
    the dynamic loader at its own path; /proc and /tmp for the process's own use."""
    (root / "pi" / "bin").mkdir(parents=True)
    (root / "tmp").mkdir()
    (root / "pi" / "lib").mkdir(parents=True)
    shutil.copy2(binary, root / "pi" / "bin" / binary.name)
    out = subprocess.run(["ldd", str(binary)], capture_output=True, text=True, env=env, check=True).stdout
    for line in out.splitlines():
        parts = line.split()
        path = parts[2] if "=>" in parts and len(parts) > 2 else parts[0]
        if not path.startswith("/"):
            continue
        if "ld-linux" in path:
            dest = root / path.lstrip("/")
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, dest)
        else:
            shutil.copy2(os.path.realpath(path), root / "pi" / "lib" / os.path.basename(path))


def test_container_process_found_probed_and_labelled(tmp_path, llama_build, tiny_model, llama_env):
    root = tmp_path / "root"
    binary = llama_build / "bin" / "llama-completion"
    _copy_with_deps(binary, root, llama_env)
    shutil.copy2(llama_log_drain(), root / "pi" / "lib" / DRAIN)
    (root / "models").mkdir()
    shutil.copy2(tiny_model, root / "models" / "tiny.gguf")
    os.mkfifo(root / "prompt")
    runtime_spec(tmp_path / "host", CONTAINER, POD_UID, "llama-7d9f-x2", "inference")
    CGROUP.mkdir(parents=True, exist_ok=True)
    d = Daemon(tmp_path, env={**os.environ, "PROFINFER_HOST_ROOT": str(tmp_path / "host")})
    proc = None
    try:
        def into_the_pods_cgroup():
            (CGROUP / "cgroup.procs").write_text(str(os.getpid()))

        # as a container runtime does: a new mount namespace whose root is pivoted to the
        # container's (its files' paths are then its own: the host reaches them through
        # /proc/PID/root only)
        script = (f"mount --make-rprivate / && mount --bind {root} {root} && cd {root} && "
                  "mkdir -p .host && pivot_root . .host && "
                  "exec /pi/bin/llama-completion -m /models/tiny.gguf -f /prompt -n 16 -t 2 --temp 0 "
                  "--seed 1 -no-cnv --no-warmup -c 512")
        proc = subprocess.Popen(
            ["unshare", "--mount", "sh", "-c", script],
            env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LD_LIBRARY_PATH": "/pi/lib",
                 "LD_PRELOAD": f"/pi/lib/{DRAIN}", "HOSTNAME": "llama-7d9f-x2"},
            preexec_fn=into_the_pods_cgroup, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        _STARTED.append(proc)
        info = d.watched(proc.pid)
        assert info["exe"] == "/pi/bin/llama-completion"          # as the process sees it
        assert info["container"] == CONTAINER[:12]
        assert (info["pod_uid"], info["pod"], info["namespace"]) == (POD_UID, "llama-7d9f-x2", "inference")
        with open(root / "prompt", "w") as f:
            f.write(PROMPT)
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        perf = llama_perf(err)      # its log drain is preloaded (a copy in its root): a missing line is a defect
        assert "eval" in perf, f"llama.cpp's perf lines missing:\n{err[-2000:]}"
        deadline, line = time.monotonic() + 10, ""
        while time.monotonic() < deadline:
            text = _get(d.url + "/metrics")[1].decode()
            line = next((l for l in text.splitlines() if l.startswith("profinfer_tokens_total{")
                         and f'pid="{proc.pid}"' in l and 'phase="decode"' in l), "")
            if line and int(float(line.rsplit(" ", 1)[1])) == perf["eval"][1]:
                break
            time.sleep(0.2)
        assert f'container="{CONTAINER[:12]}"' in line and 'namespace="inference"' in line
        assert 'pod="llama-7d9f-x2"' in line
        assert int(float(line.rsplit(" ", 1)[1])) == perf["eval"][1]
    finally:
        d.stop()
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        for c in (CGROUP, CGROUP.parent, CGROUP.parent.parent):
            try:
                c.rmdir()
            except OSError:
                pass
