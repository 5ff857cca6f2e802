"""Acceptance 4 and the attach path: profile a process mid-generation, stop in every way,
and leave nothing behind (no uprobe, no BPF program), with the target still running."""
from __future__ import annotations

import json
import signal
import time

import pytest

from conftest import (Target, endless_cmd, leftover_uprobe_events, our_bpf_programs,
                      run_profinfer, start_profinfer)


@pytest.fixture
def target(llama_build, tiny_model, llama_env):
    t = Target(endless_cmd(llama_build, tiny_model), llama_env)
    yield t
    t.stop()


def assert_clean(target: Target):
    assert our_bpf_programs() == []
    assert leftover_uprobe_events() == []
    assert target.still_generating(), "the target must keep running after we detach"


def test_attach_mid_generation_with_duration(target, tmp_path):
    r = run_profinfer(["attach", "--pid", str(target.proc.pid), "--duration", "2", "--quiet"],
                      tmp_path=tmp_path)
    assert r.rc == 0, r.stderr
    s = r.summary
    assert s["tokens"]["decode"] > 10
    assert {o["op"] for o in s["ops"]} >= {"MUL_MAT", "ROPE", "GET_ROWS"}
    assert s["lost_events"] == 0
    assert_clean(target)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_stop_by_signal(target, tmp_path, sig):
    out = tmp_path / "s.json"
    trace = tmp_path / "t.pftrace"
    p = start_profinfer(["attach", "--pid", str(target.proc.pid), "--quiet", "--json", str(out),
                         "-o", str(trace)])
    time.sleep(1.0)
    p.send_signal(sig)
    p.wait(timeout=60)
    assert p.returncode == 0, p.stderr.read()
    assert json.loads(out.read_text())["tokens"]["decode"] > 0
    rep = run_profinfer(["report", str(trace)], json_summary=False)
    assert rep.rc == 0 and "MUL_MAT" in rep.stdout
    assert_clean(target)


def test_target_exit_ends_profiling(llama_build, tiny_model, llama_env, tmp_path):
    from conftest import completion_cmd
    t = Target(completion_cmd(llama_build, tiny_model, n=6000,
                              extra=("--context-shift", "--ignore-eos", "-c", "256")), llama_env)
    out = tmp_path / "s.json"
    p = start_profinfer(["attach", "--pid", str(t.proc.pid), "--quiet", "--json", str(out)])
    t.proc.wait(timeout=300)
    p.wait(timeout=60)
    assert p.returncode == 0
    assert json.loads(out.read_text())["tokens"]["decode"] > 0
    assert our_bpf_programs() == [] and leftover_uprobe_events() == []


def test_kill_9_leaves_nothing(target):
    """Every kind of attachment: uprobes, raw tracepoints (sched), per-CPU perf counters."""
    p = start_profinfer(["attach", "--pid", str(target.proc.pid), "--quiet",
                         "--levels", "token,graph,op,sched", "--counters", "task-clock"])
    progs = our_bpf_programs()
    assert "op_start" in progs and "sched_switch" in progs   # the check below can see them
    p.kill()
    p.wait()
    deadline = time.time() + 10
    while our_bpf_programs() and time.time() < deadline:
        time.sleep(0.1)
    assert_clean(target)
