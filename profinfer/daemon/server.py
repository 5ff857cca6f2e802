"""The daemon's HTTP endpoint: metrics for Prometheus (readable without a token), its
status, and on-demand traces (a bearer token: control endpoints can attach probes).

    GET  /metrics                     Prometheus text format
    GET  /healthz                     200 "ok" while the agent loop runs
    GET  /status                      JSON: what is watched, levels, cost, GPU metrics state
    POST /capture?pid=P&seconds=S&levels=L[&force=1]   a Perfetto trace of P for S seconds

A bad request is answered with an HTTP error and a JSON body {"error": ...}; the daemon
keeps running. Token text is never captured (no level records it).
"""
from __future__ import annotations

import hmac
import ipaddress
import json
import os
import secrets
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ..errors import ProfinferError
from ..probepack import KERNEL_LEVELS, LEVELS, RUNTIME_LEVELS

MAX_CAPTURE_S = 300
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
    """The control token: given, or read from token_file, made there (mode 0600) if absent."""
    if token:
        return token
    try:
        fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        st = os.stat(token_file)
        if st.st_mode & 0o077:
            raise ProfinferError(f"{token_file} is readable by others (mode {st.st_mode & 0o777:o}): "
                                 "chmod 600 it") from None
        with open(token_file) as f:
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
    """At most one capture per process at a time."""

    def __init__(self, agent, note):
        self.agent = agent
        self.note = note
        self.running: set[int] = set()
        self.lock = threading.Lock()

    def run(self, query: dict[str, list[str]]) -> bytes:
        from ..session import profile_process
        from ..exporters.perfetto import write_perfetto
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
        if pid not in self.agent.watches:
            raise BadRequest(404, f"PID {pid} is not an inference process this daemon watches")
        with self.lock:
            if pid in self.running:
                raise BadRequest(409, f"a capture of PID {pid} is already running")
            self.running.add(pid)
        try:
            warnings: list[str] = []
            try:
                prof = profile_process(pid, levels, duration=seconds, status=False,
                                       warn=warnings.append, note=lambda m: None)
            except ProfinferError as e:
                raise BadRequest(404 if not os.path.exists(f"/proc/{pid}") else 500, str(e)) from None
            if prof.meta.get("stopped_by", "").startswith("target exited"):
                raise BadRequest(410, f"PID {pid} exited during the capture")
            with tempfile.NamedTemporaryFile(suffix=".pftrace") as f:
                write_perfetto(prof, f.name)
                data = open(f.name, "rb").read()
            self.note(f"captured PID {pid} for {seconds:g} s at {','.join(sorted(levels))}: "
                      f"{len(data):,} bytes" + (f" ({'; '.join(warnings)})" if warnings else ""))
            return data
        finally:
            with self.lock:
                self.running.discard(pid)


def make_server(agent, host: str, port: int, token: str, note) -> ThreadingHTTPServer:
    captures = Captures(agent, note)

    class Handler(BaseHTTPRequestHandler):
        server_version = "profinfer"

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
            return got.startswith("Bearer ") and hmac.compare_digest(got[7:].strip(), token)

        def do_GET(self):
            url = urlparse(self.path)
            try:
                if url.path == "/metrics":
                    self._send(200, generate_latest(agent.metrics.registry), CONTENT_TYPE_LATEST)
                elif url.path == "/healthz":
                    stale = time.monotonic() - agent.last_loop > 30
                    self._send(503 if stale else 200, b"stalled\n" if stale else b"ok\n", "text/plain")
                elif url.path == "/status":
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
            if not self._authorized():
                self._json(401, {"error": "a bearer token is required (Authorization: Bearer <token>)"})
                return
            try:
                data = captures.run(parse_qs(url.query))
                self._send(200, data, "application/octet-stream")
            except BadRequest as e:
                self._json(e.status, {"error": str(e)})
            except Exception as e:
                self._json(500, {"error": f"{type(e).__name__}: {e}"})

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    return server
