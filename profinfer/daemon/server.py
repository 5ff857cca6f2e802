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
import socket
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ..errors import ProfinferError
from .captures import BadRequest, Captures
from .tls import handshake, wrap_accepted

REQUEST_TIMEOUT_S = 10


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


def make_server(agent, host: str, port: int, token: str, note, tls=None) -> ThreadingHTTPServer:
    """tls: an ssl.SSLContext to serve HTTPS with (tls.server_context)."""
    captures = Captures(agent, note)
    secret = token.encode("utf-8", "surrogateescape")
    local = is_loopback(host)

    class Handler(BaseHTTPRequestHandler):
        server_version = "profinfer"
        timeout = REQUEST_TIMEOUT_S      # an idle connection does not hold a thread for ever

        def handle(self):
            if handshake(self.connection):       # TLS: in this thread, under its timeout
                super().handle()

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
                with captures.slot(parse_qs(url.query)) as capture:    # freed once the trace is sent
                    self._send(200, capture(), "application/octet-stream")
            except BadRequest as e:
                self._json(e.status, {"error": str(e)})
            except Exception as e:
                self._json(500, {"error": f"{type(e).__name__}: {e}"})

    server_class = _Server6 if ":" in host else ThreadingHTTPServer
    server = server_class((host, port), Handler)
    server.daemon_threads = True
    if tls is not None:
        wrap_accepted(server, tls)
    return server


class _Server6(ThreadingHTTPServer):
    address_family = socket.AF_INET6
