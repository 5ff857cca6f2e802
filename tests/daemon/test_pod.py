"""The DaemonSet's own pod, run here as a node runs it: the image built from
deploy/Containerfile (its base made from Debian's archive: no registry), the container of
the manifest's pod template run by `podman run` with what the manifest file gives it, read
from the file: its securityContext (its capabilities only, a read-only root, no privilege
escalation, its seccomp profile), hostPID, its volumes, env, args, port and limits. (Debian
12's podman 4.3 `kube play` ignores hostPID, so it cannot run this pod as a kubelet would.) Beside it on the host: a llama-server under concurrent requests, a vLLM
OpenAI server, and a CUDA program, each started after the pod, each counted by the daemon in
the pod as it counts itself; a llama.cpp generation captured through POST /capture (its trace
written first in the pod's /tmp volume: the root is read-only). Afterwards nothing of the
agent's stays in the kernel."""
from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import re
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import psutil
import pytest
import yaml

from conftest import bpf_holders, bpf_snapshot, free_port, llama_server, vllm_steps
from daemon_helpers import _STARTED, Workload, _get, cuda_log_counts, kill_started, series
from profinfer.levels.cuda import workload as cuda_workload

from test_daemon_cuda import PROGRAM as CUDA_PROGRAM

REPO = Path(__file__).resolve().parents[2]
MANIFEST = REPO / "deploy" / "kubernetes" / "profinfer.yaml"
CONTAINERS_CONF = REPO / "deploy" / "containers.conf"
POD = "profinfer-node-agent"
SLOTS = 4
N_PREDICT = 16
def _podman(*args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "CONTAINERS_CONF": str(CONTAINERS_CONF)}
    done = subprocess.run(["podman", *args], capture_output=True, text=True, env=env, timeout=timeout)
    if check and done.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)}: {done.stderr[-2000:]}")
    return done


def _template() -> dict:
    ds = next(d for d in yaml.safe_load_all(MANIFEST.read_text()) if d and d["kind"] == "DaemonSet")
    return ds["spec"]["template"]["spec"]


def _quantity(q: str) -> str:
    """A Kubernetes memory quantity as podman takes it (binary units)."""
    m = re.fullmatch(r"(\d+)(Ki|Mi|Gi)?", str(q))
    assert m, f"memory quantity {q!r} not handled here"
    return m.group(1) + {"Ki": "k", "Mi": "m", "Gi": "g", None: "b"}[m.group(2)]


def podman_run_args(spec: dict, scratch: Path, host_port: int) -> tuple[list[str], dict]:
    """`podman run` arguments for the template's one container, each from the manifest."""
    (c,) = spec["containers"]
    sc = c["securityContext"]
    assert sc["privileged"] is False
    args = ["--name", f"{POD}-{c['name']}", "--replace"]
    if spec.get("hostPID"):
        args += ["--pid", "host"]
    if "ALL" in sc["capabilities"].get("drop", []):
        args += ["--cap-drop", "ALL"]
    for cap in sc["capabilities"].get("add", []):
        args += ["--cap-add", cap]
    if sc.get("readOnlyRootFilesystem"):
        args += ["--read-only", "--read-only-tmpfs=false"]
    if "runAsUser" in sc:
        args += ["--user", str(sc["runAsUser"])]
    if sc.get("allowPrivilegeEscalation") is False:
        args += ["--security-opt", "no-new-privileges"]
    profile = sc.get("seccompProfile", {}).get("type", "RuntimeDefault")
    if profile == "Unconfined":
        args += ["--security-opt", "seccomp=unconfined"]
    for e in c.get("env", []):
        args += ["--env", f"{e['name']}={e['value']}"]
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    for m in c.get("volumeMounts", []):
        v = volumes[m["name"]]
        ro = ":ro" if m.get("readOnly") else ""
        if "hostPath" in v:
            if v["hostPath"].get("type") == "DirectoryOrCreate":
                os.makedirs(v["hostPath"]["path"], exist_ok=True)
            args += ["--volume", f"{v['hostPath']['path']}:{m['mountPath']}{ro}"]
        elif v.get("emptyDir", {}).get("medium") == "Memory":
            size = v["emptyDir"].get("sizeLimit")
            args += ["--tmpfs", f"{m['mountPath']}:rw,mode=0755" + (f",size={_quantity(size)}" if size else "")]
        elif "emptyDir" in v:
            d = scratch / m["name"]
            d.mkdir()
            args += ["--volume", f"{d}:{m['mountPath']}{ro}"]
        else:
            raise AssertionError(f"volume {v} not handled here")
    limits = c.get("resources", {}).get("limits", {})
    if "memory" in limits:
        args += ["--memory", _quantity(limits["memory"])]
    if "cpu" in limits:
        args += ["--cpus", str(limits["cpu"])]
    (port,) = c["ports"]
    args += ["--publish", f"127.0.0.1:{host_port}:{port['containerPort']}"]
    return args + [c["image"], *c.get("args", [])], c


@pytest.fixture(scope="module")
def pod(tmp_path_factory):
    image = subprocess.run([str(REPO / "deploy" / "build-image.sh")], capture_output=True, text=True,
                           timeout=1800)
    assert image.returncode == 0, image.stderr[-3000:]
    tmp = tmp_path_factory.mktemp("pod")
    host_port = free_port()
    args, container = podman_run_args(_template(), tmp, host_port)
    assert container["image"] == image.stdout.strip()
    ctr = f"{POD}-{container['name']}"
    _podman("run", "--detach", *args)
    try:
        url = f"http://127.0.0.1:{host_port}"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if _get(url + "/healthz", timeout=2)[0] == 200:
                    break
            except OSError:
                pass
            state = _podman("inspect", ctr, "--format", "{{.State.Status}}", check=False).stdout.strip()
            assert state == "running", _podman("logs", ctr, check=False).stderr[-3000:]
            time.sleep(0.5)
        else:
            raise AssertionError("the pod's /healthz did not answer:\n" + _podman("logs", ctr, check=False).stderr)
        pod = {"url": url, "ctr": ctr, "container": container}
        yield pod
        made = _pods_bpf(pod)
        assert made, "the pod held no BPF object"
    finally:
        _podman("rm", "-f", "-t", "10", ctr, check=False)
    # the pod removed, every BPF program, map and link it held is gone (checked here, after
    # every test of the module whatever their order, against what its own processes held)
    deadline = time.monotonic() + 10
    while (left := made & bpf_snapshot().keys()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"left in the kernel after the pod: {left}"


def _pods_bpf(pod) -> set[tuple[str, int]]:
    """The BPF objects the pod's processes hold now: its container's first process's and its
    descendants' (the pod shares the host's PID namespace, where `podman top` names none)."""
    first = psutil.Process(_state(pod)["Pid"])
    pids = {first.pid} | {c.pid for c in first.children(recursive=True)}
    return {key for key, holders in bpf_holders().items() if holders & pids}


@pytest.fixture(autouse=True)
def _no_workload_left():
    yield
    kill_started()


@pytest.fixture(autouse=True)
def _pod_lives(request):
    """The agent is still running after each test; else what ended it (exit code, the
    kernel's OOM kill) and its last words, from the test that saw it go."""
    yield
    if "pod" in request.fixturenames:
        pod = request.getfixturevalue("pod")
        state = _state(pod)
        assert state.get("Status") == "running", f"the agent's container ended: {_explain(pod)}"
        assert _oom_kills(state["Pid"]) == 0, \
            f"the kernel killed a process of the agent's container for memory: {_explain(pod)}"


def _oom_kills(pid: int) -> int:
    """The kernel's count of OOM kills in a process's memory cgroup (v1 or v2)."""
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            text = Path(f"/sys/fs/cgroup/memory{path}/memory.oom_control").read_text()
            break
        if controllers == "" and Path(f"/sys/fs/cgroup{path}/memory.events").exists():
            text = Path(f"/sys/fs/cgroup{path}/memory.events").read_text()
            break
    else:
        raise AssertionError(f"no memory cgroup found for PID {pid}")
    return int(re.search(r"^oom_kill (\d+)", text, re.M).group(1))


def _state(pod) -> dict:
    done = _podman("inspect", pod["ctr"], "--format", "{{json .State}}", check=False)
    return json.loads(done.stdout) if done.returncode == 0 and done.stdout.strip() else {}


def _explain(pod) -> str:
    state = _state(pod)
    said = {k: state.get(k) for k in ("Status", "ExitCode", "OOMKilled", "Error", "FinishedAt")}
    return f"{said}\n{_logs(pod)[-4000:]}"


@contextlib.contextmanager
def _with_agent_state(pod):
    """An assertion in the block gets the agent's state and log appended."""
    try:
        yield
    except AssertionError as e:
        raise AssertionError(f"{e}\n--- the agent: {_explain(pod)}") from e


def _logs(pod) -> str:
    return _podman("logs", pod["ctr"], check=False).stderr


def _metrics(pod) -> str:
    return _get(pod["url"] + "/metrics")[1].decode()


def test_the_pod_runs_as_the_manifest_says(pod):
    """Its capabilities are the manifest's and no others; its root is read-only; it writes
    only to the volumes (the token, the cache, /tmp)."""
    inspect = json.loads(_podman("inspect", pod["ctr"]).stdout)[0]
    caps = {c.removeprefix("CAP_") for c in inspect["EffectiveCaps"] or []}
    assert caps == set(pod["container"]["securityContext"]["capabilities"]["add"])
    assert inspect["HostConfig"]["ReadonlyRootfs"] is True
    status = _podman("exec", pod["ctr"], "python3", "-c",
                     "import os; print(open('/proc/self/status').read())").stdout
    cap_eff = int(re.search(r"CapEff:\s+([0-9a-f]+)", status).group(1), 16)
    assert cap_eff & (1 << 21) == 0                       # no CAP_SYS_ADMIN
    assert "Read-only file system" in _podman("exec", pod["ctr"], "touch", "/opt/x", check=False).stderr
    logs = _logs(pod)
    assert "cannot be written" not in logs and "Traceback" not in logs, logs


def _token(pod) -> str:
    return _podman("exec", pod["ctr"], "cat", "/run/profinfer/token").stdout.strip()


def test_capture_in_the_pod(pod, tmp_path, llama_build, tiny_model, llama_env):
    """POST /capture with the pod's token: the capture writes its trace in a temporary
    directory, which the read-only root must leave somewhere to write (the manifest's /tmp
    volume). The trace is the watched generation's: its pid, its ops and its tokens."""
    from profinfer.exporters.trace_reader import read_trace
    token = _token(pod)
    # decoding from when it is let go, 1 s into a 2 s capture, until it is killed afterwards
    # (on an idle machine ~2 s; it outlives the capture)
    w = Workload(llama_build, tiny_model, llama_env, tmp_path, n=1900)
    pid = w.proc.pid
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        status = json.loads(_get(pod["url"] + "/status", token)[1])
        if any(p["pid"] == pid for p in status["processes"]):
            break
        time.sleep(0.2)
    else:
        raise AssertionError(f"PID {pid} not watched:\n{_logs(pod)}")
    results = {}
    cap = pod["url"] + f"/capture?pid={pid}&seconds=2&levels=token,graph,op"
    t = threading.Thread(target=lambda: results.setdefault("r", _get(cap, token, method="POST", timeout=180)))
    t.start()
    time.sleep(1.0)
    w.go()
    t.join(timeout=180)
    w.proc.kill()
    code, data = results["r"]
    assert code == 200, (data[:500], _logs(pod))
    trace = tmp_path / "captured.pftrace"
    trace.write_bytes(data)
    prof = read_trace(trace)
    assert prof.pid == pid and len(prof.ops) > 0 and prof.tokens
    # nothing of the capture left behind in the pod's /tmp
    assert _podman("exec", pod["ctr"], "ls", "-A", "/tmp").stdout.strip() == ""
    assert _get(pod["url"] + "/healthz")[0] == 200


def _complete(url: str, i: int) -> dict:
    prompt = " ".join(["alpha", "beta", "gamma", "delta"][(i + j) % 4] for j in range(6 + 7 * i))
    body = json.dumps({"prompt": prompt, "n_predict": N_PREDICT, "ignore_eos": True}).encode()
    req = urllib.request.Request(f"{url}/completion", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.load(r)


def _until(pod, check, timeout: float = 30):
    """/metrics polled until check(text) is true; the last text."""
    deadline, text = time.monotonic() + timeout, ""
    while time.monotonic() < deadline:
        text = _metrics(pod)
        if check(text):
            break
        time.sleep(0.5)
    return text


def test_llama_server_tokens_counted_exactly(pod, llama_build, tiny_model, llama_env):
    with llama_server(llama_build, tiny_model, llama_env, SLOTS, ctx_per_slot=512) as (proc, url):

        def tokens(text: str) -> dict[str, int]:
            return {k: int(v) for k, v in series(text, "profinfer_tokens_total", proc.pid, "phase").items()}

        # the server decodes before it is ready (its warm-up, and a short decode even without
        # one): watched from its first instruction, those are counted before any request
        text = _until(pod, lambda t: tokens(t).get("prefill", 0) > 0)
        time.sleep(1)
        before = tokens(_metrics(pod))
        assert before.get("prefill", 0) > 0, _logs(pod)
        with concurrent.futures.ThreadPoolExecutor(SLOTS) as pool:
            replies = list(pool.map(lambda i: _complete(url, i), range(2 * SLOTS)))
        # the server samples each request's first token from its prompt's last batch and
        # never decodes its last one: predicted_n - 1 decode tokens a request
        want = {"prefill": before["prefill"] + sum(r["timings"]["prompt_n"] for r in replies),
                "decode": before.get("decode", 0) + sum(r["timings"]["predicted_n"] - 1 for r in replies)}
        text = _until(pod, lambda t: tokens(t) == want)
        assert tokens(text) == want, _logs(pod)
        assert sum(series(text, "profinfer_events_lost_total", proc.pid, None).values()) == 0


def test_cuda_program_calls_counted_as_it_logs_them(pod, tmp_path):
    program = cuda_workload.build_program(CUDA_PROGRAM, "shared")
    log = tmp_path / "calls.jsonl"
    proc = subprocess.Popen([str(program), "--log", str(log), "--repeat", "2",
                             "--libcuda", str(cuda_workload.ensure_libcuda())],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _STARTED.append(proc)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    kernels, copied, graphs = cuda_log_counts(log)

    def got(text):
        return ({k: int(v) for k, v in series(text, "profinfer_cuda_kernel_launches_total", proc.pid, "kernel").items()},
                {k: int(v) for k, v in series(text, "profinfer_cuda_copy_bytes_total", proc.pid, "kind").items()})

    text = _until(pod, lambda t: got(t) == (dict(kernels), dict(copied)))
    assert got(text) == (dict(kernels), dict(copied)), _logs(pod)
    assert series(text, "profinfer_cuda_graph_launches_total", proc.pid, None) == {"": graphs}
    assert sum(series(text, "profinfer_events_lost_total", proc.pid, None).values()) == 0


# last in the module: the session's vLLM server (conftest.KEPT) is kept for the tests after it
def test_vllm_server_steps_counted_as_its_metrics_count_them(pod, vllm_api):
    _, port = vllm_api()
    with _with_agent_state(pod):
        def ours(text: str) -> tuple[int, int]:
            """(vLLM processes watched, the steps the daemon counted in them)."""
            pids = {int(m) for m in re.findall(r'profinfer_process_info\{[^}]*engine="vLLM"[^}]*pid="(\d+)"', text)}
            calls = sum(sum(series(text, "profinfer_decode_calls_total", p, "phase").values()) for p in pids)
            return len(pids), int(calls)

        # the API server and its engine process both load vLLM's op libraries; the steps
        # run in the engine process
        text = _until(pod, lambda t: ours(t)[0] >= 2, timeout=60)
        assert ours(text)[0] >= 2, _logs(pod)
        steps_before, ours_before = vllm_steps(port), ours(text)[1]
        body = json.dumps({"model": "m", "prompt": "the cache of the attention", "max_tokens": 8,
                           "temperature": 0, "ignore_eos": True}).encode()
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda _: urllib.request.urlopen(urllib.request.Request(
                f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"}),
                timeout=120).read(), range(4)))
        steps = vllm_steps(port) - steps_before
        assert steps > 0
        text = _until(pod, lambda t: ours(t)[1] - ours_before == steps)
        assert ours(text)[1] - ours_before == steps, _logs(pod)
        assert "profinfer_events_lost_total{" not in text or all(
            float(l.rsplit(" ", 1)[1]) == 0 for l in text.splitlines()
            if l.startswith("profinfer_events_lost_total{") and 'engine="vLLM"' in l)
