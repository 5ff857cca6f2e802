"""The daemon's HTTP endpoint: metrics for Prometheus (readable without a token), its
status, and on-demand traces (a bearer token: control endpoints can attach probes).

    GET  /metrics                     Prometheus text format
    GET  /healthz                     200 "ok" while the agent loop runs
    GET  /status                      JSON: what is watched, levels, cost, GPU metrics state
    POST /capture?pid=P&seconds=S&levels=L   a Perfetto trace of P for S seconds

A bad request is answered with an HTTP error and a JSON body {"error": ...}; the daemon
keeps running. Token text is never captured (no level records it).
"""
from __future__ import annotations

import hmac
import ipaddress
import json
import os
import secrets
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ..errors import ProfinferError
from ..probepack import KERNEL_LEVELS, LEVELS, RUNTIME_LEVELS

MAX_CAPTURE_S = 300
MAX_CAPTURES = 2             # at once (each is a full attach: its own CPU and memory)
REQUEST_TIMEOUT_S = 10
CAPTURE_LEVELS = set(LEVELS) | {"step"} | set(KERNEL_LEVELS) | set(RUNTIME_LEVELS)


class BadRequest(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return host == "localhost"
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def parse_listen(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ProfinferError(f"--listen {value!r}: expected HOST:PORT (e.g. 127.0.0.1:9464)")
    return host.strip("[]"), int(port)


def load_token(token: str | None, token_file: str) -> str:
    """The control token: given, or read from token_file, made there (mode 0600) if absent.
    An existing file must be a regular file of ours, readable by nobody else (opened without
    following a link, checked on the open file)."""
    if token:
        return token
    try:
        fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        try:
            fd = os.open(token_file, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError as e:
            raise ProfinferError(f"cannot open the token file {token_file}: {e.strerror}") from None
        with os.fdopen(fd) as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                raise ProfinferError(f"{token_file} is not a regular file of this user's") from None
            if st.st_mode & 0o077:
                raise ProfinferError(f"{token_file} is readable by others (mode {st.st_mode & 0o777:o}): "
                                     "chmod 600 it") from None
            value = f.read().strip()
        if not value:
            raise ProfinferError(f"{token_file} is empty") from None
        return value
    except OSError as e:
        raise ProfinferError(f"cannot make the token file {token_file}: {e.strerror}") from None
    value = secrets.token_urlsafe(32)
    with os.fdopen(fd, "w") as f:
        f.write(value + "\n")
    return value


class Captures:
    """At most one capture per process, MAX_CAPTURES at once; each runs as a process of its
    own (`profinfer attach --duration`), so that its memory, its CPU and its failures are not
    the daemon's, and the trace comes back as the file it wrote."""

    def __init__(self, agent, note):
        self.agent = agent
        self.note = note
        self.running: set[int] = set()
        self.lock = threading.Lock()

    def run(self, query: dict[str, list[str]]) -> bytes:
        try:
            pid = int(query["pid"][0])
            seconds = float(query.get("seconds", ["10"])[0])
        except (KeyError, ValueError, IndexError):
            raise BadRequest(400, "pid (an integer) and seconds (a number) are required") from None
        if not 0 < seconds <= MAX_CAPTURE_S:
            raise BadRequest(400, f"seconds must be in (0, {MAX_CAPTURE_S}]")
        levels = {v.strip() for v in query.get("levels", ["token,graph,op"])[0].split(",") if v.strip()}
        bad = levels - CAPTURE_LEVELS
        if bad or not levels:
            raise BadRequest(400, f"unknown level(s) {', '.join(sorted(bad)) or '(none)'}; "
                                  f"choose from {','.join(sorted(CAPTURE_LEVELS))}")
        with self.agent.lock:
            watched = pid in self.agent.watches
        if not watched:
            raise BadRequest(404, f"PID {pid} is not an inference process this daemon watches")
        with self.lock:
            if pid in self.running:
                raise BadRequest(409, f"a capture of PID {pid} is already running")
            if len(self.running) >= MAX_CAPTURES:
                raise BadRequest(429, f"{MAX_CAPTURES} captures are running; try again later")
            self.running.add(pid)
        try:
            with tempfile.TemporaryDirectory(prefix="profinfer-capture-") as tmp:
                trace, summary = os.path.join(tmp, "t.pftrace"), os.path.join(tmp, "s.json")
                cmd = [sys.executable, "-m", "profinfer.cli", "attach", "--pid", str(pid), "--levels",
                       ",".join(sorted(levels)), "--duration", f"{seconds:g}", "--quiet",
                       "-o", trace, "--json", summary]
                try:
                    done = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 300)
                except subprocess.TimeoutExpired:
                    raise BadRequest(504, f"the capture of PID {pid} did not end") from None
                if done.returncode != 0 or not os.path.exists(trace):
                    gone = not os.path.exists(f"/proc/{pid}")
                    last = (done.stderr.strip().splitlines() or ["failed"])[-1]
                    raise BadRequest(410 if gone else 500,
                                     f"PID {pid} exited during the capture" if gone else last)
                with open(summary) as f:
                    stopped = json.load(f).get("meta", {}).get("stopped_by", "")
                if stopped.startswith("target exited"):
                    raise BadRequest(410, f"PID {pid} exited during the capture")
                with open(trace, "rb") as f:
                    data = f.read()
            self.note(f"captured PID {pid} for {seconds:g} s at {','.join(sorted(levels))}: {len(data):,} bytes")
            return data
        finally:
            with self.lock:
                self.running.discard(pid)


def make_server(agent, host: str, port: int, token: str, note) -> ThreadingHTTPServer:
    captures = Captures(agent, note)
    secret = token.encode("utf-8", "surrogateescape")
    local = is_loopback(host)

    class Handler(BaseHTTPRequestHandler):
        server_version = "profinfer"
        timeout = REQUEST_TIMEOUT_S      # an idle connection does not hold a thread for ever

        def log_message(self, fmt, *args):     # requests are not logged (scrapes every few s)
            pass

        def _send(self, status: int, body: bytes, ctype: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _json(self, status: int, obj) -> None:
            self._send(status, (json.dumps(obj, indent=1) + "\n").encode(), "application/json")

        def _authorized(self) -> bool:
            got = self.headers.get("Authorization", "")
            return got.startswith("Bearer ") and hmac.compare_digest(
                got[7:].strip().encode("utf-8", "surrogateescape"), secret)

        def do_GET(self):
            url = urlparse(self.path)
            try:
                if url.path == "/metrics":
                    self._send(200, generate_latest(agent.metrics.registry), CONTENT_TYPE_LATEST)
                elif url.path == "/healthz":
                    stale = time.monotonic() - agent.last_loop > 30
                    self._send(503 if stale else 200, b"stalled\n" if stale else b"ok\n", "text/plain")
                elif url.path == "/status":
                    if not local and not self._authorized():   # paths, pods: not for the cluster
                        self._json(401, {"error": "a bearer token is required off loopback"})
                    else:
                        self._json(200, agent.status())
                else:
                    self._json(404, {"error": f"no such endpoint: {url.path}"})
            except Exception as e:          # the daemon keeps serving
                self._json(500, {"error": f"{type(e).__name__}: {e}"})

        def do_POST(self):
            url = urlparse(self.path)
            if url.path != "/capture":
                self._json(404, {"error": f"no such endpoint: {url.path}"})
                return
            try:
                if not self._authorized():
                    self._json(401, {"error": "a bearer token is required (Authorization: Bearer <token>)"})
                    return
                data = captures.run(parse_qs(url.query))
                self._send(200, data, "application/octet-stream")
            except BadRequest as e:
                self._json(e.status, {"error": str(e)})
            except Exception as e:
                self._json(500, {"error": f"{type(e).__name__}: {e}"})

    server_class = _Server6 if ":" in host else ThreadingHTTPServer
    server = server_class((host, port), Handler)
    server.daemon_threads = True
    return server


class _Server6(ThreadingHTTPServer):
    address_family = socket.AF_INET6
