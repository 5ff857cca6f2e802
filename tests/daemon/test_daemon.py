"""The node agent against real processes: a real Prometheus server (Debian's) scrapes the
daemon while the real llama.cpp workload runs, and what Prometheus stored equals llama.cpp's
own count; traces captured on demand; bad requests answered, the daemon running on.

The workload reads its prompt from a FIFO (-f), so it waits, its libraries mapped, until the
daemon has found it: then every decode call is seen, and the counts can be exact."""
from __future__ import annotations

import json
from collections import Counter
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from conftest import completion_cmd, llama_perf, llama_server
from test_op_counted import as_printed, printed_compositions
from daemon_helpers import _STARTED, PROFINFER, Daemon, OtlpReceiver, Workload, _free_port, _get, kill_started

@pytest.fixture(autouse=True)
def _no_workload_left():
    yield
    kill_started()


@pytest.fixture
def daemon(tmp_path):
    d = Daemon(tmp_path)
    yield d
    d.stop()


def _generate_watched(d: Daemon, llama_build, model, llama_env, tmp_path: Path) -> tuple[int, dict]:
    """A generation the daemon found before it began: (its pid, llama.cpp's own counts; its
    log drain is preloaded, so a missing line is a defect)."""
    w = Workload(llama_build, model, llama_env, tmp_path, n=32)
    assert d.watched(w.proc.pid)["engine"] == "llama.cpp"
    w.go()
    err = w.finish()
    perf = llama_perf(err)
    assert {"prompt eval", "eval"} <= perf.keys(), f"llama.cpp's perf lines missing:\n{err[-2000:]}"
    return w.proc.pid, perf


def _prometheus(tmp_path: Path, target: str) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(f"global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n"
                      f"scrape_configs:\n  - job_name: profinfer\n    static_configs:\n"
                      f"      - targets: ['{target}']\n")
    proc = subprocess.Popen(["prometheus", f"--config.file={config}",
                             f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return proc, f"http://127.0.0.1:{port}"


def _query(prom: str, q: str) -> list[dict]:
    status, body = _get(prom + "/api/v1/query?" + urllib.parse.urlencode({"query": q}))
    assert status == 200, body
    return json.loads(body)["data"]["result"]


def _stored(prom: str, q: str, label: str, want: dict[str, int], timeout: float = 30) -> dict[str, int]:
    """What Prometheus stored for q, by label: polled until it equals want (scrapes are a
    second apart) or the time is up."""
    deadline, got = time.monotonic() + timeout, {}
    while time.monotonic() < deadline:
        got = {r["metric"][label]: int(float(r["value"][1])) for r in _query(prom, q)}
        if got == want:
            break
        time.sleep(0.5)
    return got


def test_prometheus_counts_equal_llama_perf(daemon, tmp_path, llama_build, tiny_model, llama_env):
    prom, prom_url = _prometheus(tmp_path, f"127.0.0.1:{daemon.port}")
    try:
        pid, perf = _generate_watched(daemon, llama_build, tiny_model, llama_env, tmp_path)
        want = {"prefill": perf["prompt eval"][1], "decode": perf["eval"][1]}
        got = _stored(prom_url, f'profinfer_tokens_total{{pid="{pid}"}}', "phase", want)
        assert got == want, daemon.text()
        calls = _query(prom_url, f'sum(profinfer_decode_calls_total{{pid="{pid}",phase="decode"}})')
        assert int(float(calls[0]["value"][1])) == perf["eval"][1]
        ttft = _query(prom_url, f'profinfer_time_to_first_token_seconds_count{{pid="{pid}"}}')
        assert int(float(ttft[0]["value"][1])) == 1
        # the graph level, counted in BPF (read once a second, and at the process's exit): a
        # graph per decode call (the prompt, under one ubatch of 512, is one), on the
        # scheduler and on the CPU backend
        want_graphs = {"sched": perf["eval"][1] + 1, "CPU": perf["eval"][1] + 1}
        graphs = _stored(prom_url, f'profinfer_graph_computes_total{{pid="{pid}"}}', "backend", want_graphs)
        assert graphs == want_graphs, daemon.text()
        hist = _query(prom_url, f'profinfer_graph_compute_duration_seconds_count{{pid="{pid}",backend="CPU"}}')
        assert int(float(hist[0]["value"][1])) == perf["eval"][1] + 1
    finally:
        prom.terminate()
        prom.wait(timeout=30)
    text = _get(daemon.url + "/metrics")[1]
    check = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True)
    assert check.returncode == 0, check.stdout + check.stderr


def test_capture_and_bad_requests(daemon, tmp_path, llama_build, tiny_model, llama_env):
    from profinfer.exporters.trace_reader import read_trace
    # ~2 s of decoding from when it is let go, 1 s into a 2 s capture: it outlives the capture
    w = Workload(llama_build, tiny_model, llama_env, tmp_path, n=1900)
    pid = w.proc.pid
    daemon.watched(pid)
    cap = daemon.url + f"/capture?pid={pid}&seconds=2&levels=token,graph,op"
    # without the token, with a wrong one: refused
    assert _get(cap, method="POST")[0] == 401
    assert _get(cap, "wrong", method="POST")[0] == 401
    # bad requests: a clear status and a JSON body
    for query, status in ((f"pid={pid}&levels=token,bogus", 400), ("pid=notanumber", 400),
                          (f"pid={pid}&seconds=-1", 400), ("pid=999999999", 404)):
        code, body = _get(daemon.url + "/capture?" + query, daemon.token, method="POST")
        assert code == status and "error" in json.loads(body), (query, code, body)
    results = {}

    def run_capture():
        results["main"] = _get(cap, daemon.token, method="POST", timeout=120)

    t = threading.Thread(target=run_capture)
    t.start()
    time.sleep(1.0)
    # a second capture of the same process while the first runs: refused
    code, body = _get(cap, daemon.token, method="POST")
    assert code == 409 and "already running" in json.loads(body)["error"]
    w.go()
    t.join(timeout=120)
    w.finish()
    code, data = results["main"]
    assert code == 200, data[:300]
    trace = tmp_path / "captured.pftrace"
    trace.write_bytes(data)
    prof = read_trace(trace)
    assert prof.pid == pid and len(prof.ops) > 0 and prof.tokens
    assert _get(daemon.url + "/healthz")[0] == 200       # still serving
    assert daemon.proc.poll() is None


def test_a_process_exiting_mid_capture_gives_what_came_before(daemon, tmp_path, llama_build, tiny_model,
                                                              llama_env):
    """A 20 s capture of a generation that ends after a second of it: the trace of what came
    before the exit is answered (a crash is often the incident), saying so in its meta, its
    tokens as llama.cpp counts them."""
    w = Workload(llama_build, tiny_model, llama_env, tmp_path, n=8)
    pid = w.proc.pid
    daemon.watched(pid)
    results = {}
    t = threading.Thread(target=lambda: results.setdefault("r", _get(
        daemon.url + f"/capture?pid={pid}&seconds=20&levels=token", daemon.token, method="POST", timeout=120)))
    t.start()
    time.sleep(1.0)
    w.go()
    err = w.finish()
    t.join(timeout=60)
    code, body = results["r"]
    assert code == 200, body[:300]
    trace = tmp_path / "partial.pftrace"
    trace.write_bytes(body)
    from profinfer.exporters.trace_reader import read_trace
    prof = read_trace(trace)
    assert prof.pid == pid and prof.meta.get("stopped_by", "").startswith("target exited"), prof.meta
    perf = llama_perf(err)
    decode = sum(t.decode_tokens for t in prof.tokens if not t.prefill)
    prompt = sum(t.n_tokens for t in prof.tokens if t.prefill)
    assert (prompt, decode) == (perf["prompt eval"][1], perf["eval"][1]), (prompt, decode, perf)
    assert _get(daemon.url + "/healthz")[0] == 200


def test_listening_beyond_loopback_needs_the_flag(tmp_path):
    r = subprocess.run(PROFINFER + ["daemon", "--listen", "0.0.0.0:0", "--token-file", str(tmp_path / "t")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "--allow-remote" in r.stderr and "Traceback" not in r.stderr


def _attrs(dp) -> dict:
    return {kv.key: getattr(kv.value, kv.value.WhichOneof("value")) for kv in dp.attributes}


def test_otlp_carries_the_same_counts_under_genai_names(tmp_path, llama_build, tiny_model, llama_env):
    receiver = OtlpReceiver()
    d = Daemon(tmp_path, ("--otlp", receiver.url, "--otlp-interval", "0.5"))
    try:
        pid, perf = _generate_watched(d, llama_build, tiny_model, llama_env, tmp_path)
        want = {"input": perf["prompt eval"][1], "output": perf["eval"][1]}
        deadline, got = time.monotonic() + 20, {}
        while time.monotonic() < deadline:
            got = {}
            for dp in receiver.points("profinfer.tokens"):
                a = _attrs(dp)
                if a["process.pid"] == pid:
                    got[a["gen_ai.token.type"]] = got.get(a["gen_ai.token.type"], 0) + dp.as_int
            if got == want:
                break
            time.sleep(0.3)
        assert got == want, d.text()
        ttft = [dp for dp in receiver.points("gen_ai.server.time_to_first_token") if _attrs(dp)["process.pid"] == pid]
        assert sum(dp.count for dp in ttft) == 1
        assert _attrs(ttft[0])["gen_ai.provider.name"] == "llama.cpp"
        tpot = [dp for dp in receiver.points("gen_ai.server.time_per_output_token") if _attrs(dp)["process.pid"] == pid]
        assert sum(dp.count for dp in tpot) == perf["eval"][1]
    finally:
        d.stop()
        receiver.close()


def test_a_capture_counts_against_the_budget(tmp_path, llama_build, tiny_model, llama_env):
    """The tiny model generating, its op level stepped down (it cost more than the budget, here
    0.02%: whatever the machine's load does to the stated cost, its op level costs more): a
    capture at the op level would take it over again, and is refused (429, the reason in the
    body); asked with force=1 it runs, and the daemon's log names the process, its cost and
    who asked."""
    d = Daemon(tmp_path, ("--levels", "token,op", "--budget", "0.0002"))
    cmd = completion_cmd(llama_build, tiny_model, n=-1, extra=("--context-shift", "--ignore-eos", "-c", "256"))
    target = subprocess.Popen(cmd, env=llama_env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _STARTED.append(target)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and f"PID {target.pid}: levels op,token -> token" not in d.text():
            time.sleep(0.2)
        assert d.watched(target.pid)["levels"] == ["token"], d.text()
        token = d.token
        query = f"/capture?pid={target.pid}&seconds=1&levels=op"
        status, body = _get(d.url + query, token, method="POST")
        assert status == 429, body
        why = json.loads(body)["error"]
        assert f"PID {target.pid} costs" in why and "> budget 0.02%" in why and "force=1" in why, why
        status, body = _get(d.url + query + "&force=1", token, method="POST", timeout=120)
        assert status == 200 and len(body) > 0, body[:300]
        forced = [l for l in d.text().splitlines() if "capture forced over the budget" in l]
        assert len(forced) == 1 and "by 127.0.0.1" in forced[0] and f"PID {target.pid} costs" in forced[0], d.text()
    finally:
        target.kill()
        target.wait()
        d.stop()


@pytest.mark.parametrize("design", ["one-probe", "two-probe"])
def test_op_totals_counted_in_bpf_are_llama_cpps_nodes(design, tmp_path, llama_build, tiny_model, llama_env,
                                                       monkeypatch):
    """The daemon's op level counts ops by type in BPF (no op events): llama.cpp's own count,
    in either op design. With GGML_SCHED_DEBUG=2 it prints each graph's computed nodes, and
    each thread runs each computed node once a compute: a type's count is its computed nodes
    in the graph x the decode calls (its prompt's one and its eval runs) x the threads, a
    fused pair ("RMS_NORM+MUL") counted as its two nodes."""
    monkeypatch.setenv("PROFINFER_OP_DESIGN", design)
    d = Daemon(tmp_path, ("--levels", "token,op", "--budget", "1.0"))
    try:
        w = Workload(llama_build, tiny_model, {**llama_env, "GGML_SCHED_DEBUG": "2"}, tmp_path, n=16,
                     extra=("-v",))
        assert d.watched(w.proc.pid)["levels"] == ["op", "token"]
        w.go()
        log = w.finish()
        deadline, got = time.monotonic() + 15, {}
        while time.monotonic() < deadline:
            if not any(p["pid"] == w.proc.pid for p in json.loads(_get(d.url + "/status")[1])["processes"]):
                break                    # exited and drained
            time.sleep(0.2)
        for line in _get(d.url + "/metrics")[1].decode().splitlines():
            if line.startswith("profinfer_op_calls_total{") and f'pid="{w.proc.pid}"' in line:
                got[line.split('op="', 1)[1].split('"', 1)[0]] = int(float(line.rsplit(" ", 1)[1]))
    finally:
        d.stop()
    printed = printed_compositions(log)
    assert printed and all(g == printed[0] for g in printed), printed
    graph = Counter({("*GLU" if op.endswith("GLU") else op): n for op, n in printed[0].items()})
    perf = llama_perf(log)
    assert perf["prompt eval"][1] < 2048          # one prompt batch (llama-completion's -b 2048)
    calls = 1 + perf["eval"][1]
    assert "MUL_MAT" in got and any("+" in op for op in got), got
    assert as_printed([{"op": op, "count": n} for op, n in got.items()]) == \
        Counter({op: n * calls * 2 for op, n in graph.items()}), (got, graph, calls)


def test_a_process_that_went_keeps_no_sequences(daemon, llama_build, tiny_model, llama_env):
    """Each process's sequence tracker (prompt and token times of its sequences) goes with it:
    a llama-server holds one while it serves a request's sequence, and none once it is gone
    (/status's cache sizes)."""
    def sequences() -> int:
        return json.loads(_get(daemon.url + "/status", daemon.token)[1])["caches"]["sequences"]

    before = sequences()
    with llama_server(llama_build, tiny_model, llama_env, 1) as (proc, url):
        daemon.watched(proc.pid)
        req = urllib.request.Request(url + "/completion", method="POST",
                                     data=json.dumps({"prompt": "Once upon a time", "n_predict": 8}).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            assert r.status == 200
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and sequences() <= before:
            time.sleep(0.2)
        assert sequences() > before, daemon.text()
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and sequences() != before:
        time.sleep(0.2)
    assert sequences() == before, daemon.text()


def test_moving_between_shared_objects_loses_no_decode_call(tmp_path, llama_build, tiny_model, llama_env):
    """The governor takes the graph level from a process (it moves to its build's token-only
    probes) and gives it back, while the process decodes: every decode call and token is
    counted once, as llama.cpp counts them itself."""
    from profinfer.daemon.agent import Agent
    agent = Agent({"token", "graph"}, 1.0, discover_processes=False)
    try:
        w = Workload(llama_build, tiny_model, llama_env, tmp_path, n=1500)
        deadline = time.monotonic() + 30
        while w.proc.pid not in agent.watches and time.monotonic() < deadline:
            agent.poll(0.1)
        watch = agent.watches[w.proc.pid]
        assert watch.levels == {"token", "graph"}
        w.go()
        moves = [({"token"}, 40), ({"token", "graph"}, 400)]
        while w.proc.poll() is None:
            agent.poll(0.05)
            decoded = agent.metrics.processes[w.proc.pid].tokens.get("decode", 0)
            if moves and decoded >= moves[0][1] and agent.attach.relevel(watch, moves[0][0], "test"):
                moves.pop(0)        # (refused while it still leaves the last object: tried again)
        for _ in range(10):
            agent.poll(0.05)
        assert not moves and watch.levels == {"token", "graph"}
        err = w.proc.stderr.read()
        perf = llama_perf(err)      # its log drain is preloaded: a missing line is a defect
        assert {"prompt eval", "eval"} <= perf.keys(), f"llama.cpp's perf lines missing:\n{err[-2000:]}"
        got = agent.metrics.processes[w.proc.pid].tokens
        assert got == {"prefill": perf["prompt eval"][1], "decode": perf["eval"][1]}, (got, perf)
        assert agent.metrics.processes[w.proc.pid].graphs, "graph counts kept across the moves"
    finally:
        agent.close()


def test_a_fault_of_one_turn_is_counted_and_the_loop_goes_on():
    """The daemon's loop (run.run_loop) over a real agent whose turn fails once: the fault is
    counted in /status's loop_errors and said once, and the loop goes on to its next turns."""
    from profinfer.daemon.agent import Agent
    from profinfer.daemon.run import run_loop
    agent = Agent({"token"}, 0.04, discover_processes=False)
    stop, turns, logged = threading.Event(), [], []

    def turn(timeout_s: float) -> None:
        turns.append(timeout_s)
        if len(turns) == 1:
            raise RuntimeError("a fault of one turn")
        if len(turns) == 3:
            stop.set()
    agent.poll = turn
    try:
        run_loop(agent, stop, logged.append)
        assert len(turns) == 3 and agent.status()["loop_errors"] == 1, (turns, agent.status()["loop_errors"])
        assert logged == ["error in the agent's loop (the loop goes on): RuntimeError: a fault of one turn"], logged
    finally:
        agent.close()
