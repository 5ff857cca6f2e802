"""The flight recorder against a real slowdown: a llama-server under steady concurrent load,
watched by the daemon with a TPOT trigger; midway, CPU-bound competitors take its CPUs. One
capture is made, its firing within the hold time plus its window of the competitors' start, with a
baseline from before them; the capture's sched view names them as what preempted the
server's threads (five minutes of steady load: tests/soak); the capture's HTML page shows what
fired, the trigger's series around the moment and the changes against the baseline, each
number the summary's; and the prompt's text is nowhere in the capture, its record, the
metrics or the daemon's log."""
from __future__ import annotations

import http.client
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from urllib.parse import urlsplit

import numpy as np

from conftest import PROFINFER, llama_server
from daemon_helpers import Daemon, OtlpReceiver, _get
from test_html_report import report, shown_page

HOLD_S = 3
# the trigger's window and baseline window, and how long the load runs before the slowdown: a
# first baseline spans its whole window (less a bin), before the condition's own window, taken
# again each half window (flight/triggers.py): whole 12 s in, 3 s before the slowdown; the capture's
# baseline, 3 intervals of the daemon's count samples and more
WINDOW_S = 4
BASELINE_S = 8
BASELINE_LOAD_S = 15
SAMPLED = {**os.environ, "PROFINFER_BASELINE_SAMPLE_S": "1"}

FACTOR = 1.8
RECORD_S = 4
HOG_COMM = "cpu-hog"
PROMPT_MARKER = "Quillfeather-Zanzibar"      # in every prompt: found nowhere profinfer writes
# a busy loop named HOG_COMM (its comm: what a switch record names as the preempter)
HOG = ("import ctypes\nctypes.CDLL(None).prctl(15, b'" + HOG_COMM + "', 0, 0, 0)\nwhile True:\n    pass\n")


class SteadyLoad:
    """`clients` threads, each asking the server for completions one after another, streamed:
    when each token arrived at the client, an outside view of the server's per-token times."""

    def __init__(self, url: str, clients: int = 2, cache_prompt: bool = True):
        self.address, self.stop, self.cache_prompt = urlsplit(url).netloc, threading.Event(), cache_prompt
        self.threads = [threading.Thread(target=self._client, daemon=True) for _ in range(clients)]
        self.done = 0
        self.tpots: list[tuple[float, float]] = []   # (when it ended, the server's own ms a token)
        self.gaps: list[tuple[float, float]] = []    # (when a token arrived, s since its request's last)
        self.ttfts: list[tuple[float, float]] = []   # (when a first token arrived, s since the request)

    def _client(self) -> None:
        body = json.dumps({"prompt": f"Once upon a time {PROMPT_MARKER} was", "n_predict": 48,
                           "cache_prompt": self.cache_prompt, "stream": True})
        while not self.stop.is_set():
            try:
                self._complete(body)
                self.done += 1
            except (OSError, http.client.HTTPException, ValueError):
                time.sleep(0.1)

    def _complete(self, body: str) -> None:
        conn = http.client.HTTPConnection(self.address, timeout=120)
        try:
            sent = last = time.monotonic()
            conn.request("POST", "/completion", body, {"Content-Type": "application/json"})
            first = True
            for line in conn.getresponse():
                if not line.startswith(b"data: "):
                    continue
                now, event = time.monotonic(), json.loads(line[6:])
                if event.get("stop"):
                    self.tpots.append((now, float(event["timings"]["predicted_per_token_ms"])))
                    return
                (self.ttfts if first else self.gaps).append((now, now - (sent if first else last)))
                first, last = False, now
        finally:
            conn.close()

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join(timeout=130)

    def saw(self, fired: dict) -> float:
        """What the client saw of a firing's statistic, as the trigger's value over its limit
        (its limit over its value for a rate's '<'): over each window the daemon judged while the
        condition held, the same percentile of the client's token gaps (tpot; call: a decode
        call is within its sequences' token gap; tps: a rate, the inverse of the gaps against
        the client's own baseline), or its slowest first token (ttft)."""
        at, hold, window = fired["fired_monotonic_s"], fired["hold_s"], fired["window_s"]
        pct = float(fired["stat"][1:])
        q = 100 - pct if fired["below"] else pct
        if fired["quantity"] == "ttft":
            return max((s for t, s in self.ttfts if at - hold - window <= t <= at), default=0.0) / fired["limit"]

        def gap_stat(end: float) -> float:
            newest = [s for t, s in self.gaps if end - window < t <= end][-500:]
            return float(np.percentile(newest, q)) if len(newest) >= 20 else 0.0
        worst = max(gap_stat(at - hold + k * 0.5) for k in range(int(hold / 0.5) + 1))
        if fired["quantity"] in ("tpot", "call"):
            return worst / fired["limit"]
        until = fired["baseline_until_monotonic_s"]
        base = [s for t, s in self.gaps if until - fired["baseline_window_s"] <= t <= until]
        # the trigger's limit over its baseline, against the client's gaps' own ratio
        return (worst / float(np.percentile(base, q))) / (fired["baseline"] / fired["limit"])


def kept(d: Daemon) -> list[dict]:
    return json.loads(_get(d.url + "/captures", d.token)[1])["captures"]


def test_a_real_slowdown_fires_one_capture_that_names_its_cause(tmp_path, llama_build, tiny_model, llama_env):
    store = tmp_path / "captures"
    receiver = OtlpReceiver()
    with llama_server(llama_build, tiny_model, llama_env, 2) as (server, url):
        d = Daemon(tmp_path, ("--levels", "token,graph", "--budget", "0.25", "--trigger", f"tpot_p99 > {FACTOR}x baseline for {HOLD_S}s",
                              "--trigger-baseline", f"{BASELINE_S}s", "--trigger-window", f"{WINDOW_S}s",
                              "--record-for", f"{RECORD_S}s", "--keep", "3",
                              "--captures-dir", str(store), "--capture-levels", "sched", "--otlp", receiver.url),
                   env=SAMPLED)
        hogs = []
        try:
            d.watched(server.pid)
            with SteadyLoad(url) as load:
                time.sleep(BASELINE_LOAD_S)     # the baseline: steady load
                assert kept(d) == [], d.text()
                cpus = sorted(os.sched_getaffinity(server.pid))
                started = time.monotonic()
                # two competitors a CPU the server may use, at its own priority
                hogs = [subprocess.Popen([sys.executable, "-c", HOG], preexec_fn=lambda c=c: os.sched_setaffinity(0, {c}))
                        for c in cpus for _ in range(2)]
                deadline = time.monotonic() + HOLD_S + RECORD_S + 60
                while time.monotonic() < deadline and not kept(d):
                    time.sleep(0.5)
                time.sleep(3)           # the slowdown goes on: no second capture of one incident
                caps = kept(d)
                got = _get(d.url + f"/captures/{caps[0]['id']}", d.token) if caps else None
                refused = _get(d.url + "/captures", None)[0]
                metrics = _get(d.url + "/metrics")[1]
                slow_until = time.monotonic()
        finally:
            for h in hogs:
                h.kill()
                h.wait()
            d.stop()                # its OTLP export flushed
            receiver.close()
    log = (tmp_path / "daemon.log").read_text()
    assert len(caps) == 1, (caps, log)
    cap = caps[0]
    fired = cap["fired"]
    assert fired["reason"] == "tpot_p99" and cap["pid"] == server.pid
    # after the hold, and within the hold plus the trigger's window of the slowdown's start (a
    # window whose samples are all the slowdown's has its p99 above the limit; a 2 s bound in
    # its place failed once in a clean CI run, at 2.14 s: bench/results.md)
    assert started + HOLD_S <= fired["fired_monotonic_s"] <= started + HOLD_S + WINDOW_S, (fired, started)
    assert fired["value"] > fired["limit"] == FACTOR * fired["baseline"] and fired["unit"] == "s"
    # its baseline: samples from before the slowdown
    assert fired["baseline_until_monotonic_s"] <= started, (fired, started)
    assert "sched" in cap["levels"] and cap["left_out"] == {}
    # the firing went out as an OTLP event, with the process's attributes and the trigger's
    events = receiver.events("profinfer.capture")
    assert len(events) == 1, events
    attrs = {kv.key: getattr(kv.value, kv.value.WhichOneof("value")) for kv in events[0].attributes}
    assert attrs["profinfer.capture.id"] == cap["id"] and attrs["process.pid"] == server.pid, attrs
    assert attrs["profinfer.trigger"] == fired["trigger"] and attrs["profinfer.trigger.value"] == fired["value"]
    assert receiver.events("profinfer.capture.failed") == []
    # the capture's sched view: the server's threads were preempted, by the competitors most
    assert refused == 401                   # the list needs the token
    assert got[0] == 200 and got[1] == (store / f"{cap['id']}.pftrace").read_bytes()
    trace = tmp_path / "slow.pftrace"
    trace.write_bytes(got[1])
    summary, page = report(trace, tmp_path)
    # redaction: no level records token text
    marker = PROMPT_MARKER.encode()
    for what, data in (("trace", got[1]), ("record", (store / f"{cap['id']}.json").read_bytes()),
                       ("metrics", metrics), ("log", log.encode()),
                       ("otlp", b"".join(req.SerializeToString() for _, req in receiver.requests)),
                       ("report", (tmp_path / "s.json").read_bytes()), ("page", page.read_bytes())):
        assert marker not in data and marker.lower() not in data.lower(), what
    sched = summary["sched"]
    busiest = max(sched["threads"], key=lambda t: t["on_cpu_ns"])
    assert busiest["preempted_ns"] > 0 and busiest["preempted_by"][0]["comm"] == HOG_COMM, busiest
    # the trace alone: what fired it, and the incident up to the firing against the baseline
    # before it (the daemon's own counts, not the capture's): the server's graph computes took
    # longer a compute than in any of the baseline's intervals, as its own timings say its
    # tokens did
    flight = summary["flight"]
    assert flight["fired"]["trigger"] == cap["fired"]["trigger"] and flight["levels"] == cap["levels"]
    assert flight["baseline"]["until_monotonic_s"] <= started and flight["baseline"]["intervals"] >= 3, flight
    graph = next(r for r in flight["changes"] if r["family"] == "graph")
    assert "s_per_call" in graph["verdict"] and graph["per_call_ratio"] > 1.3, graph
    assert graph["incident"]["s_per_call"] > graph["baseline"]["s_per_call_range"][1]
    before = [ms for t, ms in load.tpots if t <= started]
    # the server's own: completions that ended while the competitors ran, the capture's among
    # them (its probes cost a token a few µs, against a slowdown of 1.3x and more; a stall of
    # this VM can leave none ending within the hold time alone)
    during = [ms for t, ms in load.tpots if started + 1 <= t <= slow_until]
    assert during and statistics.median(during) / statistics.median(before) > 1.3, (before, during)
    # and as its client saw it, token by token (what the steady test holds a capture to)
    assert load.saw(fired) >= 0.8, fired
    printed = subprocess.run([*PROFINFER, "report", str(trace)], capture_output=True, text=True, timeout=120)
    assert printed.returncode == 0 and "Flight recorder" in printed.stdout and "^ fired" in printed.stdout, printed
    assert list(summary)[0] == "flight" and flight["record_for_s"] == RECORD_S
    assert flight["fired"]["limit"] == fired["limit"] and flight["fired"]["unit"] == "s"
    check_flight_page(summary, page)


def check_flight_page(summary: dict, page) -> None:
    """The capture's page in Chromium: the trigger, what fired it (its value, limit and series),
    the baseline's and the incident's lengths, and each change's row (its shares on the sides
    that have the item, the baseline's range where it has one, its verdict), each number the
    summary's."""
    f = summary["flight"]
    _, shown, text, _ = shown_page(summary, page)
    assert f["fired"]["trigger"] in text and "What changed" in text and f"at {', '.join(f['levels'])}." in text
    assert {("flight", "fired", "value"), ("flight", "fired", "limit"), ("flight", "record_for_s"),
            ("flight", "baseline", "seconds"), ("flight", "incident", "seconds")} <= shown
    assert {("flight", "fired", "series", j, "value") for j in range(len(f["fired"]["series"]))} <= shown
    assert f["changes"], f
    for i, r in enumerate(f["changes"]):
        for side in ("baseline", "incident"):
            if r[side]:
                assert ("flight", "changes", i, side, "share") in shown
        if (r["baseline"] or {}).get("share_range"):
            assert {("flight", "changes", i, "baseline", "share_range", j) for j in (0, 1)} <= shown
        assert r["verdict"] in text


# what an operator would set (the docs' own example among them). Not the real slowdown's
# 1.8x for 3 s: on this VM a steady server's TPOT p99 runs at 2x its baseline for seconds at a
# time, and fired it twice in 5 minutes (bench/results.md)
STEADY_TRIGGERS = ("tpot_p99 > 3x baseline for 5s", "call_p99 > 3x baseline for 5s",
                   "tps_p50 < 0.5x baseline for 5s", "ttft_p99 > 2s")


def daemon_rss(d: Daemon) -> int:
    with open(f"/proc/{d.proc.pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def made(d: Daemon) -> int:
    text = _get(d.url + "/metrics")[1].decode()
    return int(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("profinfer_captures_total{")))
