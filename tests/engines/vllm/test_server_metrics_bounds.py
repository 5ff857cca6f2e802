"""vLLM's /metrics is asked for the report beside profinfer's own counts, on a port the
target's process tree listens on: a tenant's. A real listener here answers the first request
as vLLM's server would, then trickles every later answer a byte at a time (each byte within
the socket's timeout). The scrape ends by its deadline with nothing taken from the trickle,
and leaves no thread behind. Nor is any address asked that is not the node's own (a socket
bound with IP_FREEBIND to a TEST-NET address), nor a port of another network namespace (its
number names another listener here, which counts no request)."""
from __future__ import annotations

import subprocess
import sys
import threading
import time

from profinfer.engines.vllm import server_metrics

# serves on 127.0.0.1:PORT (argv[1], 0: any), prints its port, then counts requests on stderr;
# with "trickle": the first answer whole, vLLM's text; every later one a byte each 0.4 s
LISTENER = r'''
import socket, sys, threading, time
text = b"# TYPE vllm:prompt_tokens counter\nvllm:prompt_tokens_total 7.0\n"
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.setsockopt(socket.IPPROTO_IP, 15, 1)       # IP_FREEBIND: any address, the node's or not
s.bind((sys.argv[3], int(sys.argv[1]))); s.listen(64)
print(s.getsockname()[1], flush=True)
n = 0
def serve(c, first):
    c.recv(65536)
    head = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(text)
    if first or sys.argv[2] != "trickle":
        c.sendall(head + text)
    else:
        for b in head + text * 1000:
            c.sendall(bytes([b])); time.sleep(0.4)
    c.close()
while True:
    c, _ = s.accept(); n += 1
    print(n, file=sys.stderr, flush=True)
    threading.Thread(target=serve, args=(c, n == 1), daemon=True).start()
'''


def _listen(*prefix: str, port: int = 0, mode: str = "trickle", address: str = "0.0.0.0") -> tuple[subprocess.Popen, int]:
    p = subprocess.Popen([*prefix, sys.executable, "-c", LISTENER, str(port), mode, address], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    return p, int(p.stdout.readline())


def test_a_trickled_answer_is_cut_at_its_deadline_and_leaves_no_thread():
    tenant, port = _listen()
    try:
        threads = threading.active_count()
        t0 = time.monotonic()
        url = server_metrics.find(tenant.pid)            # the first answer, whole: vLLM's text
        assert url == f"http://127.0.0.1:{port}/metrics"
        assert time.monotonic() - t0 < server_metrics.FIND_S + 0.5
        window = []
        def begin() -> None:
            w = server_metrics.MetricsWindow(url)
            w.begin()
            window.append(w)
        start = threading.Thread(target=begin, daemon=True)
        t0 = time.monotonic()
        start.start()
        start.join(server_metrics.SCRAPE_S + server_metrics.TIMEOUT_S + 1)
        assert not start.is_alive(), "the scrape still reads the trickle"
        took = time.monotonic() - t0
        assert server_metrics.SCRAPE_S - 0.2 < took, took       # it was the trickle that ended it
        assert window[0].url is None and window[0].delta() == {}   # nothing of it taken
        deadline = time.monotonic() + 2
        while threading.active_count() > threads and time.monotonic() < deadline:
            time.sleep(0.05)
        assert threading.active_count() == threads
    finally:
        tenant.kill()
        tenant.wait()


def test_a_process_in_another_network_namespace_is_not_asked():
    host, port = _listen(mode="whole")      # a listener of the host's
    tenant, _ = _listen("unshare", "--net", port=port, mode="whole")   # the same port, its own namespace
    try:
        assert server_metrics.find(tenant.pid) is None
        assert server_metrics.find(host.pid) == f"http://127.0.0.1:{port}/metrics"    # asked, as a check
    finally:
        for p in (host, tenant):
            p.kill()
        asked = [int(x) for x in host.communicate()[1].split()]
        tenant.communicate()
    assert asked == [1], asked        # the host's listener: asked once, for itself alone


def test_an_address_not_the_nodes_is_not_asked():
    tenant, port = _listen(mode="whole", address="192.0.2.1")      # TEST-NET-1: no interface's
    try:
        assert server_metrics.endpoints([tenant.pid]) == []
        own, _ = _listen(mode="whole", address="127.0.0.1")
        try:
            assert server_metrics.endpoints([own.pid]) == [f"http://127.0.0.1:{_}/metrics"]
        finally:
            own.kill()
            own.wait()
    finally:
        tenant.kill()
        tenant.wait()
