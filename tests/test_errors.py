"""Acceptance 5: bad input ends with one clear line and a non-zero exit, never a traceback."""
from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import PROFINFER, completion_cmd


def one_line_error(p: subprocess.CompletedProcess, child_output: bool = False) -> str:
    """The single error line; with child_output, stderr also carries the recorded command's
    own log, so only profinfer's lines are counted."""
    assert p.returncode != 0
    assert "Traceback" not in p.stderr
    lines = [l for l in p.stderr.splitlines() if l.strip()]
    if child_output:
        lines = [l for l in lines if l.startswith("profinfer: error")]
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith("profinfer: error: ")
    return lines[0]


def run(args, **kw):
    return subprocess.run([*PROFINFER, *args], capture_output=True, text=True, timeout=120, **kw)


def test_nonexistent_pid():
    assert "no process with PID 4194304" in one_line_error(run(["attach", "--pid", "4194304"]))


def test_pid_without_llama():
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        msg = one_line_error(run(["attach", "--pid", str(sleeper.pid), "--duration", "1"]))
        assert "no known engine in process" in msg
    finally:
        sleeper.kill()
        sleeper.wait()


def test_not_root(tmp_path):
    # setpriv drops to nobody; the package must stay importable for that user.
    p = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                        sys.executable, "-m", "profinfer.cli", "attach", "--pid", "1"],
                       capture_output=True, text=True, timeout=60, cwd="/")
    assert "needs root" in one_line_error(p)


def test_unknown_tensor_layout(llama_build, tiny_model, llama_env):
    # A layout from the table that does not fit this build: validation on live data must
    # refuse it instead of printing garbage.
    p = run(["record", "--tensor-layout", "ggml-2024.06", "--",
             *completion_cmd(llama_build, tiny_model, n=8)], env=llama_env)
    assert "unknown ggml_tensor layout" in one_line_error(p, child_output=True)


def test_corrupt_trace(tmp_path):
    bad = tmp_path / "bad.pftrace"
    bad.write_bytes(b"\x0a\xff\xff\xff\x0fnot a trace at all" * 10)
    assert str(bad) in one_line_error(run(["report", str(bad)]))


def test_missing_trace(tmp_path):
    assert "no such file" in one_line_error(run(["report", str(tmp_path / "none.pftrace")]))


@pytest.mark.parametrize("args", [["attach", "--pid", "1", "--bogus"], ["attach"],
                                  ["attach", "--pid", "1", "--levels", "token,frobs"],
                                  ["attach", "--pid", "1", "--counters", "cycles,frobs"],
                                  ["attach", "--pid", "1", "--counters", "a,b,c,d,e"],
                                  ["frobnicate"]])
def test_bad_options(args):
    one_line_error(run(args))
