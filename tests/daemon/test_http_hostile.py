"""The daemon's HTTP endpoint against clients that try to crowd out the kubelet's probe or
fill the log, and the clients (`profinfer status`, `capture`) against a listener that is not
the daemon. The real daemon serves; what it holds is read from the kernel (/proc/PID/fd),
what a client sent from a socket the test holds."""
from __future__ import annotations

import os
import socket
import threading
import time

import pytest

from daemon_helpers import Daemon, _get, kill_started
from conftest import off_loopback_address
from test_control import SECRET, _cli, _one_error_line, _self_signed, _target


@pytest.fixture(autouse=True)
def _no_workload_left():
    yield
    kill_started()


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _closed(s: socket.socket) -> bool:
    """Whether the daemon closed it (end of file or a reset); False while it is open."""
    s.setblocking(False)
    try:
        s.recv(65536)                     # its close (b""), or an answer before it
        return True
    except BlockingIOError:
        return False
    except OSError:
        return True


def test_one_peer_filling_the_cap_does_not_close_another_peers_request(tmp_path):
    """The probe's connection (another peer address), its request under way, survives a
    client on loopback opening four times the cap: that client loses its own connections."""
    address = off_loopback_address()
    d = Daemon(tmp_path, extra=("--allow-remote", "--max-connections", "16"), listen="0.0.0.0")
    try:
        probe = socket.create_connection((address, d.port), timeout=10)
        probe.sendall(b"GET /healthz HTTP/1.1\r\n")          # the rest comes after the crowd
        time.sleep(0.5)
        crowd = [socket.create_connection(("127.0.0.1", d.port), timeout=5) for _ in range(64)]
        time.sleep(1)
        assert sum(not _closed(s) for s in crowd) <= 16
        probe.setblocking(True)
        probe.sendall(f"Host: {address}\r\n\r\n".encode())
        answer = probe.recv(65536)
        assert answer.startswith(b"HTTP/1.1 200"), answer
        for s in crowd:
            s.close()
        probe.close()
        assert d.proc.poll() is None
    finally:
        d.stop()


def test_half_open_tls_handshakes_are_counted(tmp_path):
    """With TLS, 100 connections that never start their handshake: the daemon holds no more
    descriptors than its cap allows (counted at accept, not after the handshake), and a real
    client is answered."""
    cert, key = _self_signed(tmp_path, "127.0.0.1")
    d = Daemon(tmp_path, url="https://127.0.0.1",
               extra=("--tls-cert", str(cert), "--tls-key", str(key), "--max-connections", "16"))
    try:
        before = _fds(d.proc.pid)
        idle = [socket.create_connection(("127.0.0.1", d.port), timeout=5) for _ in range(100)]
        time.sleep(2)                     # accepted by now (the handshake deadline is 10 s)
        held = _fds(d.proc.pid) - before
        assert held <= 16 + 2, held
        assert _get(d.url + "/healthz", context=d.context, timeout=10)[0] == 200
        for s in idle:
            s.close()
    finally:
        d.stop()


def test_unparsable_requests_get_an_answer_not_a_traceback(tmp_path):
    """A target urlsplit cannot parse gets 400; a body cut short is closed; the daemon logs
    no traceback for either and serves on."""
    d = Daemon(tmp_path)
    try:
        with socket.create_connection(("127.0.0.1", d.port), timeout=10) as s:
            s.sendall(b"GET http://[::1 HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            assert s.recv(65536).startswith(b"HTTP/1.1 400"), "no 400"
        with socket.create_connection(("127.0.0.1", d.port), timeout=10) as s:
            s.sendall(b"POST /capture HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100\r\n\r\nabc")
            s.shutdown(socket.SHUT_WR)
            assert s.recv(65536) == b""                   # closed, nothing to say
        assert _get(d.url + "/healthz")[0] == 200
        time.sleep(0.5)
        log = d.text()
        assert "Traceback" not in log and "exception" not in log.lower(), log[-3000:]
    finally:
        d.stop()


class Listener:
    """A loopback listener that is not the daemon: records each request's bytes, answers
    `answer`."""

    def __init__(self, answer: bytes, host: str = "127.0.0.1"):
        self.sock = socket.create_server((host, 0))
        self.sock.settimeout(0.2)
        self.url = f"http://{host}:{self.sock.getsockname()[1]}"
        self.answer, self.received, self.stop = answer, [], threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            conn.settimeout(5)
            data = b""
            try:
                while b"\r\n\r\n" not in data and (chunk := conn.recv(65536)):
                    data += chunk
                self.received.append(data)
                conn.sendall(self.answer)
            except OSError:
                pass
            conn.close()

    def close(self):
        self.stop.set()
        self.thread.join(5)
        self.sock.close()


def test_status_sends_no_token_to_loopback(tmp_path):
    """Whoever listens on loopback's port (a user's listener while the daemon restarts) gets
    no token from `profinfer status`, whether the token comes from the environment or a file."""
    body = b'{"error": "not the daemon"}'
    fake = Listener(b"HTTP/1.1 401 Unauthorized\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    token_file = tmp_path / "token"
    token_file.write_text(SECRET)
    try:
        for token in (SECRET, None):
            r = _cli(["status", "--url", fake.url, "--token-file", str(token_file)], token=token)
            assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
        assert len(fake.received) == 2, fake.received
        assert not any(b"authorization" in req.lower() or SECRET.encode() in req for req in fake.received), fake.received
    finally:
        fake.close()


def test_a_redirect_is_not_followed(tmp_path):
    """A daemon URL that redirects elsewhere (plain HTTP off loopback): one line, and the
    other end gets nothing, so the token never crosses in clear. A URL with a user part
    (which host is it?) is refused in one line, before any connection."""
    far = Listener(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}", host=off_loopback_address())
    near = Listener(f"HTTP/1.1 302 Found\r\nLocation: {far.url}/capture\r\nContent-Length: 0\r\n\r\n".encode())
    try:
        line = _one_error_line(_cli(["capture", "-p", "1", "--seconds", "1", "-o", str(tmp_path / "x"),
                                     "--url", near.url], token=SECRET))
        assert "redirect" in line, line
        assert len(near.received) == 1 and far.received == [], (near.received, far.received)
        port = near.url.rsplit(":", 1)[1]
        line = _one_error_line(_cli(["capture", "-p", "1", "-o", str(tmp_path / "x"),
                                     "--url", f"http://a%40{far.url[7:]}@127.0.0.1:{port}"], token=SECRET))
        assert "user" in line, line
        assert len(near.received) == 1 and far.received == []
    finally:
        near.close()
        far.close()


def test_a_trace_over_the_cap_is_refused_in_one_line(tmp_path, llama_build, llama_env):
    """A trace bigger than the daemon sends back (the cap set low here) is answered 507 with
    one line saying to capture less; the daemon serves on, the slot freed."""
    env = {**os.environ, "PROFINFER_TOKEN": SECRET, "PROFINFER_MAX_TRACE_BYTES": "1000"}
    d = Daemon(tmp_path, env=env)
    try:
        target = _target(llama_build, llama_env)
        d.watched(target.pid)
        line = _one_error_line(_cli(["capture", "-p", str(target.pid), "--seconds", "1", "--levels", "token",
                                     "-o", str(tmp_path / "t.pftrace"), "--url", d.url], token=SECRET))
        assert "507" in line and "fewer seconds" in line, line
        assert not (tmp_path / "t.pftrace").exists()
        assert _get(d.url + "/healthz")[0] == 200 and d.proc.poll() is None
    finally:
        d.stop()
