"""Who a watched process is, for the daemon's labels and status: pid, comm, executable,
engine, the model file it mapped, and where it runs (container, Kubernetes pod and
namespace), read from /proc and from what the container runtime wrote on the host, never
from the Kubernetes API, and never from anything the process's tenant can write.

A container's id is the 64-hex id its runtime puts in the cgroup path (docker-<id>.scope,
cri-containerd-<id>.scope, crio-<id>.scope, libpod-<id>.scope, or /docker/<id>); a pod's UID
is in the kubepods cgroup path (pod<uid>, with '_' for '-' under systemd): the kernel's, a
tenant cannot move itself out of its cgroup. The pod's name and namespace are those the
runtime wrote into the container's spec on the host (the kubelet handed them over the CRI):
containerd's bundle config.json (annotations io.kubernetes.cri.sandbox-*), CRI-O's
config.json (io.kubernetes.pod.*) or docker's config.v2.json (labels io.kubernetes.pod.*,
cri-dockerd). They are taken only if that file is root's, not writable by group or others,
and names the same pod UID as the cgroup path; else they stay empty. Not the process's
HOSTNAME (the tenant sets its environment) nor the kubelet's projected volumes (a tenant can
name a volume of its own `kube-api-access-*` holding a `namespace` file it chose).

The host's files are read through PID 1's root (the daemon runs with hostPID), resolved
inside it (no symlink leads out), as regular files of bounded size.
"""
from __future__ import annotations

import json
import os
import re
import stat
from dataclasses import asdict, dataclass, fields

from profinfer.core.base import config
from profinfer.core.target import procfs

_CONTAINER = re.compile(r"(?:docker-|cri-containerd-|crio-|libpod-|containerd-|/docker/|/)([0-9a-f]{64})(?:\.scope)?(?:/|$)")
_POD = re.compile(r"pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})")
MODEL_SUFFIXES = (".gguf", ".safetensors")
MAX_FDS_READ = 4096        # a model's file is opened early; a tenant may open a million
# The host's root as the daemon reaches it (hostPID: PID 1's); a directory for tests.
HOST_ROOT = config.text("PROFINFER_HOST_ROOT") or "/proc/1/root"
_SPEC_MAX = 1 << 20        # a runtime's container spec is tens of KiB
# Where each runtime keeps a container's spec on the host, by container id, and the keys of
# its pod UID, name and namespace there.
_RUNTIME_SPECS = (
    ("/run/containerd/io.containerd.runtime.v2.task/k8s.io/{id}/config.json", ("annotations",),
     ("io.kubernetes.cri.sandbox-uid", "io.kubernetes.cri.sandbox-name", "io.kubernetes.cri.sandbox-namespace")),
    ("/run/containers/storage/overlay-containers/{id}/userdata/config.json", ("annotations",),
     ("io.kubernetes.pod.uid", "io.kubernetes.pod.name", "io.kubernetes.pod.namespace")),
    ("/var/lib/docker/containers/{id}/config.v2.json", ("Config", "Labels"),
     ("io.kubernetes.pod.uid", "io.kubernetes.pod.name", "io.kubernetes.pod.namespace")),
)


def printable(text: str) -> str:
    """`text` with what a terminal or a log reader would act on escaped: control characters
    and other non-printables as Python writes them (\\n, \\x1b, \\u2028). Every name a
    process chose (its comm, its paths) goes through this before it is logged or labelled."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


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

    def __post_init__(self):
        for f in fields(self):        # names a tenant chose, escaped once for every use
            v = getattr(self, f.name)
            if isinstance(v, str) and not v.isprintable():
                object.__setattr__(self, f.name, printable(v))

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


def container_id_of(cgroup: str) -> str:
    """The container's full id (64 hex digits)."""
    m = _CONTAINER.search(cgroup)
    return m.group(1) if m else ""


def container_of(cgroup: str) -> str:
    return container_id_of(cgroup)[:12]


def pod_uid_of(cgroup: str) -> str:
    m = _POD.search(cgroup)
    return m.group(1).replace("_", "-") if m else ""


def _host_file(path: str) -> bytes | None:
    """A file of the host's, resolved inside the host's root: root's own, a regular file
    nobody else may write, at most _SPEC_MAX bytes; None otherwise."""
    try:
        root = os.open(HOST_ROOT, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fd = procfs.openat2(root, path.lstrip("/"), os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOFOLLOW,
                            procfs.RESOLVE_IN_ROOT | procfs.RESOLVE_NO_MAGICLINKS)
    except OSError:
        return None
    finally:
        os.close(root)
    try:
        st = os.fstat(fd)
        if (not stat.S_ISREG(st.st_mode) or st.st_uid != 0 or st.st_mode & 0o022
                or st.st_size > _SPEC_MAX):
            return None
        return os.read(fd, _SPEC_MAX + 1)[:_SPEC_MAX]
    except OSError:
        return None
    finally:
        os.close(fd)


def pod_of_container(container_id: str, pod_uid: str) -> tuple[str, str]:
    """(pod name, namespace) as the container runtime wrote them for this container, if it
    wrote them for the pod the cgroup path names; else ("", "")."""
    if not container_id or not pod_uid:
        return "", ""
    for template, where, (uid_key, name_key, ns_key) in _RUNTIME_SPECS:
        raw = _host_file(template.format(id=container_id))
        if raw is None:
            continue
        try:
            values = json.loads(raw)
            for key in where:
                values = values[key]
        except (ValueError, KeyError, TypeError):
            continue
        if not isinstance(values, dict) or values.get(uid_key) != pod_uid:
            continue
        name, ns = values.get(name_key), values.get(ns_key)
        if isinstance(name, str) and isinstance(ns, str):
            return name, ns
    return "", ""


def model_file(pid: int) -> str:
    """A model file the process has mapped (llama.cpp mmaps its GGUF) or open."""
    for m in procfs.file_mappings(pid):
        if not m.deleted and m.path.endswith(MODEL_SUFFIXES):
            return m.path
    try:
        for fd in procfs.first_entries(f"/proc/{pid}/fd", MAX_FDS_READ):
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
    comm = _read(f"/proc/{pid}/comm").removesuffix("\n")
    try:
        exe = os.readlink(f"/proc/{pid}/exe").removesuffix(" (deleted)")
    except OSError:
        exe = ""
    cgroup = cgroup_path(pid)
    pod_uid = pod_uid_of(cgroup)
    pod, namespace = pod_of_container(container_id_of(cgroup), pod_uid)
    return Identity(pid, start, comm, exe, engine, model_file(pid), cgroup, container_of(cgroup),
                    pod_uid, pod, namespace)
