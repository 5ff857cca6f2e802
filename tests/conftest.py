"""Shared fixtures: the real workload (llama.cpp + GGUF models) and a way to run profinfer."""
from __future__ import annotations

import atexit
import contextlib
import functools
import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from profinfer.core.ebpf import held, followed
from profinfer.engines.llamacpp import workload

PROFINFER = [sys.executable, "-m", "profinfer.cli"]
TESTS = Path(__file__).parent
REPO = TESTS.parent
# test modules share their helpers by module name across folders (daemon_helpers, governed,
# a module's own checks): every folder that holds tests is importable, whichever runs alone
for _folder in sorted({p.parent for p in TESTS.rglob("test_*.py")} | {TESTS / "daemon"}):
    if str(_folder) not in sys.path:
        sys.path.append(str(_folder))

# The tiers (README): the default runs every test but `soak` and `gpu`, which are chosen by
# name (`pytest -m soak`, `pytest -m gpu`). Each marker is given by the folder a test is in,
# or by the fixtures it uses, never typed on a test one at a time.
MARKERS = {
    "soak": "long or timed runs (minutes of load, A/B cost windows): their figures go to bench/results.md",
    "gpu": "needs a CUDA GPU: run on a lent GPU machine (tests/gpu/)",
    "root": "loads BPF or attaches probes: needs root (CAP_BPF, CAP_PERFMON) and kernel BTF",
    "workload": "runs a real engine or runtime (llama.cpp, vLLM, a CUDA program)",
}
FOLDER_MARKERS = {"soak": ("soak", "root", "workload"), "gpu": ("gpu", "root", "workload")}
WORKLOAD_FIXTURES = {"llama_build", "vllm_python", "libcuda", "cudart12", "llama_env"}
ROOT_FOLDERS = {"daemon", "engines", "levels", "soak", "gpu"}


def pytest_configure(config):
    for name, what in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {what}")


def pytest_collection_modifyitems(config, items):
    for item in items:
        path = Path(item.fspath).resolve()
        folders = path.relative_to(TESTS.resolve()).parts[:-1] if path.is_relative_to(TESTS.resolve()) else ()
        marks = {m for folder in folders for m in FOLDER_MARKERS.get(folder, ())}
        if ROOT_FOLDERS & set(folders):
            marks.add("root")
        if WORKLOAD_FIXTURES & set(getattr(item, "fixturenames", ())):
            marks |= {"workload", "root"}
        for m in sorted(marks):
            item.add_marker(m)
    # each kept engine's users together, where the first of them was: one start each
    for name in KEPT:
        users = [item for item in items if name in getattr(item, "fixturenames", ())]
        if users:
            first, chosen = items.index(users[0]), set(users)
            rest = [item for item in items if item not in chosen]
            items[:] = rest[:first] + users + rest[first:]


def pytest_runtest_setup(item):
    used = set(getattr(item, "fixturenames", ()))
    for name, close in KEPT.items():
        if name not in used:
            close()
PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time there was"
# vLLM's CPU builds with AVX-512 run the linear layers in a native op of theirs (SGL's packed
# kernel, or oneDNN's matmul); on a CPU with AVX2 alone they run in torch's own matmul, which
# the op level does not probe (docs/vllm.md)
CPU_FLAGS = frozenset(Path("/proc/cpuinfo").read_text().split())
VLLM_NATIVE_LINEAR = "avx512f" in CPU_FLAGS


@pytest.fixture(scope="session")
def llama_build() -> Path:
    return workload.ensure_llama_build()


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    return workload.ensure_model("tiny")


@pytest.fixture(scope="session")
def big_model() -> Path:
    return workload.ensure_model("llama-1.5b")


@pytest.fixture(scope="session")
def llama_env(llama_build) -> dict[str, str]:
    return llama_run_env(llama_build)


def llama_run_env(build: Path, **extra: str) -> dict[str, str]:
    """The environment llama.cpp's tools run in here: its build's libraries, and its log
    drained at exit (llama_log_drain)."""
    return {**os.environ, **workload.llama_env(build), "LD_PRELOAD": llama_log_drain(), **extra}


@functools.lru_cache(maxsize=None)
def llama_log_drain() -> str:
    """helpers/llama_log_drain.c, built: preloaded, it makes llama.cpp's tools write their
    whole log before they exit, their perf summary with it."""
    out = Path(tempfile.mkdtemp(prefix="profinfer-tests-")) / "llama_log_drain.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-O2", "-o", str(out),
                    str(Path(__file__).parent / "helpers" / "llama_log_drain.c")], check=True)
    return str(out)


def completion_cmd(build: Path, model: Path, n: int = 24, threads: int = 2, prompt: str = PROMPT,
                   extra: tuple[str, ...] = ()) -> list[str]:
    return workload.completion_command(build, model, prompt, n, threads, extra=extra)


@dataclass
class Run:
    rc: int
    stdout: str
    stderr: str
    summary: dict | None


def run_profinfer(args: list[str], env=None, timeout=600, tmp_path: Path | None = None,
                  json_summary: bool = True) -> Run:
    cmd = list(PROFINFER)
    out = None
    if json_summary and tmp_path is not None:
        out = tmp_path / "summary.json"
        cmd += [args[0], "--json", str(out), *args[1:]]
    else:
        cmd += args
    # faulthandler on: a run past its timeout is asked (SIGABRT) where its threads were
    env = {**(os.environ if env is None else env), "PYTHONFAULTHANDLER": "1"}
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) as p:
        try:
            stdout, stderr = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"profinfer {args[0]} ran past {timeout} s\n" + _hung(p))
    summary = json.loads(out.read_text()) if out is not None and out.exists() else None
    return Run(p.returncode, stdout, stderr, summary)


def _descendants(pid: int) -> list[int]:
    """Every process below pid (the children of each of its threads, and theirs)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except (OSError, ValueError):
                continue
            out += children
            todo += children
    return out


def _hung(p: subprocess.Popen) -> str:
    """What a hung profinfer run and its processes were doing: each process's state and kernel
    wait (a target left stopped reads T), then profinfer's Python stacks; all of them killed.
    The processes below profinfer hold its output pipes: they are killed before its output is
    read, or reading would wait for them."""
    tree = [p.pid] + _descendants(p.pid)
    lines = []
    for pid in tree:
        try:
            status = dict(line.split(":\t", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                          if ":\t" in line)
            wchan = Path(f"/proc/{pid}/wchan").read_text()
            lines.append(f"PID {pid} {status.get('Name', '?')} state {status.get('State', '?')} "
                         f"wchan {wchan} ShdPnd {status.get('ShdPnd', '?')}")
        except OSError:
            lines.append(f"PID {pid}: gone")
    p.send_signal(signal.SIGABRT)
    with contextlib.suppress(subprocess.TimeoutExpired):
        p.wait(timeout=10)                  # faulthandler writes the stacks, then it dies
    p.kill()                                # a no-op once it is reaped
    for pid in tree[1:]:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    try:
        _, stderr = p.communicate(timeout=10)
    except subprocess.TimeoutExpired:       # a grandchild of its own holds the pipes still
        stderr = "(its stderr not read: a process outside its tree holds the pipe)"
    return "\n".join(lines) + "\n--- its stderr's end ---\n" + (stderr or "")[-8000:]


_PERF = re.compile(r"(?:llama_perf_context_print|common_perf_print):\s+(prompt eval|eval) time =\s+([\d.]+) ms /\s+(\d+) (tokens|runs)")


def llama_perf(text: str) -> dict[str, tuple[float, int]]:
    """llama.cpp's own numbers: {"prompt eval": (ms, tokens), "eval": (ms, runs)}."""
    return {m.group(1): (float(m.group(2)), int(m.group(3))) for m in _PERF.finditer(text)}


def with_llama_log(run):
    """run(), checked to have printed llama.cpp's own perf summary (the outside truth).

    llama-completion logs through an asynchronous logger that it never flushes at exit
    (upstream issue 22142): under CPU load its last lines were lost (measured: 8 of 12 plain
    runs beside two busy processes). The environment llama_run_env gives preloads a drain of
    that log at exit (0 of 12 lost, same load), so a run without the summary is a defect.
    """
    result = run()
    if getattr(result, "rc", getattr(result, "returncode", 0)) != 0:
        return result  # a real failure: let the test's own assertion report it
    text = result.stderr if isinstance(result.stderr, str) else result.stderr.decode()
    assert {"prompt eval", "eval"} <= llama_perf(text).keys(), \
        f"llama.cpp's perf lines missing (was its log drain preloaded?):\n{text[-2000:]}"
    return result


_BPF_KINDS = ("prog", "map", "link")
# what /proc/PID/fd/N links to for each kind, and the fdinfo line with the object's id
_BPF_FD = {"anon_inode:bpf-prog": ("prog", "prog_id"), "anon_inode:bpf-map": ("map", "map_id"),
           "anon_inode:bpf_link": ("link", "link_id")}


def _bpftool(*args: str) -> list[dict]:
    out = subprocess.run(["bpftool", *args, "--json"], capture_output=True, text=True).stdout
    return json.loads(out or "[]") or []


def _node_maps() -> set[tuple[str, int]]:
    """The node's pinned maps (the processes records follow: profinfer.core.ebpf.followed; the
    processes discovery holds: profinfer.core.ebpf.held): they outlive every run by design,
    whichever run made them."""
    out = set()
    for name in (followed.MAP_NAME, held.MAP_NAME):
        shown = _bpftool("map", "show", "pinned", f"{followed.PIN_DIR}/{name}")
        if isinstance(shown, dict) and "id" in shown:
            out.add(("map", shown["id"]))
    return out


def bpf_snapshot() -> dict[tuple[str, int], str]:
    """Every BPF program, map and link loaded now, system-wide, but the node's pinned maps:
    {(kind, id): name}."""
    node = _node_maps()
    return {(kind, o["id"]): o.get("name") or o.get("type", "")
            for kind in _BPF_KINDS for o in _bpftool(kind, "show") if (kind, o["id"]) not in node}


def _fds(pid: int) -> list[tuple[str, str]]:
    """(link target, fdinfo text) of each open fd of a process ([] once it is gone)."""
    return [(target, info) for _, target, info in open_fds(pid)]


def open_fds(pid: int) -> list[tuple[int, str, str]]:
    """(fd, link target, fdinfo text) of each open fd of a process ([] once it is gone; an
    fd it closes meanwhile is left out)."""
    out = []
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                out.append((int(fd), os.readlink(f"/proc/{pid}/fd/{fd}"),
                            Path(f"/proc/{pid}/fdinfo/{fd}").read_text()))
            except OSError:
                pass      # closed meanwhile
    except OSError:
        pass
    return out


def bpf_holders() -> dict[tuple[str, int], set[int]]:
    """Which processes hold an fd of each BPF object: {(kind, id): {pid, ...}}. A link's
    holders also hold its program."""
    held: dict[tuple[str, int], set[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        for target, info in _fds(int(entry)):
            kind_key = _BPF_FD.get(target)
            if kind_key is None:
                continue
            fields = dict(l.split(":", 1) for l in info.splitlines() if ":" in l)
            for kind, key in (kind_key, ("prog", "prog_id")):
                if key in fields:
                    held.setdefault((kind, int(fields[key])), set()).add(int(entry))
    return held


def _descends_from(pid: int, ancestor: int) -> bool:
    for _ in range(64):
        if pid == ancestor:
            return True
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return False
        pid = int(stat.rsplit(")", 1)[1].split()[1])
        if pid <= 1:
            return False
    return False


class BpfWatch:
    """What profinfer runs started by this test leave behind, told apart from what other
    processes (other profinfer runs on this machine) load meanwhile.

    From a snapshot taken at the start, it samples every quarter second which processes
    hold each BPF program, map and link: a process this test started (profinfer, its
    children) or another one. An object whose holders have all gone is freed by the kernel
    unless something keeps it (pinned, attached by the kernel, an fd copied elsewhere).
    """

    def __init__(self):
        self.before = bpf_snapshot()
        self.ours: set[tuple[str, int]] = set()       # held by a process this test started
        self.theirs: set[tuple[str, int]] = set()     # held by any other process
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _sample(self) -> dict[tuple[str, int], set[int]]:
        holders = bpf_holders()
        me = os.getpid()
        for key, pids in holders.items():
            for pid in pids:
                if pid != me and _descends_from(pid, me):
                    self.ours.add(key)
                elif pid != me:
                    self.theirs.add(key)
        return holders

    def _run(self) -> None:
        while not self._stop.wait(0.25):
            self._sample()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def leftovers(self, targets: set[int], wait_s: float = 10.0) -> list[str]:
        """BPF objects new since the start that this test process or the profiled `targets`
        hold, or that nothing holds and only a process of this test ever held (or none was
        seen to); programs attached to perf events (uprobes) that those hold; any BPF or
        perf-event fd in a target. The kernel frees a dead process's objects
        asynchronously: this waits up to `wait_s` for none to be left."""
        suspects = set(targets) | {os.getpid()}
        deadline = time.time() + wait_s
        while True:
            found = []
            now = bpf_snapshot()
            holders = self._sample()
            for key in sorted(now.keys() - self.before.keys()):
                owners = holders.get(key, set())
                if owners & suspects or (not owners and (key in self.ours or key not in self.theirs)):
                    found.append(f"{key[0]} {key[1]} {now[key]!r} held by "
                                 f"{sorted(owners) if owners else 'no process'}")
            for att in _bpftool("perf", "show"):
                if att.get("pid") in suspects:
                    found.append(f"prog {att.get('prog_id')} on a {att.get('fd_type')} perf event "
                                 f"held by {att['pid']}")
            for pid in targets:
                for target, _ in _fds(pid):
                    if target in _BPF_FD or target == "anon_inode:[perf_event]":
                        found.append(f"{target} fd in process {pid}")
            if not found or time.time() > deadline:
                return found
            time.sleep(0.2)


@pytest.fixture
def bpf_watch():
    watch = BpfWatch()
    yield watch
    watch.stop()


def endless_cmd(build: Path, model: Path, threads: int = 2) -> list[str]:
    """A generation that runs until killed (context shift, EOS ignored)."""
    return workload.completion_command(build, model, PROMPT, -1, threads,
                                       extra=("--context-shift", "--ignore-eos", "-c", "256"))


class Target:
    """A llama.cpp process generating in the background, for attach tests."""

    def __init__(self, cmd: list[str], env):
        # its stdout (a file: nothing to drain) is its prompt echoed, then each token it
        # generates: waited on until tokens follow the prompt, past model load: generating
        echoed = len(cmd[cmd.index("-p") + 1].encode()) + 1        # the echo's leading space
        self._out = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(cmd, stdout=self._out, stderr=subprocess.DEVNULL, env=env)
        deadline = time.monotonic() + 60
        while os.fstat(self._out.fileno()).st_size <= echoed + 16:       # a few tokens
            assert self.proc.poll() is None, f"exited ({self.proc.returncode}) before generating"
            if time.monotonic() > deadline:
                self.stop()
                raise AssertionError("not generating within 60 s")
            time.sleep(0.02)
        assert self.proc.poll() is None

    def alive(self) -> bool:
        return self.proc.poll() is None

    def cpu_ticks(self) -> int:
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])

    def still_generating(self) -> bool:
        before = self.cpu_ticks()
        time.sleep(0.5)
        return self.alive() and self.cpu_ticks() > before

    def stop(self):
        self.proc.kill()
        self.proc.wait()
        self._out.close()


def start_profinfer(args: list[str], env=None) -> subprocess.Popen:
    """Start profinfer in the background and wait until its probes are attached."""
    p = subprocess.Popen([*PROFINFER, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=env)
    err = []
    for line in p.stderr:
        err.append(line)
        if "attached" in line or line.startswith("profinfer: error"):
            break
    assert "attached" in "".join(err), "".join(err)
    p.early_stderr = "".join(err)
    return p


def attached_run(target: subprocess.Popen, args: list[str], go: Path, on_attached=None,
                 timeout: float = 300) -> str:
    """profinfer started on a target held before its work (`args`), the target let go (`go`
    touched), both waited for: profinfer's stderr. on_attached(prof) runs before the go."""
    try:
        prof = start_profinfer(args)
        if on_attached is not None:
            on_attached(prof)
        go.touch()
        assert target.wait(timeout=timeout) == 0
        _, err = prof.communicate(timeout=120)
        assert prof.returncode == 0, prof.early_stderr + err
    finally:
        if target.poll() is None:
            target.kill()
    return prof.early_stderr + err


class VllmEngine:
    """tests/engines/vllm/offline_truth.py: a vLLM engine of one mode, past its warm-up, that makes a
    generation and records its truth each time it is asked (over its stdin). One serves the
    tests that use it in a row: each user attaches, asks, and detaches, leaving nothing
    attached (checked by each), so that attaching again to a process profinfer has left is
    tested too."""

    def __init__(self, vllm_python: Path, vllm_model: Path, mode: str):
        script = TESTS / "engines" / "vllm" / "offline_truth.py"
        self.mode = mode
        self.proc = subprocess.Popen([str(vllm_python), str(script), str(vllm_model), mode],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     text=True, start_new_session=True)
        self._lines: queue.Queue = queue.Queue()
        self.asked: Path | None = None
        threading.Thread(target=self._read, daemon=True).start()     # vLLM logs to stdout too
        try:
            self._wait_for("READY", 300)
        except BaseException:
            self.close()
            raise

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._lines.put(line.strip())
        self._lines.put(None)

    def _wait_for(self, word: str, timeout: float) -> None:
        seen, deadline = [], time.monotonic() + timeout
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"vLLM ({self.mode}) did not say {word} in {timeout:g} s:\n"
                                     + "\n".join(seen[-20:])) from None
            if line is None:
                raise AssertionError(f"vLLM ({self.mode}) exited ({self.proc.wait()}):\n" + "\n".join(seen[-20:]))
            if line == word:
                return
            seen.append(line)

    def _ask(self, asked: dict) -> None:
        self.proc.stdin.write(json.dumps(asked) + "\n")
        self.proc.stdin.flush()

    def start(self, truth_path: Path, seconds: float = 0.0) -> None:
        """A generation begun (its prompts once, or again and again for `seconds`)."""
        assert self.asked is None, "one generation at a time"
        self.asked = truth_path
        self._ask({"truth": str(truth_path), "seconds": seconds})

    def steady(self, truth_path: Path) -> None:
        """Steady decode load begun (until finish(): its steps, each [CLOCK_MONOTONIC s, its
        sequences' new tokens])."""
        assert self.asked is None, "one generation at a time"
        self.asked = truth_path
        self._ask({"steady": str(truth_path)})

    def burst(self, seconds: float) -> None:
        """Under steady load: a long prompt before every step for `seconds`."""
        self._ask({"burst": seconds})

    def stop_steady(self, timeout: float = 300) -> dict:
        self._ask({"stop": True})
        return self.finish(timeout)

    def finish(self, timeout: float = 300) -> dict:
        """The generation's truth, once it is done."""
        self._wait_for("DONE", timeout)
        truth_path, self.asked = self.asked, None
        return json.loads(truth_path.read_text())

    def generate(self, truth_path: Path, seconds: float = 0.0) -> dict:
        self.start(truth_path, seconds)
        return self.finish()

    def close(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


_VLLM_ENGINES: dict[str, VllmEngine] = {}


@pytest.fixture(scope="session")
def vllm_engine(vllm_python, vllm_model):
    """vllm_engine(mode): the one engine of that mode (VllmEngine), started at first use and
    kept while the tests that follow use it (KEPT). One left mid-generation by a failed test
    is replaced."""
    def get(mode: str) -> VllmEngine:
        engine = _VLLM_ENGINES.get(mode)
        if engine is not None and (engine.proc.poll() is not None or engine.asked is not None):
            engine.close()
            engine = None
        if engine is None:
            _VLLM_ENGINES[mode] = engine = VllmEngine(vllm_python, vllm_model, mode)
        return engine
    yield get
    close_vllm_engines()


def close_vllm_engines() -> None:
    while _VLLM_ENGINES:
        _VLLM_ENGINES.popitem()[1].close()


def attached_generation(engine: VllmEngine, args: list[str], truth_path: Path, seconds: float = 0.0,
                        bpf_watch: "BpfWatch | None" = None) -> tuple[dict, str]:
    """profinfer (`args`) attached to the module's engine over one generation, then stopped as
    a user stops it (SIGINT): (the generation's truth, profinfer's stderr). With bpf_watch,
    nothing of it is left attached in the engine or the kernel."""
    prof = start_profinfer(args)
    try:
        truth = engine.generate(truth_path, seconds)
    finally:
        prof.send_signal(signal.SIGINT)
        try:
            _, err = prof.communicate(timeout=120)
        except subprocess.TimeoutExpired:       # never left attached to the module's engine
            prof.kill()
            prof.wait()
            raise
    assert prof.returncode == 0, prof.early_stderr + err
    if bpf_watch is not None:
        left = bpf_watch.leftovers({engine.pid})
        assert not left, left
    return truth, prof.early_stderr + err


DUMMY_LINK, DUMMY_ADDRESS = "pi-test0", "198.51.100.7"      # TEST-NET-2: routed nowhere


@functools.lru_cache(maxsize=None)
def off_loopback_address() -> str:
    """An IPv4 address of this machine on an interface that is up, other than loopback (a
    peer that is not loopback). A machine with loopback alone gets one, on a dummy link made
    for the session (root's `ip`), removed at exit: the tests that need one always run."""
    out = json.loads(subprocess.run(["ip", "-j", "-4", "addr", "show", "up", "scope", "global"],
                                    capture_output=True, text=True, check=True).stdout)
    found = next((a["local"] for i in out if "LOWER_UP" in i.get("flags", []) for a in i["addr_info"]), None)
    if found is not None:
        return found
    subprocess.run(["ip", "link", "del", DUMMY_LINK], capture_output=True)     # a killed run's
    for cmd in (["link", "add", DUMMY_LINK, "type", "dummy"], ["addr", "add", f"{DUMMY_ADDRESS}/32", "dev", DUMMY_LINK],
                ["link", "set", DUMMY_LINK, "up"]):
        subprocess.run(["ip", *cmd], check=True, capture_output=True)
    atexit.register(subprocess.run, ["ip", "link", "del", DUMMY_LINK], capture_output=True)
    return DUMMY_ADDRESS


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(proc: subprocess.Popen, url: str, what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"{what} exited"
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"{what} did not start in {timeout:g} s; its processes now:\n"
                         + "\n".join(process_states(proc.pid)))


def process_states(pid: int) -> list[str]:
    """'PID name: State' of a process and every process in its session (a process left
    stopped shows 'T (stopped)')."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            status = Path(f"/proc/{entry}/status").read_text()
            if int(entry) != pid and os.getsid(int(entry)) != pid:
                continue
        except OSError:
            continue
        fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
        out.append(f"{entry} {fields.get('Name', '?')}: {fields.get('State', '?')}")
    return out


@contextlib.contextmanager
def llama_server(build: Path, model: Path, env: dict, slots: int, ctx_per_slot: int = 1024, threads: int = 2,
                 extra: tuple[str, ...] = (), preexec_fn=None):
    """A llama-server with `slots` parallel slots (and `extra` arguments), healthy: (its
    process, its URL)."""
    port = free_port()
    proc = subprocess.Popen([str(workload.llama_bin("llama-server", build)), "-m", str(model),
                             "-np", str(slots), "-c", str(slots * ctx_per_slot), "-t", str(threads), *extra,
                             "--host", "127.0.0.1", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, preexec_fn=preexec_fn)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(proc, f"{url}/health", "llama-server", 60)
        yield proc, url
    finally:
        proc.kill()
        proc.wait()


def vllm_steps(port: int) -> int:
    """The steps a vLLM server ran, from its own /metrics (its iteration histogram's count)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return sum(int(float(l.rsplit(" ", 1)[1])) for l in text.splitlines()
               if l.startswith("vllm:iteration_tokens_total_count"))


_VLLM_API = contextlib.ExitStack()
_VLLM_API_FOUND: list[tuple[subprocess.Popen, int]] = []


@pytest.fixture(scope="session")
def vllm_api(vllm_python, vllm_model):
    """vllm_api(): vLLM's OpenAI server (vllm_server), started at first use and kept while
    the tests that follow use it (KEPT): (the API server's process, its port). One that
    exited is replaced."""
    def get() -> tuple[subprocess.Popen, int]:
        if _VLLM_API_FOUND and _VLLM_API_FOUND[0][0].poll() is not None:
            close_vllm_api()
        if not _VLLM_API_FOUND:
            _VLLM_API_FOUND.append(_VLLM_API.enter_context(vllm_server(vllm_python, vllm_model)))
        return _VLLM_API_FOUND[0]
    yield get
    close_vllm_api()


def close_vllm_api() -> None:
    _VLLM_API_FOUND.clear()
    _VLLM_API.close()


# Engines kept across tests (their fixtures' names) and what closes them: each is closed
# before any test that does not use it runs (its daemon would watch it too), and its users
# are put together (pytest_collection_modifyitems). A user leaves nothing attached to it.
KEPT = {"vllm_engine": close_vllm_engines, "vllm_api": close_vllm_api}


@contextlib.contextmanager
def vllm_server(vllm_python: Path, vllm_model: Path):
    """vLLM's OpenAI server (its own session, so that its children go with it), healthy:
    (the API server's process, its port)."""
    port = free_port()
    proc = subprocess.Popen([str(vllm_python), "-m", "vllm.entrypoints.openai.api_server",
                             "--model", str(vllm_model), "--served-model-name", "m",
                             "--max-model-len", "512", "--enforce-eager", "--dtype", "bfloat16",
                             "--seed", "0", "--port", str(port), "--host", "127.0.0.1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}, start_new_session=True)
    try:
        wait_healthy(proc, f"http://127.0.0.1:{port}/health", "the vLLM server", 300)
        yield proc, port
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    """vLLM for CPU, in its own venv (profinfer.engines.vllm.workload)."""
    from profinfer.engines.vllm import workload as vllm_workload
    return vllm_workload.ensure_vllm()


@pytest.fixture(scope="session")
def vllm_model() -> Path:
    from profinfer.engines.vllm import workload as vllm_workload
    return vllm_workload.ensure_model()


@pytest.fixture(scope="session")
def libcuda() -> Path:
    """Debian's libcuda1 (the CUDA driver library; no GPU: its calls fail after entry)."""
    from profinfer.levels.cuda import workload as cuda_workload
    return cuda_workload.ensure_libcuda()


@pytest.fixture(scope="session")
def cudart12() -> Path:
    """CUDA 12's runtime from PyPI."""
    from profinfer.levels.cuda import workload as cuda_workload
    return cuda_workload.ensure_cudart12()


@pytest.fixture(scope="session")
def moe_model() -> Path:
    return workload.ensure_model("tiny-moe")
