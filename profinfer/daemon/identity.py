"""Who a watched process is, for the daemon's labels and status: pid, comm, executable,
engine, the model file it mapped, and where it runs (container, Kubernetes pod and
namespace), read from /proc and the kubelet's pod directory, never from the Kubernetes API.

A container's id is the 64-hex id its runtime puts in the cgroup path (docker-<id>.scope,
cri-containerd-<id>.scope, crio-<id>.scope, libpod-<id>.scope, or /docker/<id>); a pod's UID
is in the kubepods cgroup path (pod<uid>, with '_' for '-' under systemd). The pod's name is
the container's HOSTNAME (Kubernetes sets it to the pod name) and its namespace is the one the
kubelet projected into the pod's service-account volume.
"""
from __future__ import annotations

import glob
import os
import re
from dataclasses import asdict, dataclass

_CONTAINER = re.compile(r"(?:docker-|cri-containerd-|crio-|libpod-|containerd-|/docker/|/)([0-9a-f]{64})(?:\.scope)?(?:/|$)")
_POD = re.compile(r"pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})")
KUBELET_PODS = os.environ.get("PROFINFER_KUBELET_PODS", "/var/lib/kubelet/pods")
MODEL_SUFFIXES = (".gguf", ".safetensors")


@dataclass(frozen=True)
class Identity:
    pid: int
    start: int               # start time (clock ticks since boot): with the pid, one process
    comm: str
    exe: str
    engine: str
    model: str = ""          # the model file it maps (llama.cpp: its GGUF)
    cgroup: str = ""
    container: str = ""      # the container runtime's id (12 hex digits, as `docker ps`)
    pod_uid: str = ""
    pod: str = ""
    namespace: str = ""

    def as_dict(self) -> dict:
        return asdict(self)


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def cgroup_path(pid: int) -> str:
    """The process's cgroup: the first of its paths (v2's unified one first, then v1's) that
    names a container or pod, else v2's, else v1's memory controller's."""
    paths = []
    for line in _read(f"/proc/{pid}/cgroup").splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            paths.append((parts[0] != "0", "memory" not in parts[1].split(","), parts[2]))
    paths.sort()
    for *_, path in paths:
        if _CONTAINER.search(path) or _POD.search(path):
            return path
    return paths[0][2] if paths else ""


def container_of(cgroup: str) -> str:
    m = _CONTAINER.search(cgroup)
    return m.group(1)[:12] if m else ""


def pod_uid_of(cgroup: str) -> str:
    m = _POD.search(cgroup)
    return m.group(1).replace("_", "-") if m else ""


def _environ(pid: int) -> dict[str, str]:
    raw = _read(f"/proc/{pid}/environ")
    return dict(kv.split("=", 1) for kv in raw.split("\0") if "=" in kv)


def namespace_of_pod(pod_uid: str, pods_dir: str = KUBELET_PODS) -> str:
    """The pod's namespace, as the kubelet projected it into the pod's service-account volume."""
    if not pod_uid:
        return ""
    for path in sorted(glob.glob(os.path.join(pods_dir, pod_uid, "volumes", "kubernetes.io~projected",
                                              "*", "namespace"))):
        ns = _read(path).strip()
        if ns:
            return ns
    return ""


def model_file(pid: int) -> str:
    """A model file the process has mapped (llama.cpp mmaps its GGUF) or open."""
    for line in _read(f"/proc/{pid}/maps").splitlines():
        parts = line.split(None, 5)
        if len(parts) == 6 and parts[5].strip().endswith(MODEL_SUFFIXES):
            return parts[5].strip()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.endswith(MODEL_SUFFIXES):
                return target
    except OSError:
        pass
    return ""


def identify(pid: int, start: int, engine: str) -> Identity:
    comm = _read(f"/proc/{pid}/comm").strip()
    try:
        exe = os.readlink(f"/proc/{pid}/exe").removesuffix(" (deleted)")
    except OSError:
        exe = ""
    cgroup = cgroup_path(pid)
    pod_uid = pod_uid_of(cgroup)
    pod = _environ(pid).get("HOSTNAME", "") if pod_uid else ""
    return Identity(pid, start, comm, exe, engine, model_file(pid), cgroup, container_of(cgroup),
                    pod_uid, pod, namespace_of_pod(pod_uid))
