"""The daemon's HTTP endpoints, and who may read what: metrics for Prometheus (readable
without a token), its status (without a token from a loopback peer only), and on-demand
traces (a bearer token always: control endpoints can attach probes).

    GET  /metrics                     Prometheus text format
    GET  /healthz                     200 "ok" while the agent loop runs
    GET  /status                      JSON: what is watched, levels, cost, GPU metrics state
    POST /capture?pid=P&seconds=S&levels=L   a Perfetto trace of P for S seconds (429 where
                                      it would take P over the budget, unless &force=1)
    GET  /captures                    JSON: the flight recorder's kept captures, and why each
    GET  /captures/ID                 one kept capture's Perfetto trace

A request whose Host header names neither an IP address, nor localhost, nor this machine,
nor a name given with --allow-host is refused (421): a web page whose own name an attacker
rebinds to this machine's address (DNS rebinding) reads nothing through a browser on it.

A bad request is answered with an HTTP error and a JSON body {"error": ...}; the daemon
keeps running. Token text is never captured (no level records it). How a hostile client is
kept from holding the endpoint: httpserve.py.
"""
from __future__ import annotations

import hmac
import ipaddress
import json
import socket
import threading
import time

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from profinfer.core.base.waits import REQUEST_DEADLINE_S, STALL_S
from profinfer.core.base.errors import ProfinferError
from profinfer.daemon.flight.captures import MAX_CAPTURES, BadRequest, Captures
from profinfer.daemon.http.listener import BoundedHTTPServer, Lane, Request, Response

SEND_DEADLINE_S = 30         # for an answer to be taken (plus a second per SEND_RATE bytes)
MAX_CONNECTIONS = 256
METRICS_MAX_AGE_S = 1.0      # a /metrics body serves every scrape within this: a flood costs one
QUICK_WORKERS = 2            # /metrics, /status (each quick; the cache makes them so)
HTTP_CPU_SHARE = 0.1         # of a CPU, for the server's loop: a flood slows answers, not the agent
LOOPBACK_NAMES = {"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"}


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


class HostCheck:
    """Which Host headers are this daemon's. Any IP address is (a rebinding needs a name: a
    page at an address is that address's own origin), as are localhost's names, this
    machine's hostname, the name it listens on, and the allowed names (".example.com": that
    domain's names)."""

    def __init__(self, listen_host: str, allowed: tuple[str, ...] = ()):
        names = {n.lower().rstrip(".") for n in (*LOOPBACK_NAMES, socket.gethostname(), listen_host, *allowed)}
        self.exact = {n for n in names if n and not n.startswith(".")}
        self.suffixes = tuple(n for n in names if n.startswith("."))

    def accepts(self, value: str | None) -> bool:
        if value is None:          # HTTP/1.0 without one: no browser sends that
            return True
        value = value.strip().lower()
        if value.startswith("["):                  # [v6]:port
            host = value[1:].split("]", 1)[0]
        else:
            host, sep, port = value.rpartition(":")
            if not sep or not port.isdigit():
                host = value
        host = host.rstrip(".")
        try:
            ipaddress.ip_address(host)
            return True
        except ValueError:
            pass
        return host in self.exact or (bool(host) and host.endswith(self.suffixes))


class MetricsBody:
    """/metrics' body, made at most once per METRICS_MAX_AGE_S: scrapes arriving meanwhile,
    or while it is being made, get that one (the agent loop shares the interpreter with this:
    a flood of scrapes must not be a flood of generations)."""

    def __init__(self, registry, max_age_s: float = METRICS_MAX_AGE_S):
        self.registry = registry
        self.max_age_s = max_age_s
        self.lock = threading.Lock()
        self.body, self.made = b"", -max_age_s

    def get(self) -> bytes:
        with self.lock:
            if time.monotonic() - self.made >= self.max_age_s:
                self.body = generate_latest(self.registry)
                self.made = time.monotonic()
            return self.body


def _json(status: int, obj) -> Response:
    return Response(status, (json.dumps(obj, indent=1) + "\n").encode(), "application/json")


def make_server(agent, host: str, port: int, token: str, note, allow_hosts: tuple[str, ...] = (),
                max_connections: int = MAX_CONNECTIONS, ssl_context=None,
                captures: Captures | None = None) -> BoundedHTTPServer:
    captures = captures or Captures(agent, note)
    secret = token.encode("utf-8", "surrogateescape")
    hosts = HostCheck(host, allow_hosts)
    metrics = MetricsBody(agent.metrics.registry)

    def authorized(req: Request) -> bool:
        got = req.headers.get("Authorization", "")
        return got.startswith("Bearer ") and hmac.compare_digest(
            got[7:].strip().encode("utf-8", "surrogateescape"), secret)

    def healthz() -> Response:
        stale = time.monotonic() - agent.last_loop > STALL_S
        return Response(503 if stale else 200, b"stalled\n" if stale else b"ok\n")

    def capture(req: Request) -> Response:
        """The trace, its slot held until the answer is sent (or fails): MAX_CAPTURES also
        bounds the traces held in memory while slow clients read them."""
        held = captures.slot(req.query, req.peer)
        try:
            run = held.__enter__()
        except BadRequest as e:
            return _json(e.status, {"error": str(e)})
        try:
            return Response(200, run(), "application/octet-stream",
                            after_send=lambda: held.__exit__(None, None, None))
        except BadRequest as e:
            held.__exit__(None, None, None)
            return _json(e.status, {"error": str(e)})
        except BaseException:
            held.__exit__(None, None, None)
            raise

    # kept traces being sent at once: each is held in memory until its reader has it all
    sending = threading.BoundedSemaphore(MAX_CAPTURES)

    def kept(cid: str | None) -> Response:
        recorder = getattr(agent, "recorder", None)
        if recorder is None:
            return _json(404, {"error": "no flight recorder: the daemon was started without --trigger"})
        if cid is None:
            return _json(200, {"captures": recorder.store.list()})
        if not sending.acquire(blocking=False):
            return _json(429, {"error": f"{MAX_CAPTURES} kept captures are being sent; try again later"})
        try:
            trace = recorder.store.trace(cid)
        except BaseException:
            sending.release()
            raise
        if trace is None:
            sending.release()
            return _json(404, {"error": f"no kept capture {cid!r}"})
        return Response(200, trace, "application/octet-stream", after_send=sending.release)

    def route(req: Request):
        """Cheap decisions here (the server's loop); the work on a lane's workers."""
        if not hosts.accepts(req.headers.get("Host")):
            return _json(421, {"error": f"Host {req.headers.get('Host')!r} is not this daemon's name "
                                        "(DNS rebinding?); --allow-host admits a name"})
        if req.method == "GET" and req.path == "/metrics":
            return "quick", lambda: Response(200, metrics.get(), CONTENT_TYPE_LATEST)
        if req.method == "GET" and req.path == "/healthz":
            return healthz()          # O(1), on the loop: no worker, no throttle between it and the probe
        if req.method == "GET" and req.path == "/status":
            # paths, pods: not for the cluster. Who asks decides, not where the daemon listens
            if not is_loopback(req.peer) and not authorized(req):
                return _json(401, {"error": "a bearer token is required from a peer other than loopback"})
            return "quick", lambda: _json(200, agent.status())
        if req.method == "POST" and req.path == "/capture":
            if not authorized(req):
                return _json(401, {"error": "a bearer token is required (Authorization: Bearer <token>)"})
            return "capture", lambda: capture(req)
        if req.path == "/captures" or req.path.startswith("/captures/"):
            if req.method != "GET":
                return _json(405, {"error": f"{req.method} is not for {req.path}"})
            if not authorized(req):
                return _json(401, {"error": "a bearer token is required (Authorization: Bearer <token>)"})
            return "quick", lambda: kept(req.path[len("/captures/"):] if req.path != "/captures" else None)
        if req.path in ("/metrics", "/healthz", "/status", "/capture"):
            return _json(405, {"error": f"{req.method} is not for {req.path}"})
        return _json(404, {"error": f"no such endpoint: {req.path}"})

    # captures: lanes of their own, as many as may run at once (a 429 beyond is theirs)
    lanes = {"quick": Lane(workers=QUICK_WORKERS, waiting=max_connections),
             "capture": Lane(workers=MAX_CAPTURES, waiting=0)}
    return BoundedHTTPServer(host, port, route, lanes, max_connections=max_connections,
                             request_deadline_s=REQUEST_DEADLINE_S, send_deadline_s=SEND_DEADLINE_S,
                             dropped=agent.metrics.http_dropped, ssl_context=ssl_context,
                             cpu_share=HTTP_CPU_SHARE)
