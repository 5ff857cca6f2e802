"""The governor against time: an engine process the daemon governs (A) and an identical one
it does not (B), generating in turn, each window's rate as the engine measures it itself
(llama-server: the completion's timings.predicted_per_second; vLLM: bench/vllm_workload.py's
batches a second, on demand).

B runs from a copy of the build: the shared probes (token, graph) are uprobes on the library
files, and every process that maps a probed file traps on them, followed or not; a copy is
other inodes, so B takes no trap. In the copy the engine's libraries are renamed (libLLama,
libGGml: the same length, in every file that names them), so that the daemon, which knows
llama.cpp by its libraries' names, does not watch B (nor do other processes on the machine
take its place, as with --max-processes 1). The daemon's loop runs during B's windows too:
what is compared is what watching A costs A.

vLLM's B imports a copy of the vllm package (copied_vllm): its native libraries copied (other
inodes: no trap on A's probes), its other files linked. Its libraries' names are vLLM's, so
the daemon would watch B too: it runs with --max-processes 1, A started first (the daemon's
scan goes by PID).

Used by tests/daemon/test_daemon.py, tests/daemon/test_daemon_vllm.py and
bench/daemon_governor.py."""
from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Callable

import conftest

# the windows resolve a 4% budget where the standard error of their median ratio (measured)
# is under this: the cost must then be under the budget within 3 of it
TIMED_NOISE_MAX = 0.015

PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time there was"


RENAMES = ((b"libllama.so", b"libLLama.so"), (b"libggml", b"libGGml"))


def _renamed(name: str) -> str:
    for old, new in RENAMES:
        name = name.replace(old.decode(), new.decode())
    return name


def copied_build(build: Path, dest: Path) -> Path:
    """llama.cpp's server and libraries copied (new inodes), the engine's libraries renamed
    where they are named (file names, symlinks, DT_NEEDED and DT_SONAME strings)."""
    out = dest / "bin"
    out.mkdir(parents=True)
    for f in sorted((build / "bin").iterdir()):
        if not (f.name.startswith("lib") or f.name == "llama-server"):
            continue
        target = out / _renamed(f.name)
        if f.is_symlink():
            target.symlink_to(_renamed(os.readlink(f)))
            continue
        data = f.read_bytes()
        for old, new in RENAMES:
            data = data.replace(old, new)
        target.write_bytes(data)
        shutil.copymode(f, target)
    return out


def start_server(bin_dir: Path, model: Path, env: dict, port: int, ctx: int = 2048) -> subprocess.Popen:
    env = {**env, "LD_LIBRARY_PATH": str(bin_dir)}
    return subprocess.Popen([str(bin_dir / "llama-server"), "-m", str(model), "-np", "1", "-c", str(ctx),
                             "-t", "2", "--host", "127.0.0.1", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 60) -> None:
    conftest.wait_healthy(proc, url + "/health", "llama-server", timeout)


def window(url: str, n: int) -> float:
    """One generation of n tokens: llama.cpp's own decode rate (tokens/s)."""
    body = json.dumps({"prompt": PROMPT, "n_predict": n, "ignore_eos": True, "cache_prompt": False}).encode()
    req = urllib.request.Request(url + "/completion", data=body, method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        timings = json.loads(r.read())["timings"]
    return float(timings["predicted_per_second"])


def alternate(governed: Callable[[int], float], alone: Callable[[int], float], pairs: int, n: int,
              each=lambda i, a, b: None) -> list[tuple[float, float]]:
    """pairs x (governed, alone) windows of n (tokens, batches: each a function of n that
    returns its rate), in ABBA order (a drift cancels): [(A, B)] rates."""
    out = []
    for i in range(pairs):
        if i % 2:
            b = alone(n)
            a = governed(n)
        else:
            a = governed(n)
            b = alone(n)
        out.append((a, b))
        each(i, a, b)
    return out


def stepped_then_settled(d, pid: int, said: str) -> tuple[float | None, dict]:
    """While the process is loaded: how long until the daemon logged `said` (its first step
    down; None after 30 s), then its watch once its levels settled (no change for three
    governor windows, 6 s, of load; 40 s at most) and it was judged at them."""
    began, stepped = time.monotonic(), None
    while time.monotonic() - began < 30 and stepped is None:
        if said in d.text():          # logged once its levels have changed
            stepped = time.monotonic() - began
        time.sleep(0.2)
    if stepped is None:
        return None, d.watched(pid)
    mine = f"PID {pid}: levels"
    last, changes, settle_end = d.text().count(mine), time.monotonic(), time.monotonic() + 40
    while time.monotonic() < settle_end and time.monotonic() - changes < 6:
        time.sleep(0.5)
        if d.text().count(mine) != last:
            last, changes = d.text().count(mine), time.monotonic()
    deadline = time.monotonic() + 10     # judged at the levels it has now
    while time.monotonic() < deadline and d.watched(pid)["cost_share"] is None:
        time.sleep(0.2)
    return stepped, d.watched(pid)


def loaded_until_settled(d, pid: int, url: str, said: str) -> tuple[float | None, dict]:
    """stepped_then_settled while the server at url generates without a pause (a thread)."""
    import threading
    load = threading.Event()
    load.set()
    loader = threading.Thread(target=lambda: [window(url, 100) for _ in iter(load.is_set, False)])
    loader.start()
    try:
        return stepped_then_settled(d, pid, said)
    finally:
        load.clear()
        loader.join()


def a_level_comes_back_idle(d, pid: int, url: str, every_level: list[str]) -> None:
    """The last level the governor took from the llama-server at url comes back once it is
    idle, after its wait (if every level was given back meanwhile, it is loaded until one goes
    again), and the log says "(idle)"."""
    mine = f"PID {pid}: levels"
    if d.watched(pid)["levels"] == every_level:
        count, deadline = d.text().count(mine), time.monotonic() + 30
        while time.monotonic() < deadline and d.text().count(mine) == count:
            window(url, 100)
    # from its levels once idle: the judgment of the window where the load ended may still
    # step one down (a few ms of CPU against the daemon's own share)
    quiet_end = time.monotonic() + 20
    last, changed = d.text().count(mine), time.monotonic()
    while time.monotonic() < quiet_end and time.monotonic() - changed < 4:
        time.sleep(0.5)
        if d.text().count(mine) != last:
            last, changed = d.text().count(mine), time.monotonic()
    before = d.watched(pid)["levels"]
    assert before != every_level, d.text()
    wait = d.watched(pid)["step_up_wait_s"] + 3 * 2.0 + 2 * 2.0 + 5     # its wait, judgments, a scan
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline and d.watched(pid)["levels"] == before:
        time.sleep(0.5)
    after = d.watched(pid)["levels"]
    assert len(after) == len(before) + 1 and set(before) < set(after), (before, after, wait, d.text())
    said = f"{mine} {','.join(before)} -> {','.join(after)} (idle)"
    deadline = time.monotonic() + 5        # logged once its levels have changed
    while time.monotonic() < deadline and said not in d.text():
        time.sleep(0.2)
    assert said in d.text(), d.text()


def server_window(url: str) -> Callable[[int], float]:
    return lambda n: window(url, n)


def twin_servers(build: Path, model: Path, env: dict, tmp_path: Path, started: list) -> tuple:
    """Server A (the build) and B (copied_build: the daemon cannot see it), healthy, each
    added to `started` (killed by the caller): (A, B, A's URL, B's URL, n), n tokens making a
    window of ~1.5 s at B's rate now (the machine is shared: its rate varies)."""
    from daemon_helpers import _free_port
    pa, pb = _free_port(), _free_port()
    a = start_server(build / "bin", model, env, pa)
    started.append(a)
    b = start_server(copied_build(build, tmp_path), model, env, pb)
    started.append(b)
    url_a, url_b = f"http://127.0.0.1:{pa}", f"http://127.0.0.1:{pb}"
    wait_healthy(url_a, a)
    wait_healthy(url_b, b)
    window(url_a, 100)
    return a, b, url_a, url_b, max(50, min(1500, int(window(url_b, 100) * 1.5)))


WORKLOAD = Path(__file__).resolve().parents[2] / "bench" / "vllm_workload.py"


def copied_vllm(vllm_python: Path, dest: Path) -> Path:
    """A directory to put first on PYTHONPATH: the vllm package of vllm_python's venv, its
    native libraries (`*.so`) copied, every other file a link to the original."""
    found = subprocess.run([str(vllm_python), "-c", "import importlib.util as u; print(u.find_spec('vllm').origin)"],
                           capture_output=True, text=True, check=True).stdout.strip()
    package = Path(found).parent
    for root, dirs, files in os.walk(package):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        out = dest / "vllm" / Path(root).relative_to(package)
        out.mkdir(parents=True, exist_ok=True)
        for f in files:
            if f.endswith(".so"):
                shutil.copy2(Path(root) / f, out / f)
            else:
                (out / f).symlink_to(Path(root) / f)
    return dest


class VllmOnDemand:
    """bench/vllm_workload.py on demand, past its warm-up; window(n): n batches, their rate."""

    def __init__(self, vllm_python: Path, model: Path, mode: str = "eager", pythonpath: Path | None = None):
        env = {**os.environ, **({"PYTHONPATH": str(pythonpath)} if pythonpath else {})}
        self.proc = subprocess.Popen([str(vllm_python), str(WORKLOAD), str(model), mode, "on-demand"], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True)
        self.pid = self.proc.pid

    def ready(self) -> None:
        seen = []
        for line in self.proc.stdout:           # vLLM logs to stdout too
            seen.append(line)
            if line.strip() == "READY":
                return
        raise AssertionError("vLLM on demand exited before READY: " + "".join(seen[-20:]))

    def window(self, n: int) -> float:
        self.proc.stdin.write(f"RUN {n}\n")
        self.proc.stdin.flush()
        for line in self.proc.stdout:
            if line.startswith("DONE "):
                return float(line.split()[1])
        raise AssertionError(f"vLLM on demand (PID {self.pid}) exited mid-window")


def timed_cost(rates: list[tuple[float, float]]) -> tuple[float, float]:
    """(cost, its standard error): 1 - the median of the pairs' A/B, and 1.25 x the MAD of the
    ratios / sqrt(pairs) (the median's standard error for normal noise)."""
    ratios = [a / b for a, b in rates]
    med = statistics.median(ratios)
    mad = statistics.median(abs(r - med) for r in ratios) * 1.4826
    return 1 - med, 1.25 * mad / len(ratios) ** 0.5


def cost_against_before(before: list[tuple[float, float]], governed: list[tuple[float, float]]) -> tuple[float, float]:
    """(cost, its standard error) of watching A: 1 - (median A/B governed) / (median A/B
    before the daemon). Two servers alike are not alike in time (A ran 3.4% slower than B with
    nothing watching, bench/results.md): that difference is the servers', not the daemon's."""
    c0, se0 = timed_cost(before)
    c1, se1 = timed_cost(governed)
    return 1 - (1 - c1) / (1 - c0), (se0 ** 2 + se1 ** 2) ** 0.5
