"""vLLM's own request-level numbers, where its OpenAI server's /metrics endpoint is reachable:
scraped when profiling starts and when it ends, so the report can set the server's account of
the same stretch beside profinfer's. Nothing profinfer records depends on it.

The endpoint is found before the probes go in: every listening port of the process tree is
asked at once, and one that is no HTTP server (torch's, ZeroMQ's) holds the request until its
timeout, a second each, while the probes' records would pile up unread (bench/results.md)."""
from __future__ import annotations

import http.client
import queue
import threading
import time
import urllib.request

import psutil
from prometheus_client.parser import text_string_to_metric_families

TIMEOUT_S = 1.0        # each socket operation of one scrape
FIND_S = 2.0           # looking for the endpoint among every listening port, in all
MAX_BYTES = 16 << 20   # of one answer read
MAX_PORTS = 64         # asked, at most (a thread each)
# counters, and histograms as (count, sum), summed over their label sets (engines, models)
COUNTERS = ("vllm:prompt_tokens", "vllm:generation_tokens")
HISTOGRAMS = ("vllm:iteration_tokens_total", "vllm:time_to_first_token_seconds",
              "vllm:inter_token_latency_seconds", "vllm:e2e_request_latency_seconds")


def endpoints(pids: list[int]) -> list[str]:
    """/metrics URLs of the TCP ports the processes listen on (loopback for a wildcard)."""
    urls = []
    for pid in pids:
        try:
            conns = psutil.Process(pid).net_connections(kind="tcp")
        except psutil.Error:
            continue
        for c in conns:
            if c.status == psutil.CONN_LISTEN:
                host = c.laddr.ip
                host = "127.0.0.1" if host in ("0.0.0.0", "") else ("::1" if host == "::" else host)
                host = f"[{host}]" if ":" in host else host
                urls.append(f"http://{host}:{c.laddr.port}/metrics")
    return urls


def scrape(url: str) -> dict[str, float] | None:
    """The metrics profinfer sets beside its own, or None (not vLLM's, unreachable, or not
    what it claims: whatever a tenant's port answers is read, never trusted)."""
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as r:
            text = r.read(MAX_BYTES).decode("utf-8", "replace")
    except (OSError, ValueError, http.client.HTTPException):
        return None
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
    ports, all asked at once, or None. At most FIND_S: a port that keeps its request longer
    (one that trickles bytes keeps it for ever) is given up, its thread left to end alone."""
    try:
        tree = [pid] + [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return None
    urls = list(dict.fromkeys(endpoints(tree)))[:MAX_PORTS]
    answers: queue.Queue = queue.Queue()
    for url in urls:
        threading.Thread(target=lambda u=url: answers.put((u, scrape(u))), daemon=True).start()
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
    """The server's counts over the recording: a scrape at its start and one at its end."""

    def __init__(self, url: str | None):
        self.url, self.start = url, scrape(url) if url else None
        if self.start is None:
            self.url = None

    def delta(self) -> dict[str, float]:
        if self.url is None:
            return {}
        end = scrape(self.url)
        if end is None:
            return {}
        return {k: end[k] - self.start.get(k, 0.0) for k in end}
