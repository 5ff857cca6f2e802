"""Discovery from the kernel: a process started after the daemon is held at its loader's
hook (bpf/discover.bpf.c) until its engine's probes are on, however briefly it lives, and a
runtime it dlopens later is probed before its first call. The truths are the programs' own:
llama.cpp's perf report, the CUDA program's log of every call. Nothing waits for the daemon:
the programs start and run straight through."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import completion_cmd, llama_perf
from daemon_helpers import _STARTED, Daemon, Workload, _get, cuda_log_counts, discovering_daemon, kill_started, series
from profinfer.core.ebpf import held, kernel, libbpf, pinned
from profinfer.daemon.discovery.kernel import HOLD_DEADLINE_S, ORPHAN_S
from profinfer.levels.cuda import workload as cuda_workload

from test_daemon_cuda import PROGRAM as CUDA_PROGRAM

# the second daemon's wait before it ends a frozen daemon's hold (PROFINFER_HOLD_STUCK_S; 18 s
# by default): past the frozen one's own watchdog (ORPHAN_S) by 4 s, as the default by 12
STUCK_S = ORPHAN_S + 4
# the kernel's deadline on a hold pushed past that (PROFINFER_HOLD_DEADLINE_S), where the
# other daemons' part is what is tested
NO_DEADLINE = {"PROFINFER_HOLD_DEADLINE_S": "600"}


@pytest.fixture(autouse=True)
def _no_workload_left():
    yield
    kill_started()


@pytest.fixture
def daemon(tmp_path):
    d = discovering_daemon(tmp_path)
    yield d
    d.stop()


def _metrics_after_exit(d: Daemon, pids: set[int]) -> str:
    """/metrics once each process's exit has been seen (what it sent drained)."""
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and pids & {
            p["pid"] for p in json.loads(_get(d.url + "/status")[1])["processes"]}:
        time.sleep(0.1)
    return _get(d.url + "/metrics")[1].decode()


def test_short_llama_simple_runs_counted_exactly(daemon, llama_build, tiny_model, llama_env):
    """llama-simple, 40 tokens in ~0.1 s, three times: each run's prompt and generated
    tokens and decode calls equal its own report (the scan alone saw none of them)."""
    runs = []
    for _ in range(3):
        proc = subprocess.Popen([str(llama_build / "bin" / "llama-simple"), "-m", str(tiny_model),
                                 "-n", "40", "Once upon a time, in a quiet town"],
                                env=llama_env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        _STARTED.append(proc)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        perf = llama_perf(err)
        assert {"prompt eval", "eval"} <= perf.keys(), err[-2000:]
        runs.append((proc.pid, perf))
    text = _metrics_after_exit(daemon, {pid for pid, _ in runs})
    for pid, perf in runs:
        tokens = series(text, "profinfer_tokens_total", pid, "phase")
        calls = series(text, "profinfer_decode_calls_total", pid, "phase")
        assert tokens == {"prefill": perf["prompt eval"][1], "decode": perf["eval"][1]}, (
            daemon.text() + "\n".join(l for l in text.splitlines() if "tokens_total" in l))
        assert calls.get("decode") == perf["eval"][1]


def test_runtime_dlopened_later_probed_before_its_first_call(daemon, tmp_path):
    """A program on the shared CUDA 13 runtime (held at start: it maps libcudart) that then
    dlopens CUDA 12's runtime and libcuda and calls them at once: every call in its log is
    counted, those of the late runtime included."""
    program = cuda_workload.build_program(CUDA_PROGRAM, "shared")
    log = tmp_path / "calls.jsonl"
    proc = subprocess.Popen([str(program), "--log", str(log), "--repeat", "2",
                             "--runtime", f"dlopen:{cuda_workload.ensure_cudart12()}",
                             "--libcuda", str(cuda_workload.ensure_libcuda())],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _STARTED.append(proc)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    text = _metrics_after_exit(daemon, {proc.pid})
    kernels, copied, graphs = cuda_log_counts(log)
    assert sum(kernels.values()) > 0
    got = series(text, "profinfer_cuda_kernel_launches_total", proc.pid, "kernel")
    assert {k: int(v) for k, v in got.items()} == dict(kernels), daemon.text()
    got_bytes = series(text, "profinfer_cuda_copy_bytes_total", proc.pid, "kind")
    assert {k: int(v) for k, v in got_bytes.items()} == dict(copied)
    assert series(text, "profinfer_cuda_graph_launches_total", proc.pid, None) == {"": graphs}


WATCH_STOPS = r"""
import os, sys
stopped = 0
for i in range(int(sys.argv[1])):
    pid = os.fork()
    if pid == 0:
        os.execv(sys.argv[2], sys.argv[2:])
    while True:
        _, status = os.waitpid(pid, os.WUNTRACED)
        if os.WIFSTOPPED(status):       # what a shell's job control would report
            stopped += 1
            os.kill(pid, 18)
            continue
        break
print(stopped)
"""


def test_unrelated_processes_are_never_stopped(daemon, tmp_path):
    """A parent that waits with WUNTRACED (as a shell's job control does) sees no stop of 200
    children that exec and load libraries no engine has (python importing ctypes and libm)."""
    script = tmp_path / "watch.py"
    script.write_text(WATCH_STOPS)
    child = ["/usr/bin/python3", "-c", "import ctypes, ctypes.util; ctypes.CDLL(ctypes.util.find_library('m'))"]
    out = subprocess.run(["/usr/bin/python3", str(script), "200", *child], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) == 0
    # the same watch sees the stops where there are some: a library named like an engine's
    # (a copy of libm named libllama.so) holds each child once
    import ctypes.util
    fake = tmp_path / "libllama.so"
    libm = ctypes.util.find_library("m")
    fake.write_bytes(next(Path(d, libm).read_bytes() for d in ("/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu")
                          if Path(d, libm).exists()))
    engine_like = ["/usr/bin/python3", "-c", f"import ctypes; ctypes.CDLL({str(fake)!r})"]
    out = subprocess.run(["/usr/bin/python3", str(script), "5", *engine_like], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) == 5


def _state(pid: int) -> str:
    """/proc/PID/stat's state letter ('T': stopped)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def _until_state(pid: int, want: str, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _state(pid) == want:
            return True
        time.sleep(0.05)
    return False


@contextlib.contextmanager
def _held_by_a_frozen_daemon(tmp_path, llama_build, tiny_model, llama_env, env: dict | None = None):
    """A discovering daemon frozen (SIGSTOP: its BPF holds, it continues nothing) and a
    llama-completion held by it: (the daemon, the process, a function that starts a second
    daemon); both daemons ended afterwards. env: the first daemon's settings."""
    (tmp_path / "first").mkdir()
    (tmp_path / "second").mkdir()
    first = discovering_daemon(tmp_path / "first", env={**os.environ, **(env or {})})
    seconds: list[Daemon] = []

    def start_second() -> Daemon:
        seconds.append(discovering_daemon(tmp_path / "second", env={**os.environ, "PROFINFER_HOLD_STUCK_S": str(STUCK_S)}))
        return seconds[-1]

    try:
        os.kill(first.proc.pid, signal.SIGSTOP)
        proc = subprocess.Popen(completion_cmd(llama_build, tiny_model, n=8), env=llama_env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        _STARTED.append(proc)
        assert _until_state(proc.pid, "T", 30), "not held at its loader"
        yield first, proc, start_second
    finally:
        if first.proc.poll() is None:
            first.proc.kill()
            first.proc.wait()
        first.log.close()
        for second in seconds:
            second.stop()


def test_a_process_held_by_a_killed_daemon_is_continued_by_the_next(tmp_path, llama_build, tiny_model,
                                                                      llama_env):
    """A daemon killed (SIGKILL: as the kernel's OOM killer does) while it holds a process
    cannot continue it. The next daemon on the node does, from the node's pinned map of held
    processes; a process somebody else stopped stays stopped."""
    theirs = subprocess.Popen(["sleep", "120"])
    _STARTED.append(theirs)
    os.kill(theirs.pid, signal.SIGSTOP)
    with _held_by_a_frozen_daemon(tmp_path, llama_build, tiny_model, llama_env) as (first, proc, start_second):
        first.proc.kill()
        first.proc.wait()
        time.sleep(2)
        assert _state(proc.pid) == "T"      # nothing else continues it
        second = start_second()
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-2000:]
        assert {"prompt eval", "eval"} <= llama_perf(err).keys(), err[-2000:]
        assert f"PID {proc.pid}: held by a daemon gone" in second.text(), second.text()
        assert _state(theirs.pid) == "T", "a stop that was not discovery's was ended"


def _pinned_as_another_versions(pid: int) -> str:
    """The node's map of held processes made again as another version would have it (a
    longer entry, more of them), its entries kept, each with that version's extra bytes;
    `pid` must be among them. Where this version keeps it once it replaces it."""
    pin = f"{pinned.PIN_DIR}/{held.MAP_NAME}"
    fd = libbpf.pinned(pin)
    kind, key, value, entries = libbpf.map_shape(fd)
    other = libbpf.create_map(kind, held.MAP_NAME, key, value + 16, 2 * entries)
    try:
        copied = dict(libbpf.map_items(fd, key, value))
        assert pid.to_bytes(4, "little") in copied, "the process is not in the node's map"
        for k, v in copied.items():
            libbpf.map_update(other, k, v + b"\x5a" * 16)
        os.unlink(pin)
        libbpf.pin(other, pin)
        os.chmod(pin, 0o600)
        return f"{pin}{pinned.REPLACED}{libbpf.map_id(other)}"
    finally:
        os.close(fd)
        os.close(other)


@pytest.mark.parametrize("replaced_by", ["the daemon", "make_pins"])
def test_a_process_held_by_another_versions_killed_daemon_is_continued(tmp_path, llama_build, tiny_model,
                                                                     llama_env, replaced_by):
    """A daemon of another version (its map of held processes of another shape) killed while
    it holds a process: the next daemon, or the systemd unit's make_pins before it, replaces
    that map with this version's and keeps it pinned aside; the daemon continues the process
    from it."""
    with _held_by_a_frozen_daemon(tmp_path, llama_build, tiny_model, llama_env) as (first, proc, start_second):
        first.proc.kill()
        first.proc.wait()
        kept = _pinned_as_another_versions(proc.pid)
        try:
            if replaced_by == "make_pins":
                made = subprocess.run([sys.executable, "-m", "profinfer.core.ebpf.make_pins"], capture_output=True,
                                      text=True, timeout=60)
                assert made.returncode == 0 and f"kept as {kept}" in made.stderr, made.stderr
            second = start_second()
            _, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, err[-2000:]
            assert {"prompt eval", "eval"} <= llama_perf(err).keys(), err[-2000:]
            assert f"PID {proc.pid}: held by a daemon gone" in second.text(), second.text()
            assert kept in pinned.replaced_pins(held.MAP_NAME), "the other version's map was not kept"
        finally:            # nothing of the other version's left for the next test
            with contextlib.suppress(FileNotFoundError):
                os.unlink(kept)
            fd = libbpf.pinned(f"{pinned.PIN_DIR}/{held.MAP_NAME}")
            try:
                if libbpf.map_id(fd) == int(kept.rsplit("_", 1)[1]):
                    os.unlink(f"{pinned.PIN_DIR}/{held.MAP_NAME}")
            finally:
                os.close(fd)


def test_a_frozen_daemons_hold_is_ended_by_the_kernel(tmp_path, llama_build, tiny_model, llama_env):
    """A daemon stopped (SIGSTOP: as a cgroup freezer or a loop stuck holding the GIL, it
    continues nothing) while it holds a llama-completion, and no other daemon on the node:
    the kernel continues the process once it has been held HOLD_DEADLINE_S (a BPF timer
    armed at the stop), and it runs to its end; the daemon, thawed, says so. The timer's
    signal is refused where its CPU is idle (on this quiet VM, mostly): then the next switch
    away from a user task, on any CPU, sends it; this test's own wait (it looks at the process
    every 50 ms) is one, so the process runs on within a VM stall of the deadline. On a
    kernel without bpf_send_signal_task (before 6.13) the daemon said at its start that it
    cannot."""
    with _held_by_a_frozen_daemon(tmp_path, llama_build, tiny_model, llama_env) as (first, proc, _):
        held_at = time.monotonic()
        if not kernel.release_at_least(6, 13):
            assert "the kernel cannot end discovery's holds by itself" in first.text(), first.text()
            return
        assert "cannot end discovery's holds" not in first.text(), first.text()
        while _state(proc.pid) == "T" and time.monotonic() - held_at < HOLD_DEADLINE_S + 2:
            time.sleep(0.05)
        continued = time.monotonic() - held_at
        _, err = proc.communicate(timeout=60)
        waited = time.monotonic() - held_at
        assert proc.returncode == 0, err[-2000:]
        assert {"prompt eval", "eval"} <= llama_perf(err).keys(), err[-2000:]
        # held from before held_at (its stop seen first): ended at the deadline (a VM stall
        # of 2 s allowed), and the run took its own time after that
        assert HOLD_DEADLINE_S - 1 <= continued <= HOLD_DEADLINE_S + 2, (continued, waited)
        os.kill(first.proc.pid, signal.SIGCONT)
        status = json.loads(_get(first.url + "/status")[1])["discovery"]
        assert status["hold_deadline_s"] == HOLD_DEADLINE_S and status["ended_by_deadline"] == 1, status
        deadline = time.monotonic() + 10
        while "continued by the kernel's deadline" not in first.text() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "1 held process(es) continued by the kernel's deadline" in first.text(), first.text()


def test_where_the_hand_off_cannot_be_shared_nothing_is_held(tmp_path, llama_build, tiny_model, llama_env):
    """A daemon in a mount namespace of its own with no bpffs there (as a pod without the
    host's /sys/fs/bpf): it may not mount one (it would be its own alone), so a process it held
    could outlive it stopped, or be continued while a `record` holds it. It holds nothing and
    says so once; a process gated on its prompt is found and counted as llama.cpp counts
    itself, and a short run it meets is never stopped."""
    d = Daemon(tmp_path, prefix=("unshare", "--mount", "--propagation", "private", "sh", "-c",
                                 f'umount {pinned.BPFFS} 2>/dev/null; exec "$@"', "sh"))
    try:
        status = json.loads(_get(d.url + "/status")[1])
        assert status["discovery"]["holds"] is False, status["discovery"]
        assert d.text().count("discovery holds no process") == 1, d.text()
        w = Workload(llama_build, tiny_model, llama_env, tmp_path, n=16)
        d.watched(w.proc.pid, timeout=30)
        w.go()
        err = w.finish()
        perf = llama_perf(err)
        assert {"prompt eval", "eval"} <= perf.keys(), err[-2000:]
        deadline, got = time.monotonic() + 10, {}
        want = {"prefill": perf["prompt eval"][1], "decode": perf["eval"][1]}
        while time.monotonic() < deadline and got != want:
            got = series(_get(d.url + "/metrics")[1].decode(), "profinfer_tokens_total", w.proc.pid, "phase")
            time.sleep(0.2)
        assert got == want, d.text()
        short = subprocess.Popen([str(llama_build / "bin" / "llama-simple"), "-m", str(tiny_model), "-n", "8",
                                  "Once upon a time"], env=llama_env, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL)
        _STARTED.append(short)
        states = set()
        while short.poll() is None:
            with contextlib.suppress(OSError, IndexError):
                states.add(_state(short.pid))
            time.sleep(0.01)
        assert short.returncode == 0 and "T" not in states, states
        assert json.loads(_get(d.url + "/status")[1])["discovery"]["held"] == []
    finally:
        d.stop()
