"""The daemon's HTTP endpoint against hostile clients, the real daemon serving: slow clients
(a byte every few seconds) are closed by the request deadline while others are served; the
connection cap holds with no thread per connection; a Host header that is not the daemon's
(DNS rebinding) is refused; /status needs the token from a peer off loopback, whatever the
address listened on; paths leave /metrics when asked; the governor charges the watched
processes with the CPU of the thread that watches, not of the others (HTTP's). And the whole: a 2-minute slowloris plus a /metrics
flood while a llama-server serves requests, its tokens counted exactly (its own timings),
/healthz 200 throughout, the daemon's memory under the manifest's limit."""
from __future__ import annotations

import concurrent.futures
import http.client
import json
import os
import re
import select
import socket
import threading
import time
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from conftest import Target, endless_cmd, llama_server, off_loopback_address
from daemon_helpers import MANIFEST, Daemon, _get, kill_started, series

# the daemon's request deadline here (PROFINFER_REQUEST_DEADLINE_S; 10 s by default, the soak
# tier's): what it promises
DEADLINE_S = 4


@pytest.fixture(autouse=True)
def _no_workload_left():
    yield
    kill_started()


@pytest.fixture
def daemon(tmp_path):
    d = Daemon(tmp_path, env={**os.environ, "PROFINFER_REQUEST_DEADLINE_S": str(DEADLINE_S)})
    yield d
    print(d.text()[-3000:])        # shown with a failure
    d.stop()


def _raw(port: int, request: bytes, host: str = "127.0.0.1", timeout: float = 30) -> tuple[int, bytes]:
    """One request as bytes, its answer's status and body."""
    with socket.create_connection((host, port), timeout=timeout) as s:
        s.sendall(request)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


def _dropped(text: str) -> dict[str, float]:
    return {m.group(1): float(m.group(2)) for m in
            re.finditer(r'^profinfer_http_connections_dropped_total\{reason="(\w+)"\} (\S+)$', text, re.M)}


def _threads(pid: int) -> int:
    return int(re.search(r"Threads:\s*(\d+)", Path(f"/proc/{pid}/status").read_text()).group(1))


def _rss_kib(pid: int) -> int:
    return int(re.search(r"VmRSS:\s*(\d+)", Path(f"/proc/{pid}/status").read_text()).group(1))


class Slowloris:
    """n connections each sending a request's head one byte every `every_s` seconds (never
    whole), reopened as the daemon closes them when `reopen`; when each was closed (by the
    daemon: end of file, a reset, or its 408 answer)."""

    HEAD = b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n" + b"X-Slow: " + b"a" * 4000

    def __init__(self, port: int, n: int, every_s: float, reopen: bool = False):
        self.port, self.n, self.every_s, self.reopen = port, n, every_s, reopen
        self.lived: list[float] = []          # seconds each closed connection was open
        self.refused = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _open(self):
        try:
            s = socket.create_connection(("127.0.0.1", self.port), timeout=5)
            s.setblocking(False)
            return [s, time.monotonic(), 0]
        except OSError:
            self.refused += 1
            return None

    def _run(self) -> None:
        conns = [c for c in (self._open() for _ in range(self.n)) if c]
        while conns and not self.stop.is_set():
            for c in list(conns):
                s, opened, sent = c
                closed = False
                readable, _, _ = select.select([s], [], [], 0)
                if readable:                   # the daemon's 408, or its close
                    try:
                        s.recv(65536)
                    except OSError:
                        pass
                    closed = True
                else:
                    try:
                        s.send(self.HEAD[sent % len(self.HEAD):][:1])
                        c[2] += 1
                    except OSError:
                        closed = True
                if closed:
                    self.lived.append(time.monotonic() - opened)
                    s.close()
                    conns.remove(c)
                    if self.reopen and (new := self._open()):
                        conns.append(new)
            self.stop.wait(self.every_s)
        for s, *_ in conns:
            s.close()
        self.left_open = len(conns)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(60)


class Flood:
    """`threads` clients asking /metrics back to back (loopback), each on a new connection."""

    def __init__(self, url: str, threads: int = 2):
        self.stop = threading.Event()
        self.answers: dict[int, int] = {}
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._run, args=(url,), daemon=True) for _ in range(threads)]
        for t in self.threads:
            t.start()

    def _run(self, url: str) -> None:
        while not self.stop.is_set():
            try:
                code = _get(url + "/metrics", timeout=30)[0]
            except OSError:
                code = 0
            with self.lock:
                self.answers[code] = self.answers.get(code, 0) + 1

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(60)


class HealthPoller:
    """/healthz asked each `every_s`: every answer's status (0: no answer within 10 s), from
    the address `source` (the kubelet's probe comes from the node's, not the attacker's)."""

    def __init__(self, url: str, every_s: float = 1.0, source: str | None = None):
        self.codes: list[int] = []
        self.stop = threading.Event()

        def ask() -> int:
            if source is None:
                return _get(url + "/healthz", timeout=10)[0]
            conn = http.client.HTTPConnection(urlsplit(url).netloc, timeout=10, source_address=(source, 0))
            try:
                conn.request("GET", "/healthz")
                return conn.getresponse().status
            finally:
                conn.close()

        def run():
            while not self.stop.is_set():
                try:
                    self.codes.append(ask())
                except (OSError, http.client.HTTPException):
                    self.codes.append(0)
                self.stop.wait(every_s)
        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def close(self) -> list[int]:
        self.stop.set()
        self.thread.join(30)
        return self.codes


def test_slow_clients_are_closed_by_the_deadline_and_hold_no_one_up(daemon):
    """40 clients each sending a request head one byte a second (each byte would reset a
    per-read timeout, never a deadline for the whole request): each is closed by the
    deadline, and meanwhile other clients are answered."""
    slow = Slowloris(daemon.port, 40, every_s=1.0)
    health = HealthPoller(daemon.url, every_s=0.5)
    try:
        # a bound for the machine (a 2-core VM shared with others), not a speed test: a
        # client still open after 4 times the deadline is held
        slow.thread.join(4 * DEADLINE_S + 20)
    finally:
        slow.close()
        codes = health.close()
    assert slow.left_open == 0 and len(slow.lived) == 40, f"{slow.left_open} slow clients still open"
    assert min(slow.lived) >= DEADLINE_S - 1, sorted(slow.lived)   # not closed before their time
    assert codes and set(codes) == {200}, codes
    assert _dropped(_get(daemon.url + "/metrics")[1].decode()).get("deadline", 0) >= 40
    assert daemon.proc.poll() is None


def test_connections_over_the_cap_are_closed_at_once_and_counted(tmp_path):
    d = Daemon(tmp_path, extra=("--max-connections", "16"))
    try:
        threads_before = _threads(d.proc.pid)
        idle = [socket.create_connection(("127.0.0.1", d.port), timeout=5) for _ in range(200)]
        # the daemon keeps at most 16: each new one over the cap closes the oldest idle one
        time.sleep(2)
        open_now = 0
        for s in idle:
            s.setblocking(False)
            try:
                s.recv(1)                      # b"": closed by the daemon
            except BlockingIOError:            # nothing to read, not closed: still open
                open_now += 1
            except OSError:                    # reset: closed by the daemon
                pass
        assert open_now <= 16, open_now
        # no thread per connection
        assert _threads(d.proc.pid) <= threads_before + 2, (threads_before, _threads(d.proc.pid))
        # the cap full of idle clients, a real one is answered (it closes the oldest idle one)
        assert _get(d.url + "/healthz", timeout=10)[0] == 200
        dropped = _dropped(_get(d.url + "/metrics", timeout=10)[1].decode())
        assert dropped.get("evicted", 0) >= 200 - 16, dropped
        for s in idle:
            s.close()
    finally:
        d.stop()


def test_a_host_that_is_not_the_daemons_is_refused(tmp_path):
    """A browser on the node, on a page whose name the attacker rebinds to 127.0.0.1, sends
    that name as Host: refused, with a JSON error; the daemon's own names are answered."""
    d = Daemon(tmp_path, extra=("--allow-host", "profinfer.monitoring.svc"))
    try:
        for path in ("/metrics", "/status", "/healthz"):
            code, body = _raw(d.port, f"GET {path} HTTP/1.1\r\nHost: rebind.attacker.example:{d.port}\r\n\r\n".encode())
            assert code == 421 and "error" in json.loads(body), (path, code, body[:200])
        for host in (f"127.0.0.1:{d.port}", f"localhost:{d.port}", "localhost", f"[::1]:{d.port}",
                     f"{socket.gethostname()}:{d.port}", f"profinfer.monitoring.svc:{d.port}"):
            code, body = _raw(d.port, f"GET /status HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
            assert code == 200 and "processes" in json.loads(body), (host, code, body[:200])
        assert d.proc.poll() is None
    finally:
        d.stop()


def test_status_is_decided_by_the_peer_not_the_address_listened_on(tmp_path):
    """Listening on every address: a client on loopback reads /status without the token,
    one from this machine's other address (its peer address not loopback) needs it."""
    address = off_loopback_address()
    d = Daemon(tmp_path, extra=("--allow-remote",), listen="0.0.0.0")
    try:
        assert _get(d.url + "/status")[0] == 200
        code, body = _get(f"http://{address}:{d.port}/status")
        assert code == 401 and "token" in json.loads(body)["error"], (code, body)
        code, body = _get(f"http://{address}:{d.port}/status", d.token)
        assert code == 200 and "processes" in json.loads(body)
        assert _get(f"http://{address}:{d.port}/metrics")[0] == 200     # metrics: no token
    finally:
        d.stop()


def test_path_labels_leave_metrics_when_asked(tmp_path, llama_build, tiny_model, llama_env):
    """A watched llama.cpp process: with every label, its executable's and model's paths
    are in /metrics (where they are read from: /proc); with --labels no-paths neither is, its
    pod and command labels stay; with minimal only engine and pid are left."""
    w = Target(endless_cmd(llama_build, tiny_model), llama_env)       # its model mapped
    exe = os.readlink(f"/proc/{w.proc.pid}/exe")
    deadline = time.monotonic() + 60
    while str(tiny_model) not in Path(f"/proc/{w.proc.pid}/maps").read_text():
        assert time.monotonic() < deadline and w.alive(), "the model never mapped"
        time.sleep(0.2)
    seen = {}
    for labels in ("full", "no-paths", "minimal"):
        (tmp_path / labels).mkdir()
        d = Daemon(tmp_path / labels, extra=("--labels", labels))
        try:
            d.watched(w.proc.pid)
            deadline = time.monotonic() + 30     # the model file is found within its recheck
            while time.monotonic() < deadline:
                text = _get(d.url + "/metrics")[1].decode()
                info = [l for l in text.splitlines()
                        if l.startswith("profinfer_process_info{") and f'pid="{w.proc.pid}"' in l]
                if info and (labels != "full" or str(tiny_model) in info[0]):
                    break
                time.sleep(0.5)
            seen[labels] = (text, info[0])
        finally:
            d.stop()
    w.stop()
    full, line = seen["full"]
    assert exe in line and str(tiny_model) in line and 'comm="' in line, line
    for labels in ("no-paths", "minimal"):
        text, line = seen[labels]
        assert exe not in text and str(tiny_model) not in text and "exe=" not in text, labels
    assert 'comm="' in seen["no-paths"][1] and 'pod="' in seen["no-paths"][1]
    minimal = [l for l in seen["minimal"][0].splitlines() if f'pid="{w.proc.pid}"' in l]
    assert minimal and all(set(re.findall(r'(\w+)="', l.split("{", 1)[1].rsplit("}", 1)[0]))
                           <= {"engine", "pid", "phase", "le", "backend", "op"} for l in minimal), minimal[:5]


def _complete(url: str, i: int) -> dict:
    prompt = " ".join(["alpha", "beta", "gamma", "delta"][(i + j) % 4] for j in range(6 + 5 * (i % 7)))
    body = json.dumps({"prompt": prompt, "n_predict": 16, "ignore_eos": True, "cache_prompt": False}).encode()
    req = urllib.request.Request(f"{url}/completion", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.load(r)


def _manifest_memory_limit() -> int:
    ds = next(x for x in yaml.safe_load_all(MANIFEST.read_text()) if x and x["kind"] == "DaemonSet")
    (c,) = ds["spec"]["template"]["spec"]["containers"]
    q = c["resources"]["limits"]["memory"]
    m = re.fullmatch(r"(\d+)(Ki|Mi|Gi)", q)
    return int(m.group(1)) * {"Ki": 1, "Mi": 1024, "Gi": 1024 ** 2}[m.group(2)]     # KiB


SLOWLORIS_S = 7      # past the request deadline (DEADLINE_S): every slow client closed once at least


def test_llama_server_counted_exactly_under_slowloris_and_a_metrics_flood(daemon, llama_build, tiny_model, llama_env):
    """SLOWLORIS_S of 100 slow clients (tests/soak: two minutes) while a llama-server answers
    requests (counted_under_slowloris)."""
    counted_under_slowloris(daemon, llama_build, tiny_model, llama_env, SLOWLORIS_S)


def counted_under_slowloris(daemon, llama_build, tiny_model, llama_env, seconds: float) -> None:
    """`seconds` of 100 slow clients (a byte every 3 s each, reopened as they are closed)
    and two threads asking /metrics back to back, all from loopback, while a llama-server
    answers requests: its tokens counted as its own per-request timings count them, /healthz
    (from another loopback address: the kubelet's probe) 200 throughout, the daemon's memory
    under the manifest's limit."""
    limit_kib = _manifest_memory_limit()
    with llama_server(llama_build, tiny_model, llama_env, 2, ctx_per_slot=512) as (proc, url):

        def tokens() -> dict[str, int]:
            text = _get(daemon.url + "/metrics")[1].decode()
            return {k: int(v) for k, v in series(text, "profinfer_tokens_total", proc.pid, "phase").items()}

        daemon.watched(proc.pid)              # its probes attached: each request is seen
        time.sleep(2)
        before = tokens()

        threads_before = _threads(daemon.proc.pid)
        slow = Slowloris(daemon.port, 100, every_s=3.0, reopen=True)
        flood = Flood(daemon.url, threads=2)
        # the attack and the flood from 127.0.0.1, the probe from another loopback address:
        # the attacker's own connections are what it loses over its peer's share
        health = HealthPoller(daemon.url, every_s=1.0, source="127.0.0.2")
        rss, threads, replies, end = [], [], [], time.monotonic() + seconds
        try:
            def client(k: int) -> None:
                i = k
                while time.monotonic() < end:
                    replies.append(_complete(url, i))
                    i += 2
                    rss.append(_rss_kib(daemon.proc.pid))
                    threads.append(_threads(daemon.proc.pid))
            with concurrent.futures.ThreadPoolExecutor(2) as pool:
                for f in [pool.submit(client, k) for k in range(2)]:
                    f.result()
        finally:
            slow.close()
            flood.close()
            codes = health.close()
        rss.append(_rss_kib(daemon.proc.pid))
        want = {"prefill": before.get("prefill", 0) + sum(r["timings"]["prompt_n"] for r in replies),
                "decode": before.get("decode", 0) + sum(r["timings"]["predicted_n"] - 1 for r in replies)}
        deadline, got = time.monotonic() + 30, {}
        while time.monotonic() < deadline:
            got = tokens()
            if got == want:
                break
            time.sleep(0.5)
        text = _get(daemon.url + "/metrics")[1].decode()
        assert got == want, (len(replies), daemon.text()[-3000:])
        assert sum(series(text, "profinfer_events_lost_total", proc.pid, None).values()) == 0
        assert codes and set(codes) == {200}, codes
        assert max(rss) < limit_kib, (max(rss), limit_kib)
        # a hundred slow clients and the flood cost no thread each
        assert max(threads) <= threads_before + 2, (threads_before, max(threads))
        # the attack happened: slow clients were cut off by the deadline, scrapes answered
        assert len(slow.lived) >= 100 and flood.answers.get(200, 0) > 100, (len(slow.lived), flood.answers)
        assert len(replies) >= 4
        print(f"{len(replies)} requests, {want}, {len(slow.lived)} slow clients closed (open for "
              f"{min(slow.lived):.1f}-{max(slow.lived):.1f} s), {flood.answers} scrapes, /healthz "
              f"{len(codes)}x 200, daemon RSS max {max(rss)} KiB, threads {threads_before}-{max(threads)}")
