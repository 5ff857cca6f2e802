"""`record` on a node where a daemon discovers engines: the daemon sees the recorded process
but never holds it (SIGSTOP/SIGCONT are not counted: the daemon's SIGCONT would let it run
while record attaches). Each record exits 0 and counts every decode call llama.cpp reports:
the engine as the recorded command itself (put in the node's map by record's user space) and
as a shell script's child (put there by the follower's BPF at the fork)."""
from __future__ import annotations

import shlex

import pytest

from conftest import completion_cmd, llama_perf, run_profinfer, with_llama_log
from daemon_helpers import discovering_daemon

RECORDS = 10


@pytest.fixture
def daemon(tmp_path):
    d = discovering_daemon(tmp_path)
    yield d
    d.stop()


@pytest.mark.parametrize("through", ["command"])      # through a script's child: tests/soak/test_soak_discovery.py
def test_records_beside_a_daemon_count_every_decode(through, daemon, llama_build, tiny_model, llama_env, tmp_path):
    cmd = completion_cmd(llama_build, tiny_model, n=8)
    if through == "script":
        script = tmp_path / "run.sh"
        script.write_text(f"#!/bin/sh\n{shlex.join(cmd)}\n")
        script.chmod(0o755)
        cmd = [str(script)]
    for i in range(RECORDS):
        trace = tmp_path / f"run{i}.pftrace"
        r = with_llama_log(lambda: run_profinfer(["record", "--quiet", "-o", str(trace), "--", *cmd],
                                                 env=llama_env, tmp_path=tmp_path))
        assert r.rc == 0, f"record {i}: {r.stderr[-2000:]}\n--- daemon:\n{daemon.text()[-2000:]}"
        perf = llama_perf(r.stderr)
        assert perf["eval"][1] > 0, r.stderr[-2000:]
        assert trace.stat().st_size > 0
        assert r.summary["tokens"]["prefill"] == perf["prompt eval"][1], f"record {i}"
        assert r.summary["tokens"]["decode"] == perf["eval"][1], f"record {i}"
        assert r.summary["lost_events"] == 0
