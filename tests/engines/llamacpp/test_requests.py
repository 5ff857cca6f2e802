"""Every request a row: llama-server's requests (arrival, queue, slot, tokens, TTFT, TPOT)
against what the server says of each in its own response (`timings`, `id_slot`) and what
the client measured (its send and its first streamed token), live and from the saved trace."""
from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import socket
import subprocess
import time

import pytest

from conftest import PROFINFER, llama_server, start_profinfer

SLOTS = 4
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
# (prompt words, tokens to generate): more requests than slots, so that some wait
CASES = [(6 + 7 * (i % 5), 16 + 4 * (i % 4)) for i in range(12)]
RESENT = " ".join(WORDS[j % len(WORDS)] for j in range(30))


@pytest.fixture
def server(llama_build, tiny_model, llama_env):
    """A llama-server with SLOTS slots and HTTP threads for every request sent at once (with
    fewer, a request would wait for a thread before the server's queue sees it); one compute
    thread, real-time, ahead of other work on this shared machine: the server stamps a
    request's first token after the decode call that gave it, and a scheduler tick (4 ms)
    spent preempted between the two would part its clock from the calls'."""
    with llama_server(llama_build, tiny_model, llama_env, SLOTS, ctx_per_slot=512, threads=1,
                      extra=("--threads-http", str(len(CASES) + 4)),
                      preexec_fn=lambda: os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(10))) as running:
        yield running


def _send(url: str, prompt: str, n_predict: int, cache: bool, **extra) -> dict:
    """A streamed /completion sent on a socket of its own, not yet read: when it was sent
    (CLOCK_MONOTONIC, as BPF's clock)."""
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"prompt": prompt, "n_predict": n_predict, "ignore_eos": True, "stream": True,
                       "cache_prompt": cache, **extra}).encode()
    sock = socket.create_connection((host, int(port)), timeout=120)
    head = (f"POST /completion HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    sent = time.monotonic_ns()
    sock.sendall(head + body)
    return {"sock": sock, "sent": sent, "first": None, "raw": b""}


def _read_all(pending: list[dict]) -> None:
    """Read every response to its end in one thread (no client thread waits for the
    interpreter to see its first token): when each one's first streamed event came, and its
    final event (timings, id_slot)."""
    with selectors.DefaultSelector() as sel:
        for p in pending:
            sel.register(p["sock"], selectors.EVENT_READ, p)
        while sel.get_map():
            for key, _ in sel.select(timeout=120):
                p, data = key.data, key.fileobj.recv(1 << 16)
                if p["first"] is None and b"data: " in p["raw"] + data:
                    p["first"] = time.monotonic_ns()
                p["raw"] += data
                if not data:
                    sel.unregister(key.fileobj)
                    key.fileobj.close()
    for p in pending:
        head, _, body = p.pop("raw").partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), head
        if b"chunked" in head.lower():
            body = _dechunk(body)
        events = [json.loads(line[6:]) for line in body.split(b"\n") if line.startswith(b"data: ")]
        assert events and events[-1].get("stop"), events[-1:]
        p.update(events[-1])
        del p["sock"]


def _dechunk(body: bytes) -> bytes:
    out, pos = b"", 0
    while True:
        eol = body.index(b"\r\n", pos)
        size = int(body[pos:eol].split(b";")[0], 16)
        if not size:
            return out
        out += body[eol + 2: eol + 2 + size]
        pos = eol + 2 + size + 2


def _stream(url: str, prompt: str, n_predict: int, cache: bool, **extra) -> dict:
    pending = [_send(url, prompt, n_predict, cache, **extra)]
    _read_all(pending)
    return pending[0]


@contextlib.contextmanager
def _realtime():
    """This thread real-time (below the server) while it measures."""
    os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(5))
    try:
        yield
    finally:
        os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))


def _by_slot(rows: list[dict], key) -> dict[int, list]:
    out: dict[int, list] = {}
    for r in sorted(rows, key=key):
        out.setdefault(r["slot"] if "slot" in r else r["id_slot"], []).append(r)
    return out


def test_requests_against_server_timings(server, tmp_path):
    proc, url = server
    out, trace = tmp_path / "s.json", tmp_path / "s.pftrace"
    p = start_profinfer(["attach", "--pid", str(proc.pid), "--levels", "token", "--quiet",
                         "--json", str(out), "-o", str(trace)])
    prompts = [" ".join(WORDS[(i + j) % len(WORDS)] for j in range(n)) for i, (n, _) in enumerate(CASES)]
    with _realtime():      # the client's clock, read as the bytes come (a shared machine)
        replies = [_send(url, prompts[i], CASES[i][1], False) for i in range(len(CASES))]
        _read_all(replies)
        # the same prompt twice on one slot: the second finds it in the slot's cache
        replies += [_stream(url, RESENT, 16, True, id_slot=1) for _ in range(2)]
    p.send_signal(signal.SIGINT)
    p.wait(timeout=60)
    assert p.returncode == 0, p.stderr.read()
    summary = json.loads(out.read_text())
    live = summary["requests"]
    assert len(live) == len(replies), live
    # what the marks cost: one hit at the queue per HTTP request, one at the launch per task
    meta = summary["meta"]
    hits = {prog: int(meta[f"cost:runs:{prog}"]) for prog in ("request_posted", "request_launched")}
    print(f"{len(live)} requests: {hits}")
    assert hits == {"request_posted": len(replies), "request_launched": len(replies)}
    assert [r for r in live if r["kind"] != "completion"] == []

    # a slot serves one request at a time: its requests in launch order are its replies in
    # the order they finished
    ours, theirs = _by_slot(live, lambda r: r["start_ns"]), _by_slot(replies, lambda r: r["first"])
    assert {s: len(v) for s, v in ours.items()} == {s: len(v) for s, v in theirs.items()}
    busy = 0
    for slot in ours:
        for r, reply in zip(ours[slot], theirs[slot]):
            t = reply["timings"]
            # the client's clock: its first token came prompt_ms after its slot began it
            began = reply["first"] - t["prompt_ms"] * 1e6
            print(f"task {r['id']} slot {slot}: prompt {r['prompt_tokens']} (server {t['prompt_n']}), "
                  f"cached {r['cached_tokens']} ({t['cache_n']}), generated {r['generated_tokens']} "
                  f"({t['predicted_n']}); TTFT {r['ttft_ns'] / 1e6:.2f} ms (server {t['prompt_ms']:.2f}); "
                  f"TPOT {r['tpot_ns'] / 1e6:.3f} ms ({t['predicted_per_token_ms']:.3f}); "
                  f"queue {r['queue_ns'] / 1e6:.2f} ms (client, send to slot: {(began - reply['sent']) / 1e6:.2f}; "
                  f"send to post {(r['arrival_ns'] - reply['sent']) / 1e6:.2f}; first token to client "
                  f"{(reply['first'] - r['first_token_ns']) / 1e6:.2f})")
            assert (r["prompt_tokens"], r["cached_tokens"], r["generated_tokens"]) == (
                t["prompt_n"], t["cache_n"], t["predicted_n"])
            assert r["ttft_ns"] / 1e6 == pytest.approx(t["prompt_ms"], rel=0.10, abs=2)
            assert r["tpot_ns"] / 1e6 == pytest.approx(t["predicted_per_token_ms"], rel=0.10, abs=0.1)
            # it reached the queue after the client sent it (the HTTP thread's parsing and
            # tokenizing between), and left it when the client's clock says its slot began
            assert reply["sent"] <= r["arrival_ns"] <= r["start_ns"] <= r["first_token_ns"] < reply["first"]
            if began - reply["sent"] > 20e6:      # the server was busy: it waited for a slot
                busy += 1
                assert r["queue_ns"] / 1e6 == pytest.approx((began - reply["sent"]) / 1e6, abs=5)
    assert busy >= 4, "more requests than slots: some waited"

    # the saved trace gives the same requests, and report --requests their table
    saved = tmp_path / "r.json"
    rep = subprocess.run([*PROFINFER, "report", str(trace), "--requests", "--json", str(saved)],
                         capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "160"})
    assert rep.returncode == 0, rep.stderr
    assert json.loads(saved.read_text())["requests"] == live
    assert f"Requests ({len(live)};" in rep.stdout
    assert "queue ms" in rep.stdout and "TTFT ms" in rep.stdout


def test_join_by_slot_and_time():
    """The join itself (decode/requests.py), on marks and calls made here: a prompt read in
    two chunks beside another's, a request that found a cached prefix, one posted before
    the recording began."""
    from profinfer.core.profile.model import TokenCall
    from profinfer.engines.llamacpp.decode.requests import LAUNCHED, POSTED, RequestMark, join

    marks = [RequestMark(7, 1, 100, POSTED, (1, 2), ("completion", "completion"), n_tasks=2),
             RequestMark(7, 2, 200, LAUNCHED, (1,), ("completion",), slot=0),
             RequestMark(7, 2, 210, LAUNCHED, (2,), ("completion",), slot=1),
             RequestMark(7, 2, 1000, LAUNCHED, (3,), ("completion",), slot=0)]
    calls = [TokenCall.of_batch(2, s, e, sum(n for _, _, n in runs), 0, runs) for s, e, runs in (
        (220, 300, ((0, 0, 10), (1, 0, 5))), (310, 400, ((0, 10, 1), (1, 5, 3))),
        (410, 450, ((0, 11, 1), (1, 8, 1))), (1010, 1100, ((0, 4, 6),)), (1110, 1150, ((0, 10, 1),)))]
    got = {r.id: r for r in join(marks, calls, 7)}
    one, two, three = got[1], got[2], got[3]
    assert (one.queue_ns, one.prompt_tokens, one.cached_tokens, one.generated_tokens) == (100, 10, 0, 3)
    assert (one.ttft_ns, one.tpot_ns, one.end_ns) == (100, 75.0, 450)
    assert (two.queue_ns, two.prompt_tokens, two.generated_tokens, two.ttft_ns, two.end_ns) == (110, 8, 2, 190, 450)
    assert (three.arrival_ns, three.queue_ns, three.prompt_tokens, three.cached_tokens) == (None, None, 6, 4)
    assert (three.ttft_ns, three.generated_tokens, three.tpot_ns) == (100, 2, 50.0)
    # a client that left mid-stream: its cancel is posted with the task id the post gives it
    # (-1 at the probe), which is no arrival for a request posted before the recording; and
    # a prompt chunk the server refused (the KV cache full) and submitted again counts once
    marks += [RequestMark(7, 1, 1200, POSTED, (-1,), ("cancel",), n_tasks=1),
              RequestMark(7, 2, 1300, LAUNCHED, (9,), ("completion",), slot=1)]
    calls += [TokenCall.of_batch(2, 1310, 1400, 6, 1, ((1, 0, 6),)),
              TokenCall.of_batch(2, 1410, 1500, 6, 0, ((1, 0, 6),))]
    nine = next(r for r in join(marks, calls, 7) if r.id == 9)
    assert (nine.arrival_ns, nine.queue_ns, nine.prompt_tokens, nine.ttft_ns) == (None, None, 6, 200)


def test_no_dwarf_says_so():
    from types import SimpleNamespace

    from profinfer.engines.llamacpp.probes import requests

    probe = SimpleNamespace(entry_fn="request_posted", elf=SimpleNamespace(dwarf_path=None, path="/b/libllama-server-impl.so"))
    other = SimpleNamespace(entry_fn="token_enter_ext", elf=None)
    warnings: list[str] = []
    assert requests.fill([other, probe], {}, warnings) == ([other], {})
    assert warnings == ["no DWARF in /b/libllama-server-impl.so: llama-server's requests are not read (build it with -g)"]


def test_the_request_probes_are_quiet_only_where_the_server_library_is_not(tmp_path, llama_build):
    """The request probes are optional: a build without llama-server's library (the
    completion tool's) resolves them out without a word; a library of that name that lacks
    them (a build that renamed them) is said, not hidden."""
    import shutil
    from profinfer.core.plugin.packs import load_pack, resolve
    from profinfer.core.target.symbols import load_elf
    from profinfer.engines.llamacpp import workload
    pack = load_pack("llamacpp")
    bin_dir = workload.llama_bin("llama-server", llama_build).parent
    base = [load_elf(str(p)) for p in sorted(bin_dir.glob("libllama.so.*.*.*"))]
    _, said = resolve(pack, base, {"token"})
    assert not [w for w in said if "server_queue" in w or "launch_slot" in w], said
    impostor = tmp_path / "libllama-server-impl.so"
    shutil.copy(bin_dir / "libllama-common.so", impostor)       # the name, not the functions
    _, said = resolve(pack, base + [load_elf(str(impostor))], {"token"})
    assert len([w for w in said if "server_queue" in w or "launch_slot" in w]) == 2, said
