"""Churn: llama.cpp processes start and end while the daemon runs (five at a time; in
each wave one is killed with SIGKILL before it decodes and one while it decodes). Each is
found, served by the one set of probes on their build's files, and the ones that finish are
counted as llama.cpp counts itself; the daemon's fds,
BPF objects and memory are the same after the last wave as after the first; nothing is
left in the kernel after it stops."""
from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import _fds, llama_perf
from daemon_helpers import PROFINFER, Daemon, Workload, _get, kill_started


@pytest.fixture(autouse=True)
def _no_workload_left():
    yield
    kill_started()


WAVES, PER_WAVE = 3, 5


def _footprint(pid: int) -> dict[str, int]:
    fds = _fds(pid)
    rss = next(int(l.split()[1]) for l in Path(f"/proc/{pid}/status").read_text().splitlines()
               if l.startswith("VmRSS:"))
    # sockets left out: the HTTP connection of the last request may still be closing
    return {"fds": sum(1 for t, _ in fds if not t.startswith("socket:")),
            "bpf_fds": sum(1 for t, _ in fds if t.startswith("anon_inode:bpf")),
            "perf_fds": sum(1 for t, _ in fds if t == "anon_inode:[perf_event]"), "rss_kb": rss}


def _idle(d: Daemon, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not json.loads(_get(d.url + "/status")[1])["processes"]:
            return
        time.sleep(0.1)
    raise AssertionError(f"processes still watched after they exited: {_get(d.url + '/status')[1][:2000]!r}\n"
                         + d.text()[-3000:])


def _tokens(d: Daemon) -> dict[int, int]:
    out = {}
    for line in _get(d.url + "/metrics")[1].decode().splitlines():
        if line.startswith("profinfer_tokens_total{") and 'phase="decode"' in line:
            pid = int(line.split('pid="', 1)[1].split('"', 1)[0])
            out[pid] = int(float(line.rsplit(" ", 1)[1]))
    return out


def test_churn_keeps_the_daemon_flat(tmp_path, llama_build, tiny_model, llama_env, bpf_watch):
    """WAVES waves here; tests/soak runs ten (50 processes)."""
    churn_keeps_the_daemon_flat(tmp_path, llama_build, tiny_model, llama_env, bpf_watch, WAVES)


def churn_keeps_the_daemon_flat(tmp_path, llama_build, tiny_model, llama_env, bpf_watch, waves: int) -> None:
    d = Daemon(tmp_path)
    footprints, finished, killed = [], {}, []
    try:
        for wave in range(waves):
            ws = [Workload(llama_build, tiny_model, llama_env, tmp_path, n=24) for _ in range(PER_WAVE)]
            for w in ws:
                d.watched(w.proc.pid)           # each one found
            # one build: one set of probes serves the wave (a process joins a BPF map)
            groups = [g for g in json.loads(_get(d.url + "/status")[1])["shared_probes"]
                      if g["engine"] == "llama.cpp"]
            assert len(groups) == 1 and {w.proc.pid for w in ws} <= set(groups[0]["processes"]), groups
            if wave == 0:
                out = subprocess.run(PROFINFER + ["status", "--url", d.url], capture_output=True, text=True).stdout
                assert f"shared by {len(groups[0]['processes'])} process(es): llama.cpp" in out, out
            ws[0].proc.send_signal(signal.SIGKILL)    # before it decodes
            killed.append(ws[0].proc.pid)
            for w in ws[1:]:
                w.go()
            time.sleep(0.02)
            ws[1].proc.send_signal(signal.SIGKILL)    # while it decodes (or just after)
            killed.append(ws[1].proc.pid)
            for w in ws[:2]:
                w.proc.wait(timeout=60)
            for w in ws[2:]:
                finished[w.proc.pid] = llama_perf(w.finish())
            _idle(d)
            footprints.append(_footprint(d.proc.pid))
        counted = _tokens(d)
    finally:
        d.stop()
    print("daemon footprint after each wave:", footprints)
    first, last = footprints[0], footprints[-1]
    assert (last["fds"], last["bpf_fds"], last["perf_fds"]) == \
        (first["fds"], first["bpf_fds"], first["perf_fds"]), footprints
    # memory: caches fill over the first waves (symbols, DWARF, the allocator's arenas), then
    # stay: the second half of the run grows by less than one wave's first-time cost
    rss = [f["rss_kb"] for f in footprints]
    assert rss[-1] - rss[waves // 2] < 8 * 1024, rss
    for pid, perf in finished.items():
        assert pid in counted, pid
        # llama.cpp's own count (its log drain is preloaded: a missing line is a defect)
        assert "eval" in perf, (pid, "llama.cpp's perf lines missing")
        assert counted[pid] == perf["eval"][1], (pid, counted[pid], perf)
    left = bpf_watch.leftovers(set())
    assert not left, left
