"""The daemon's control plane against real processes: the capture subprocess isolated from the
daemon (a package planted in its directory or PYTHONPATH never runs, the token is not in its
environment), a target left stopped by a killed capture continued, the temporary directory
named when it cannot be made; the token given without the command line; TLS, and no token
sent in clear off loopback.

The target is a process the daemon watches as llama.cpp (it maps libllama) that loads and
unloads a small library in a loop: with the cuda level a capture follows it, and each of
those library-list changes stops it (SIGSTOP from BPF) until the capture lets it go. Each
fact is read from the kernel (/proc/PID/status, /proc/PID/environ, cwd, cmdline) or from a
socket the test holds."""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from profinfer.daemon.discovery.kernel import HOLD_MAX_S

from conftest import off_loopback_address
from daemon_helpers import _STARTED, PROFINFER, Daemon, _get, kill_started

ROOT = Path(__file__).resolve().parents[2]
SECRET = "control-test-token-0123456789abcdefghijkl"

# maps libllama (argv[1]), so the daemon watches it, then runs a short command again and again:
# a capture that follows it (cuda level) stops each child at its exec until it has looked
TARGET = r"""
import ctypes, subprocess, sys
ctypes.CDLL(sys.argv[1])
print("ready", flush=True)
while True:
    subprocess.run(["/bin/sleep", "0.02"], stdout=subprocess.DEVNULL)
"""


@pytest.fixture(autouse=True)
def _no_workload_left():
    yield
    kill_started()


def _state(pid: int) -> str:
    """/proc/PID/status's state letter ("gone" once it has exited and been reaped)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(line.split()[1] for line in f if line.startswith("State:"))
    except (FileNotFoundError, ProcessLookupError):     # reaped before, or while, it was read
        return "gone"


def _stays_stopped(pid: int, within: float = 2.0) -> bool:
    """Stopped within `within` s, and still stopped HOLD_MAX_S + 0.5 s later."""
    deadline = time.monotonic() + within
    while _state(pid) != "T":
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    until = time.monotonic() + HOLD_MAX_S + 0.5
    while time.monotonic() < until:
        if _state(pid) != "T":
            return False
        time.sleep(0.05)
    return True


def _target(llama_build, llama_env) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-I", "-c", TARGET, str(llama_build / "bin" / "libllama.so")],
                            env=llama_env, stdout=subprocess.PIPE, text=True)
    _STARTED.append(proc)
    assert proc.stdout.readline() == "ready\n"
    return proc


def _stopped_child(pid: int) -> int | None:
    """A child of pid held stopped (T) for longer than the daemon's discovery ever holds one."""
    for c in psutil.Process(pid).children():
        if _stays_stopped(c.pid, within=0.2):
            return c.pid
    return None


def _captures_of(daemon: Daemon) -> list[psutil.Process]:
    return [c for c in psutil.Process(daemon.proc.pid).children()
            if "attach" in c.cmdline()]


def _capture_async(daemon: Daemon, query: str, timeout: float = 120) -> tuple[threading.Thread, dict]:
    """The capture asked with force=1: the target (exec after exec: the daemon's discovery
    works for each) is over the budget at the floor; what is tested here is the capture."""
    results: dict = {}
    query += "&force=1"

    def run():
        try:
            results["r"] = _get(daemon.url + "/capture?" + query, daemon.token, method="POST", timeout=timeout)
        except OSError as e:         # the daemon went
            results["r"] = (None, str(e).encode())

    t = threading.Thread(target=run)
    t.start()
    return t, results


def _wait_capture(daemon: Daemon, timeout: float = 60) -> psutil.Process:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = _captures_of(daemon)
        if found:
            return found[0]
        time.sleep(0.05)
    raise AssertionError("no capture process started:\n" + daemon.text())


def test_the_capture_runs_isolated(tmp_path, llama_build, llama_env):
    """A `profinfer` package in the daemon's directory and on its PYTHONPATH is not what the
    capture runs; the capture's cwd is /, its environment holds neither the token nor
    PYTHONPATH, and its trace goes under the daemon's TMPDIR."""
    hostile = tmp_path / "hostile"
    (hostile / "profinfer").mkdir(parents=True)
    ran = tmp_path / "hostile-ran"
    (hostile / "profinfer" / "__init__.py").write_text(
        f"import sys\nopen({str(ran)!r}, 'a').write(repr(sys.argv) + '\\n')\nraise SystemExit(3)\n")
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    env = {**os.environ, "PYTHONPATH": str(hostile), "PROFINFER_TOKEN": SECRET, "TMPDIR": str(scratch)}
    # the daemon's own code from this checkout, whatever its directory holds
    command = [sys.executable, "-c", f"import sys; sys.path.insert(0, {str(ROOT)!r}); "
                                     "from profinfer.cli import main; main()"]
    d = Daemon(tmp_path, env=env, cwd=hostile, command=command)
    try:
        target = _target(llama_build, llama_env)
        d.watched(target.pid)
        t, results = _capture_async(d, f"pid={target.pid}&seconds=3&levels=token")
        child = _wait_capture(d)
        environ = Path(f"/proc/{child.pid}/environ").read_bytes()
        cwd, cmdline = os.readlink(f"/proc/{child.pid}/cwd"), child.cmdline()
        t.join(timeout=120)
        code, body = results["r"]
        assert not ran.exists(), ran.read_text()
        assert code == 200, body[:300]
        assert SECRET.encode() not in environ and b"PYTHONPATH=" not in environ
        assert cwd == "/"
        assert "-I" in cmdline[:2]
        out = cmdline[cmdline.index("-o") + 1]
        assert out.startswith(str(scratch) + "/"), cmdline
        assert not any(scratch.iterdir())          # removed once sent
    finally:
        d.stop()


def test_a_killed_capture_leaves_no_target_stopped(tmp_path, llama_build, llama_env):
    """The capture follows the target and its children (cuda level): frozen, it leaves the
    target's next child stopped at its exec; killed then, the daemon continues that child,
    and the next capture works. A process stopped before its capture began stays stopped."""
    d = Daemon(tmp_path)
    target = _target(llama_build, llama_env)
    bystander = _target(llama_build, llama_env)     # someone else's stop: kept
    held = None
    try:
        d.watched(target.pid)
        t, results = _capture_async(d, f"pid={target.pid}&seconds=60&levels=token,cuda")
        child = _wait_capture(d)
        # freeze the capture until a child of the target is held stopped by it (its follower
        # may not be set up yet at the first freeze: let it run a little and freeze it again)
        deadline = time.monotonic() + 60
        while held is None and time.monotonic() < deadline:
            child.send_signal(signal.SIGSTOP)
            end = time.monotonic() + 2
            while held is None and time.monotonic() < end:
                held = _stopped_child(target.pid)
            if held is None:
                child.send_signal(signal.SIGCONT)
                time.sleep(0.3)
        assert held is not None, "the capture never stopped the target's child"
        child.send_signal(signal.SIGKILL)
        t.join(timeout=60)
        deadline = time.monotonic() + 10
        while _state(held) == "T" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _state(held) != "T", d.text()
        code, body = results["r"]
        assert code == 500 and "killed (SIGKILL)" in json.loads(body)["error"], body
        # the next capture of it works
        code, body = _get(d.url + f"/capture?pid={target.pid}&seconds=1&levels=token&force=1", d.token,
                          method="POST", timeout=120)
        assert code == 200, body[:300]
        # a process stopped before its capture began stays stopped when that capture is killed
        d.watched(bystander.pid)
        for _ in range(5):     # the daemon's discovery continues what it held: stopped for good
            os.kill(bystander.pid, signal.SIGSTOP)
            if _stays_stopped(bystander.pid):
                break
        assert _state(bystander.pid) == "T"
        t, results = _capture_async(d, f"pid={bystander.pid}&seconds=60&levels=token,cuda")
        child = _wait_capture(d)
        time.sleep(1.0)
        child.send_signal(signal.SIGKILL)
        t.join(timeout=60)
        assert results["r"][0] == 500
        assert _state(bystander.pid) == "T" and _stopped_child(target.pid) is None
        assert _get(d.url + "/healthz")[0] == 200
    finally:
        for p in (target.pid, bystander.pid, held):
            if p and _state(p) != "gone":
                os.kill(p, signal.SIGCONT)
        d.stop()


def test_a_capture_ends_with_the_daemon(tmp_path, llama_build, llama_env):
    """The daemon killed (SIGKILL: no clean-up of its own) during a 60 s capture: the capture
    is told (its parent-death signal) and ends at once, leaving none of the target's tree
    stopped, rather than running on for its minute as an orphan."""
    d = Daemon(tmp_path)
    target = _target(llama_build, llama_env)
    child = None
    try:
        d.watched(target.pid)
        t, results = _capture_async(d, f"pid={target.pid}&seconds=60&levels=token,cuda")
        child = _wait_capture(d)
        time.sleep(2.0)                    # attached and following
        d.proc.kill()
        d.proc.wait(timeout=30)
        gone, _ = psutil.wait_procs([child], timeout=20)
        assert gone, f"the capture runs on after its daemon died: {child.cmdline()}"
        t.join(timeout=30)
        time.sleep(0.5)
        assert _stopped_child(target.pid) is None and _state(target.pid) != "T"
    finally:
        if child is not None and child.is_running():
            child.kill()
        if d.proc.poll() is None:
            d.proc.kill()
        d.log.close()


def test_an_unwritable_temp_dir_is_named_in_one_line(tmp_path, llama_build, llama_env):
    missing = tmp_path / "no-such-dir"
    d = Daemon(tmp_path, env={**os.environ, "TMPDIR": str(missing)})
    try:
        target = _target(llama_build, llama_env)
        d.watched(target.pid)
        code, body = _get(d.url + f"/capture?pid={target.pid}&seconds=1&levels=token&force=1", d.token,
                          method="POST", timeout=120)
        error = json.loads(body)["error"]
        assert code == 503 and str(missing) in error and "\n" not in error, body
        assert "Traceback" not in d.text() and _get(d.url + "/healthz")[0] == 200
    finally:
        d.stop()


def _self_signed(tmp_path: Path, address: str) -> tuple[Path, Path]:
    assert shutil.which("openssl"), "openssl is installed by setup.sh"
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key),
                    "-out", str(cert), "-days", "1", "-subj", "/CN=profinfer-test",
                    "-addext", f"subjectAltName=IP:{address}"], check=True, capture_output=True)
    return cert, key


def _cli(args: list[str], token: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PROFINFER_TOKEN"}
    if token:
        env["PROFINFER_TOKEN"] = token
    return subprocess.run(PROFINFER + args, capture_output=True, text=True, timeout=120, env=env)


def _one_error_line(r: subprocess.CompletedProcess) -> str:
    lines = r.stderr.strip().splitlines()
    assert r.returncode != 0 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    return lines[0]


def test_token_from_the_environment_and_a_warning_for_the_command_line(tmp_path):
    env = {**os.environ, "PROFINFER_TOKEN": SECRET}
    d = Daemon(tmp_path, env=env)
    try:
        assert not d.token_file.exists()
        # the environment's token is the token: a capture of no watched process is a 404, not a 401
        assert _get(d.url + "/capture?pid=999999999", SECRET, method="POST")[0] == 404
        assert _get(d.url + "/capture?pid=999999999", "wrong", method="POST")[0] == 401
        assert "--token" not in d.text()
    finally:
        d.stop()
    (tmp_path / "cmdline").mkdir()
    d = Daemon(tmp_path / "cmdline", extra=("--token", SECRET))
    try:
        assert _get(d.url + "/capture?pid=999999999", SECRET, method="POST")[0] == 404
        warned = [l for l in d.text().splitlines() if "--token" in l and "/proc/PID/cmdline" in l]
        assert len(warned) == 1 and "PROFINFER_TOKEN" in warned[0], d.text()
    finally:
        d.stop()


def test_status_and_capture_over_tls(tmp_path, llama_build, llama_env):
    """A daemon serving HTTPS beyond loopback: status and capture with the CA given work
    (the token sent); without it, one line says the certificate is not trusted."""
    address = off_loopback_address()
    cert, key = _self_signed(tmp_path, address)
    d = Daemon(tmp_path, listen=address, url=f"https://{address}",
               extra=("--allow-remote", "--tls-cert", str(cert), "--tls-key", str(key)))
    try:
        target = _target(llama_build, llama_env)
        d.watched(target.pid)
        common = ["--url", d.url, "--token-file", str(d.token_file)]
        r = _cli(["status", *common, "--cacert", str(cert)])
        assert r.returncode == 0 and f"PID {target.pid:>7}" in r.stdout, r.stderr
        trace = tmp_path / "t.pftrace"
        r = _cli(["capture", "-p", str(target.pid), "--seconds", "1", "--levels", "token", "-o", str(trace),
                  "--force", *common, "--cacert", str(cert)])
        assert r.returncode == 0 and trace.stat().st_size > 0, r.stderr
        for command in (["status"], ["capture", "-p", str(target.pid), "-o", str(tmp_path / "u.pftrace")]):
            line = _one_error_line(_cli([*command, *common]))
            assert "certificate" in line and "--cacert" in line, line
        # plain HTTP to it: no answer, the daemon serves on
        assert _get(d.url + "/healthz", context=d.context)[0] == 200
    finally:
        d.stop()


def test_no_token_in_clear_beyond_loopback(tmp_path):
    """status and capture to a plain http:// URL beyond loopback refuse in one line, and the
    listener there receives nothing: no connection, no token."""
    address = off_loopback_address()
    listener = socket.socket()
    listener.bind((address, 0))
    listener.listen(8)
    listener.settimeout(0.2)
    url = f"http://{address}:{listener.getsockname()[1]}"
    received = []
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            conn.settimeout(5)
            try:
                received.append(conn.recv(65536))
            except OSError:
                received.append(b"")
            conn.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        for command in (["status"], ["capture", "-p", "1", "--seconds", "1", "-o", str(tmp_path / "x")]):
            line = _one_error_line(_cli([*command, "--url", url], token=SECRET))
            assert "plain HTTP" in line and "--insecure-http" in line, line
        time.sleep(0.5)
        assert received == []
    finally:
        stop.set()
        t.join(timeout=5)
        listener.close()
