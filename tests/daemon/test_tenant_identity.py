"""A tenant cannot choose the pod and namespace the daemon labels it with, nor write into
the daemon's log or labels with the names it picks.

Each tenant is a process in its own mount namespace and in a cgroup as a Kubernetes node's
runtime makes one (kubepods pod slice, CRI container scope), with HOSTNAME=kube-apiserver-evil
and, in the kubelet's pod directory, a projected volume named "aaa" that says kube-system.
The truth is what the container runtime wrote on the host: containerd's bundle config.json,
CRI-O's, docker's config.v2.json (in a host root the daemon is pointed at; on a node,
/proc/1/root). Only a root-owned spec
naming the cgroup's pod UID counts; without one, pod and namespace stay empty."""
from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from daemon_helpers import Daemon, _get, cudart_tenant, kill_started, runtime_spec
from profinfer.levels.cuda import workload


@pytest.fixture(autouse=True)
def _no_workload_left():
    yield
    kill_started()


POD_UID = "3e9b1c4d-2a7f-4c1e-8b5d-6f0a9e8d7c6b"
OTHER_UID = "99999999-2a7f-4c1e-8b5d-6f0a9e8d7c6b"
PODS = Path("/sys/fs/cgroup/unified") / "kubepods.slice" / f"kubepods-pod{POD_UID.replace('-', '_')}.slice"
COMM = "evil\x1b[2J\nx"          # a clear-screen sequence and a newline in its comm


def _container(n: int) -> str:
    return f"{n:02x}" + "b0a7" * 15 + "cafe"[:2]


def _spec(host: Path, container: str, uid: str, runtime: str = "containerd") -> Path:
    return runtime_spec(host, container, uid, "llama-7d9f-x2", "inference", runtime)


def test_pod_and_namespace_only_from_the_runtime_and_names_escaped(tmp_path):
    cudart = workload.ensure_cudart12()
    # its executable's path holds a newline and an escape sequence too
    exe_dir = tmp_path / "bin\nfake"
    exe_dir.mkdir()
    exe = exe_dir / "py\x1b[2Jthon"
    shutil.copy2(os.path.realpath("/usr/bin/python3"), exe)
    # what a tenant controls: its environment, and its pod's volumes (any name it likes)
    kubelet = tmp_path / "kubelet-pods" / POD_UID / "volumes" / "kubernetes.io~projected"
    for volume, ns in (("aaa", "kube-system"), ("kube-api-access-evil", "kube-system")):
        (kubelet / volume).mkdir(parents=True)
        (kubelet / volume / "namespace").write_text(ns)
    host = tmp_path / "host"
    # the runtime's truth for the first; none for the second; the third's names another pod;
    # the fourth's was planted by someone other than root; the fifth's and sixth's are CRI-O's
    # and docker's
    containers = [_container(n) for n in range(6)]
    _spec(host, containers[0], POD_UID)
    _spec(host, containers[2], OTHER_UID)
    os.chown(_spec(host, containers[3], POD_UID), 65534, 65534)
    _spec(host, containers[4], POD_UID, "cri-o")
    _spec(host, containers[5], POD_UID, "docker")
    scopes = ["cri-containerd"] * 4 + ["crio", "docker"]
    env = {**os.environ, "PROFINFER_KUBELET_PODS": str(kubelet.parents[2]), "PROFINFER_HOST_ROOT": str(host)}
    cgroups = [PODS / f"{scope}-{c}.scope" for scope, c in zip(scopes, containers)]
    d = Daemon(tmp_path, env=env)
    procs = []
    try:
        for cg in cgroups:
            cg.mkdir(parents=True, exist_ok=True)
            procs.append(cudart_tenant(cudart, str(exe), COMM, preexec_fn=lambda cg=cg: (
                cg / "cgroup.procs").write_text(str(os.getpid())),
                env={"PATH": "/usr/bin:/bin", "HOSTNAME": "kube-apiserver-evil"}))
        infos = [d.watched(p.pid) for p in procs]
        for info, container in zip(infos, containers):
            assert (info["pod_uid"], info["container"]) == (POD_UID, container[:12]), info
        got = [(i["pod"], i["namespace"]) for i in infos]
        truth, none = ("llama-7d9f-x2", "inference"), ("", "")
        assert got == [truth, none, none, none, truth, truth], got
        # the names it chose, as the kernel holds them, escaped (Python's escapes) wherever shown
        raw_comm = Path(f"/proc/{procs[0].pid}/comm").read_text()[:-1]
        raw_exe = os.readlink(f"/proc/{procs[0].pid}/exe")
        assert "\x1b" in raw_comm and "\n" in raw_exe
        escaped = {"comm": raw_comm.encode("unicode_escape").decode(),
                   "exe": raw_exe.encode("unicode_escape").decode()}
        assert (infos[0]["comm"], infos[0]["exe"]) == (escaped["comm"], escaped["exe"])
        deadline = time.monotonic() + 10
        labels = {}
        while time.monotonic() < deadline and len(labels) < len(procs):
            text = _get(d.url + "/metrics")[1].decode()
            labels = {s.labels["pid"]: s.labels for f in text_string_to_metric_families(text)
                      if f.name == "profinfer_process_info" for s in f.samples}
            time.sleep(0.2)
        mine = [labels[str(p.pid)] for p in procs]
        assert [(l["pod"], l["namespace"]) for l in mine] == got
        assert (mine[0]["comm"], mine[0]["exe"]) == (escaped["comm"], escaped["exe"])
        log = d.text()
        assert "\x1b" not in log and "kube-system" not in log and "kube-apiserver-evil" not in log
        assert escaped["comm"] in log, log
        # no line a tenant's newline began (its comm's "\nx", its directory's "\nfake")
        assert not [l for l in log.splitlines() if l.startswith(("x", "fake"))], log
    finally:
        for p in procs:
            p.stdin.close()
            p.wait(timeout=30)
        d.stop()
        for cg in cgroups + [PODS, PODS.parent]:
            for _ in range(50):
                try:
                    cg.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.1)
