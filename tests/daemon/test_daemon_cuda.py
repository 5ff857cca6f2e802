"""The daemon's cuda level (on by default): a program built with nvcc that logs every CUDA
call it makes runs while the daemon watches it (counted in BPF, no timeline); the daemon's
metrics hold its kernel launches by kernel, its copies' bytes by kind and its graph launches,
as the program's own log counts them. One object serves every process with a runtime, each
runtime file probed once."""
from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from daemon_helpers import _STARTED, Daemon, OtlpReceiver, _get, cuda_log_counts, kill_started, series
from profinfer.levels.cuda import workload
from conftest import TESTS

PROGRAM = TESTS / "levels" / "cuda" / "programs" / "cuda_calls.cu"


def _attrs(dp) -> dict:
    return {kv.key: getattr(kv.value, kv.value.WhichOneof("value")) for kv in dp.attributes}


@pytest.fixture(autouse=True)
def _no_workload_left():
    yield
    kill_started()


def test_cuda_counts_in_the_daemon_equal_the_programs_log(tmp_path):
    """Three programs at once: two of one static build (one executable file: probed once)
    and one linked to the shared runtime; one object serves them, each counted apart."""
    # the runtime linked in (the driver part, dlopen'd when the calls begin, is left out: the
    # daemon probes a library a process loads later within a scan, not before its first call)
    static, shared = workload.build_program(PROGRAM, "static"), workload.build_program(PROGRAM, "shared")
    receiver = OtlpReceiver()
    d = Daemon(tmp_path, ("--otlp", receiver.url, "--otlp-interval", "0.5"))
    go = tmp_path / "go"
    try:
        procs = []
        for i, program in enumerate((static, static, shared)):
            log = tmp_path / f"calls{i}.jsonl"
            proc = subprocess.Popen([str(program), "--log", str(log), "--repeat", "2",
                                     "--start-after", str(go)], stdout=subprocess.PIPE, text=True)
            _STARTED.append(proc)
            assert proc.stdout.readline().startswith("ready ")
            procs.append((proc, log))
        for proc, _ in procs:
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:
                info = d.watched(proc.pid)
                if "cuda" in info["levels"]:
                    break
                time.sleep(0.1)
            assert "cuda" in info["levels"] and info["engine"] == "CUDA", info
        groups = [g for g in json.loads(_get(d.url + "/status")[1])["shared_probes"] if g["engine"] == "CUDA"]
        assert len(groups) == 1 and {p.pid for p, _ in procs} <= set(groups[0]["processes"]), groups
        assert groups[0]["files"].count(static.name) == 1 and any("libcudart.so" in f for f in groups[0]["files"])
        go.write_text("")
        for proc, _ in procs:
            assert proc.wait(timeout=60) == 0
        # each one's exit seen, and what it sent drained, before its series are read
        pids, deadline = {p.pid for p, _ in procs}, time.monotonic() + 10
        while time.monotonic() < deadline and pids & {
                p["pid"] for p in json.loads(_get(d.url + "/status")[1])["processes"]}:
            time.sleep(0.1)
        text = _get(d.url + "/metrics")[1].decode()
        for proc, log in procs:
            want_kernels, want_bytes, graphs = cuda_log_counts(log)
            got = series(text, "profinfer_cuda_kernel_launches_total", proc.pid, "kernel")
            assert {k: int(v) for k, v in got.items()} == dict(want_kernels), d.text()
            got_bytes = series(text, "profinfer_cuda_copy_bytes_total", proc.pid, "kind")
            assert {k: int(v) for k, v in got_bytes.items()} == dict(want_bytes)
            assert series(text, "profinfer_cuda_graph_launches_total", proc.pid, None) == {"": graphs}
        # the same launches by OTLP, under OpenTelemetry eBPF Instrumentation's names
        for proc, log in procs:
            want_kernels, _, graphs = cuda_log_counts(log)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                got, got_graphs = {}, 0
                for dp in receiver.points("gpu.cuda.kernel.launch.calls"):
                    a = _attrs(dp)
                    if a["process.pid"] == proc.pid:
                        got[a["cuda.kernel.name"]] = got.get(a["cuda.kernel.name"], 0) + dp.as_int
                got_graphs = sum(dp.as_int for dp in receiver.points("gpu.cuda.graph.launch.calls")
                                 if _attrs(dp)["process.pid"] == proc.pid)
                if got == dict(want_kernels) and got_graphs == graphs:
                    break
                time.sleep(0.3)
            assert (got, got_graphs) == (dict(want_kernels), graphs)
        # its last process gone, the object goes
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if not any(g["engine"] == "CUDA" for g in json.loads(_get(d.url + "/status")[1])["shared_probes"]):
                break
            time.sleep(0.2)
        assert not any(g["engine"] == "CUDA" for g in json.loads(_get(d.url + "/status")[1])["shared_probes"])
    finally:
        d.stop()
        receiver.close()


def calls_until_stopped(program: Path, tmp_path: Path, d: Daemon, level: str) -> tuple[subprocess.Popen, Path]:
    """The program started, watched at `level` (15 s at most), then making its calls until
    the returned file exists."""
    go, stop = tmp_path / "go", tmp_path / "stop"
    proc = subprocess.Popen([str(program), "--log", "/dev/null", "--until", str(stop),
                             "--start-after", str(go)], stdout=subprocess.PIPE, text=True)
    _STARTED.append(proc)
    assert proc.stdout.readline().startswith("ready ")
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and level not in d.watched(proc.pid)["levels"]:
        time.sleep(0.1)
    go.write_text("")
    return proc, stop


def test_the_cuda_level_is_charged_and_its_detail_stepped_down(tmp_path):
    """A program that makes CUDA calls without a pause and runs no engine (watched at the cuda
    level alone): the governor charges it the cuda level's cost, finds it over the budget (a
    call every few microseconds), and takes its per-call detail away; its launches are then
    counted by function alone, and every launch is still counted: as many as its own log
    says one repeat makes, times the repeats it says it made. It runs until stepped down
    (however long the governor's judgments take on a loaded machine), then a while longer."""
    program = workload.build_program(PROGRAM, "shared")
    one = tmp_path / "one.jsonl"
    subprocess.run([str(program), "--log", str(one), "--repeat", "1"], check=True, stdout=subprocess.DEVNULL)
    per_repeat = sum(cuda_log_counts(one)[0].values())
    d = Daemon(tmp_path)
    try:
        proc, stop = calls_until_stopped(program, tmp_path, d, "cuda-detail")
        assert d.watched(proc.pid)["levels"] == ["cuda", "cuda-detail"], d.text()
        stepped = f"PID {proc.pid}: levels cuda,cuda-detail -> cuda (costs"
        charged, deadline = None, time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None and stepped not in d.text():
            info = d.watched(proc.pid)
            if info["cost_by_level"]:        # judged (its cost by level; kept across a change)
                charged = info
            time.sleep(0.2)
        assert stepped in d.text(), d.text()
        charged = d.watched(proc.pid) if charged is None else charged
        assert charged["cost_by_level"]["cuda"] > 0, charged
        time.sleep(1.0)                      # launches counted by function alone
        stop.write_text("")
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0
        repeats = int(out.split()[-1])
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and proc.pid in {
                p["pid"] for p in json.loads(_get(d.url + "/status")[1])["processes"]}:
            time.sleep(0.1)
        got = series(_get(d.url + "/metrics")[1].decode(), "profinfer_cuda_kernel_launches_total", proc.pid, "kernel")
        assert got.get("(per-call detail off)", 0) > 0, got
        assert sum(int(v) for v in got.values()) == per_repeat * repeats, (got, repeats)
    finally:
        d.stop()


def test_a_sync_trigger_fires_on_the_programs_syncs(tmp_path):
    """The flight recorder's `sync` quantity: a trigger on the cuda level's sync time fires on
    a program's real synchronising calls (they fail at once without a driver, but enter the
    runtime's functions), and its value is a sync call's time: above 0 and no more than the
    program's own timing of its syncs (around each call, the probes' traps included)."""
    program = workload.build_program(PROGRAM, "shared")
    store = tmp_path / "captures"
    d = Daemon(tmp_path, ("--trigger", "sync_p50 > 1ns", "--record-for", "1s", "--captures-dir", str(store),
                          "--capture-levels", "cuda"))
    try:
        proc, stop = calls_until_stopped(program, tmp_path, d, "cuda")
        caps, deadline = [], time.monotonic() + 60
        while time.monotonic() < deadline and not caps:
            caps = json.loads(_get(d.url + "/captures", d.token)[1])["captures"]
            time.sleep(0.5)
        stop.write_text("")
        out, _ = proc.communicate(timeout=30)
    finally:
        d.stop()
    assert caps, d.text()
    fired = caps[0]["fired"]
    syncs = next(line.split() for line in out.splitlines() if line.startswith("syncs "))
    own_mean_s = int(syncs[2]) / int(syncs[1]) / 1e9
    # seven samples all beyond resolve a median at 99% (0.5 ** 7 < 0.01): no fewer fire it
    assert (fired["reason"], fired["unit"], fired["window_samples"] >= 7) == ("sync_p50", "s", True), fired
    assert 0 < fired["value"] <= own_mean_s, (fired, own_mean_s)

