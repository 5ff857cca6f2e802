"""The daemon's per-request histograms for llama-server (engines/llamacpp/metrics.py, fed by
decode/live.py's bounded book): a real daemon watching a real 4-slot server under 12
concurrent completions, its histograms against the sums of the responses' own `timings`;
and the book's caps, with more posts and launches than they allow."""
from __future__ import annotations

import time
import tracemalloc

from daemon_helpers import Daemon, _get, series
import test_requests
from test_requests import CASES, WORDS, _read_all, _realtime, _send

from profinfer.core.profile.model import TokenCall
from profinfer.engines.llamacpp.decode.live import MAX_OPEN, MAX_PENDING, RequestBook
from profinfer.engines.llamacpp.decode.requests import LAUNCHED, POSTED, RequestMark
from profinfer.engines.llamacpp.metrics import RequestMetrics

server = test_requests.server      # its fixture: the 4-slot server, real-time, an HTTP thread a request
NAMES = {"queue": "profinfer_request_queue_seconds",
         "ttft": "profinfer_request_time_to_first_token_seconds",
         "tpot": "profinfer_request_time_per_output_token_seconds",
         "prompt": "profinfer_request_prompt_tokens",
         "generated": "profinfer_request_generated_tokens"}


def _histograms(d: Daemon, pid: int) -> dict[str, tuple[float, float]]:
    text = _get(d.url + "/metrics", d.token)[1].decode()
    out = {}
    for key, name in NAMES.items():
        n, s = series(text, name + "_count", pid, None), series(text, name + "_sum", pid, None)
        out[key] = (n.get("", 0.0), s.get("", 0.0))
    return out


def test_daemon_request_histograms_equal_server_timings(server, tmp_path):
    proc, url = server
    d = Daemon(tmp_path)
    try:
        d.watched(proc.pid)
        time.sleep(1)          # its shared probes attached (the watch is listed as they are)
        prompts = [" ".join(WORDS[(i + j) % len(WORDS)] for j in range(n)) for i, (n, _) in enumerate(CASES)]
        with _realtime():
            replies = [_send(url, prompts[i], CASES[i][1], False) for i in range(len(CASES))]
            _read_all(replies)
        n = len(replies)
        deadline, got = time.monotonic() + 30, {}
        while time.monotonic() < deadline:     # the last request of each slot ends when it is quiet (5 s)
            got = _histograms(d, proc.pid)
            if all(c == n for c, _ in got.values()):
                break
            time.sleep(0.5)
        t = [r["timings"] for r in replies]
        want = {"prompt": sum(x["prompt_n"] for x in t), "generated": sum(x["predicted_n"] for x in t),
                "ttft": sum(x["prompt_ms"] for x in t) / 1e3,
                "tpot": sum(x["predicted_per_token_ms"] for x in t) / 1e3}
        print(f"{n} requests: daemon {got}; server {want}")
        assert {k: c for k, (c, _) in got.items()} == dict.fromkeys(NAMES, n), (got, d.text()[-3000:])
        assert got["prompt"][1] == want["prompt"] and got["generated"][1] == want["generated"]
        for key in ("ttft", "tpot"):
            assert abs(got[key][1] - want[key]) <= max(0.1 * want[key], 0.002 * n), (key, got[key], want[key])
        assert got["queue"][1] > 0      # 12 requests on 4 slots: some waited
        text = _get(d.url + "/metrics", d.token)[1].decode()
        assert sum(series(text, "profinfer_requests_dropped_total", proc.pid, "reason").values()) == 0
    finally:
        d.stop()


def _post(task: int, ts: int) -> RequestMark:
    return RequestMark(1, 1, ts, POSTED, (task,), ("completion",), n_tasks=1)


def _launch(task: int, slot: int, ts: int) -> RequestMark:
    return RequestMark(1, 2, ts, LAUNCHED, (task,), ("completion",), slot=slot)


def test_the_request_book_is_bounded():
    book = RequestBook(max_pending=100, max_open=8, quiet_ns=1000, pending_max_ns=10**6)
    m = RequestMetrics(book)
    m.book.feed([_post(i, 10 + i) for i in range(5000)], now_ns=6000)
    assert len(book.pending) == 100 and book.dropped["pending_cap"] == 4900
    assert list(book.pending)[0] == 4900           # the oldest went first
    # launches on more slots than the cap: the stalest dropped, counted
    m.book.feed([_launch(4900 + s, s, 7000 + s) for s in range(20)], now_ns=7020)
    assert len(book.open) == 8 and book.dropped["in_flight_cap"] == 12
    assert len(book.pending) == 80
    # the next launch on a slot finishes its request (known arrival: a queue sample)
    book.feed([_launch(4999, 12, 7100)], now_ns=7100)
    m._finished()
    assert m.hists[0].counts and sum(m.hists[0].counts) == 1
    # quiet mid-prompt (a prompt chunk may take longer than quiet): kept, bounded by the slots
    slots = list(book.open)
    book.expire(10**5)
    assert list(book.open) == slots and book.finished == []
    # quiet past its prompt: every request in flight finished, none kept
    book.feed([TokenCall.of_batch(1, 7200, 7300, 4 * len(slots), 0, tuple((s, 0, 4) for s in slots))])
    book.expire(10**5)
    m._finished()
    assert book.open == {} and book.finished == []
    assert sum(m.hists[0].counts) == 9
    # posts never launched go after their time, counted
    book.expire(2 * 10**6)
    assert book.pending == {} and book.dropped["pending_expired"] == 79
    # a scrape's copy holds counts, not requests
    c = m.copy()
    assert c.book.open == {} and c.book.pending == {} and c.book.dropped == book.dropped
    fams = {f.name: f for f in RequestMetrics.families([(["llama.cpp", "1"], c)], ["engine", "pid"], True, str)}
    assert {s.value for s in fams["profinfer_requests_dropped"].samples} == {4900, 79, 12}
    # a process that never posted a request (llama-completion) has no request series
    quiet = RequestMetrics.families([(["llama.cpp", "2"], RequestMetrics())], ["engine", "pid"], True, str)
    assert all(not f.samples for f in quiet)


def test_the_request_book_stays_small_at_its_caps():
    """Its default caps full, more and more requests posted and launched: the memory it holds
    stops growing (about 1.2 MiB)."""
    book, held = RequestBook(), []
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        for k in range(6):
            t = k * 10000
            book.feed([_post(t + i, t + i) for i in range(10000)])
            book.feed([_launch(t + i, i, t + 5000 + i) for i in range(2000)])
            book.take()
            held.append(tracemalloc.get_traced_memory()[0] - base)
    finally:
        tracemalloc.stop()
    assert len(book.pending) == MAX_PENDING and len(book.open) == MAX_OPEN
    print(f"held: {[round(h / 1024) for h in held]} KiB")
    assert max(held[2:]) <= held[1] * 1.1 and held[-1] < 2 << 20, held
