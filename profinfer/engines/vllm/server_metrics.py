"""vLLM's own request-level numbers, where its OpenAI server's /metrics endpoint is reachable:
scraped when profiling starts and when it ends, so the report can set the server's account of
the same stretch beside profinfer's. Nothing profinfer records depends on it.

The endpoint is found before the probes go in: every listening port of the process tree is
asked at once, and one that is no HTTP server (torch's, ZeroMQ's) holds the request until its
timeout, a second each, while the probes' records would pile up unread (bench/results.md).

The port is the process's to choose and may be a tenant's: a scrape ends by a deadline of its
own however its answer trickles in (its socket is shut then, so that no thread outlives it),
at most MAX_SCRAPES run at once, and only ports of a process in our own network namespace, on
an address of one of its interfaces, are asked (another namespace's port number names some
other listener here; a socket bound with IP_FREEBIND, any address at all)."""
from __future__ import annotations

import http.client
import os
import queue
import socket
import threading
import time
from urllib.parse import urlsplit

import psutil
from prometheus_client.parser import text_string_to_metric_families

TIMEOUT_S = 1.0        # each socket operation of one scrape
SCRAPE_S = 2.0         # one scrape, in all
FIND_S = 2.0           # looking for the endpoint among every listening port, in all
MAX_BYTES = 16 << 20   # of one answer read
MAX_PORTS = 16         # asked, at most (a thread each)
MAX_SCRAPES = 32       # under way at once, in all: a scrape past them is not made
_SCRAPES = threading.BoundedSemaphore(MAX_SCRAPES)
# counters, and histograms as (count, sum), summed over their label sets (engines, models)
COUNTERS = ("vllm:prompt_tokens", "vllm:generation_tokens")
HISTOGRAMS = ("vllm:iteration_tokens_total", "vllm:time_to_first_token_seconds",
              "vllm:inter_token_latency_seconds", "vllm:e2e_request_latency_seconds")


def _same_network(pid: int) -> bool:
    try:
        return os.stat(f"/proc/{pid}/ns/net").st_ino == os.stat("/proc/self/ns/net").st_ino
    except OSError:
        return False


def _own_addresses() -> set[str]:
    """The addresses of this network namespace's interfaces."""
    return {a.address.split("%")[0] for addrs in psutil.net_if_addrs().values() for a in addrs
            if a.family in (socket.AF_INET, socket.AF_INET6)}


def endpoints(pids: list[int]) -> list[str]:
    """/metrics URLs of the TCP ports the processes listen on (loopback for a wildcard), of
    those in our network namespace, on an address of its own (a socket bound with
    IP_FREEBIND may name any host's)."""
    urls, own = [], None
    for pid in pids:
        if not _same_network(pid):
            continue
        try:
            conns = psutil.Process(pid).net_connections(kind="tcp")
        except psutil.Error:
            continue
        for c in conns:
            if c.status != psutil.CONN_LISTEN:
                continue
            host = c.laddr.ip
            host = "127.0.0.1" if host in ("0.0.0.0", "") else ("::1" if host == "::" else host)
            own = _own_addresses() if own is None else own
            if host not in own:
                continue
            host = f"[{host}]" if ":" in host else host
            urls.append(f"http://{host}:{c.laddr.port}/metrics")
    return urls


def fetch(url: str, within_s: float = SCRAPE_S) -> bytes | None:
    """GET url's body, at most MAX_BYTES, or None: refused, not 200, or not all in by
    within_s (the socket is shut then, so this returns however the answer trickles)."""
    if not _SCRAPES.acquire(blocking=False):
        return None
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=TIMEOUT_S)
    cut = threading.Event()

    def shut() -> None:
        cut.set()
        sock = conn.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
    timer = threading.Timer(within_s, shut)
    timer.daemon = True
    timer.start()
    try:
        conn.connect()              # at most TIMEOUT_S: its socket is not there to shut before
        if cut.is_set():
            return None
        conn.request("GET", parts.path or "/")
        r = conn.getresponse()
        if r.status != 200:
            return None
        body = bytearray()
        while len(body) < MAX_BYTES and (chunk := r.read1(1 << 16)):
            body += chunk
        return None if cut.is_set() else bytes(body[:MAX_BYTES])
    except (OSError, ValueError, http.client.HTTPException):
        return None
    finally:
        timer.cancel()
        conn.close()
        _SCRAPES.release()


def scrape(url: str, within_s: float = SCRAPE_S) -> dict[str, float] | None:
    """The metrics profinfer sets beside its own, or None (not vLLM's, unreachable, too slow,
    or not what it claims: whatever a tenant's port answers is read, never trusted)."""
    body = fetch(url, within_s)
    if body is None:
        return None
    text = body.decode("utf-8", "replace")
    if "vllm:" not in text:
        return None
    out: dict[str, float] = {}
    try:
        families = list(text_string_to_metric_families(text))
    except Exception:           # the parser's errors on text it cannot read are of many kinds
        return None
    for family in families:
        for sample in family.samples:
            name = sample.name
            if family.name in COUNTERS and name == family.name + "_total":
                out[family.name] = out.get(family.name, 0.0) + sample.value
            elif any(name == h + "_count" or name == h + "_sum" for h in HISTOGRAMS):
                out[name] = out.get(name, 0.0) + sample.value
    return out


def find(pid: int) -> str | None:
    """The /metrics URL of vLLM's server among the process's and its descendants' listening
    ports, all asked at once, or None. At most FIND_S: each ask ends by then (fetch)."""
    try:
        tree = [pid] + [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return None
    urls = list(dict.fromkeys(endpoints(tree)))[:MAX_PORTS]
    answers: queue.Queue = queue.Queue()
    for url in urls:
        threading.Thread(target=lambda u=url: answers.put((u, scrape(u, FIND_S))), daemon=True).start()
    deadline = time.monotonic() + FIND_S
    for _ in urls:
        try:
            url, values = answers.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            return None
        if values is not None:
            return url
    return None


class MetricsWindow:
    """The server's counts over the recording: a scrape as it begins and one at its end."""

    def __init__(self, url: str | None):
        self.url, self.start = url, None

    def begin(self) -> None:
        self.start = scrape(self.url) if self.url else None
        if self.start is None:
            self.url = None

    def delta(self) -> dict[str, float]:
        if self.url is None or self.start is None:
            return {}
        end = scrape(self.url)
        if end is None:
            return {}
        return {k: end[k] - self.start.get(k, 0.0) for k in end}
