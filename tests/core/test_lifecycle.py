"""The attach path: profile a process mid-generation, stop in every way,
and leave nothing behind (no BPF program, map or link, no perf event), with the target still
running."""
from __future__ import annotations

import ctypes
import json
import os
import signal
import time

import pytest

from conftest import BpfWatch, Target, endless_cmd, open_fds, run_profinfer, start_profinfer


@pytest.fixture
def target(llama_build, tiny_model, llama_env):
    t = Target(endless_cmd(llama_build, tiny_model), llama_env)
    yield t
    t.stop()


def assert_clean(target: Target, watch: BpfWatch):
    assert watch.leftovers({target.proc.pid}) == []
    assert target.still_generating(), "the target must keep running after we detach"


def test_attach_mid_generation_with_duration(target, tmp_path, bpf_watch):
    r = run_profinfer(["attach", "--pid", str(target.proc.pid), "--duration", "2", "--quiet"],
                      tmp_path=tmp_path)
    assert r.rc == 0, r.stderr
    s = r.summary
    assert s["tokens"]["decode"] > 10
    assert {o["op"] for o in s["ops"]} >= {"MUL_MAT", "ROPE", "GET_ROWS"}
    assert s["lost_events"] == 0
    assert_clean(target, bpf_watch)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_stop_by_signal(target, tmp_path, sig, bpf_watch):
    out = tmp_path / "s.json"
    trace = tmp_path / "t.pftrace"
    p = start_profinfer(["attach", "--pid", str(target.proc.pid), "--quiet", "--json", str(out),
                         "-o", str(trace)])
    time.sleep(0.3)         # hundreds of tokens here; the op level's trace is ~30 MB a second
    p.send_signal(sig)
    p.wait(timeout=60)
    assert p.returncode == 0, p.stderr.read()
    assert json.loads(out.read_text())["tokens"]["decode"] > 0
    rep = run_profinfer(["report", str(trace)], json_summary=False)
    assert rep.rc == 0 and "MUL_MAT" in rep.stdout
    assert_clean(target, bpf_watch)


def test_target_exit_ends_profiling(llama_build, tiny_model, llama_env, tmp_path, bpf_watch):
    from conftest import completion_cmd
    t = Target(completion_cmd(llama_build, tiny_model, n=6000,
                              extra=("--context-shift", "--ignore-eos", "-c", "256")), llama_env)
    out = tmp_path / "s.json"
    p = start_profinfer(["attach", "--pid", str(t.proc.pid), "--quiet", "--json", str(out)])
    t.proc.wait(timeout=300)
    p.wait(timeout=60)
    assert p.returncode == 0
    assert json.loads(out.read_text())["tokens"]["decode"] > 0
    assert bpf_watch.leftovers(set()) == []


def test_kill_9_leaves_nothing(target, bpf_watch):
    """Every kind of attachment: uprobes, raw tracepoints (sched), per-CPU perf counters."""
    p = start_profinfer(["attach", "--pid", str(target.proc.pid), "--quiet",
                         "--levels", "token,graph,op,sched", "--counters", "task-clock"])
    # the check sees a run that is still attached, through the process that holds it
    attached = "\n".join(bpf_watch.leftovers({p.pid}, wait_s=0))
    for what in ("'op_start'", "'sched_switch'", "'events'", "link"):
        assert what in attached, attached
    p.kill()
    p.wait()
    assert_clean(target, bpf_watch)


def _pidfd_getfd(pid: int, fd: int) -> int:
    """A copy of another process's fd (pidfd_getfd, Linux 5.6)."""
    libc = ctypes.CDLL(None, use_errno=True)
    pidfd = os.pidfd_open(pid)
    try:
        got = libc.syscall(438, pidfd, fd, 0)
        if got < 0:
            raise OSError(ctypes.get_errno(), "pidfd_getfd")
        return got
    finally:
        os.close(pidfd)


def test_leak_check_fails_on_a_link_kept_alive(target, bpf_watch):
    """The leftover check can fail: a copy of one of profinfer's uprobe links, held by this
    process, keeps its program attached to the target after profinfer is killed."""
    p = start_profinfer(["attach", "--pid", str(target.proc.pid), "--quiet", "--levels", "token"])
    links = [fd for fd, what, _ in open_fds(p.pid) if what == "anon_inode:bpf_link"]
    assert links
    kept = _pidfd_getfd(p.pid, int(links[0]))
    try:
        p.kill()
        p.wait()
        leaked = bpf_watch.leftovers({target.proc.pid}, wait_s=1)
        assert any(l.startswith("link ") and f"held by [{os.getpid()}]" in l for l in leaked), leaked
        assert any(l.startswith("prog ") and "token_" in l for l in leaked), leaked
    finally:
        os.close(kept)
    assert_clean(target, bpf_watch)
