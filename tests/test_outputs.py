"""Where a run's results go: the report whole on a pipe, output paths checked before a run and
never lost after it, and record's exit status that of the command it ran."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from conftest import (PROFINFER, Target, completion_cmd, endless_cmd, run_profinfer,
                      start_profinfer)
from test_errors import one_line_error


@pytest.fixture
def pipe_env(llama_env):
    """The environment without a width hint: rich's own default off a terminal is 80 columns."""
    return {k: v for k, v in llama_env.items() if k not in ("COLUMNS", "LINES")}


def table_rows(text: str, title: str) -> list[list[str]]:
    """Body rows of the rich table printed under `title`, as stripped cells."""
    lines = text.splitlines()
    start = next(i for i, l in enumerate(lines) if l.startswith(title))
    rows = []
    for line in lines[start + 1:]:
        if line.startswith("└"):
            break
        if line.startswith("│"):
            rows.append([c.strip() for c in line.strip("│").split("│")])
    return rows


def assert_report_whole(text: str, summary: dict) -> None:
    assert "…" not in text, text
    ops = table_rows(text, "Operators")
    # One line per op: a row cut to fit would wrap onto lines with an empty first cell.
    assert [r[0] for r in ops] == [o["op"] for o in summary["ops"]]
    assert all(len(r) == 7 and all(r) for r in ops)
    assert [r[1] for r in ops] == [f"{o['count']:,}" for o in summary["ops"]]
    phases = {r[0]: r for r in table_rows(text, "Phases")}
    assert set(phases) == {"prefill", "decode"}
    for phase in ("prefill", "decode"):
        assert phases[phase][2] == f"{summary['tokens'][phase]:,}"
    tids = [r[0] for r in table_rows(text, "Threads")]
    assert tids == [str(t["tid"]) for t in summary["threads"]]


def test_report_on_a_pipe_is_not_cut(llama_build, tiny_model, pipe_env, tmp_path):
    trace = tmp_path / "run.pftrace"
    r = run_profinfer(["record", "--levels", "token,graph,op", "-o", str(trace), "--",
                       *completion_cmd(llama_build, tiny_model, n=16)],
                      env=pipe_env, tmp_path=tmp_path)
    assert r.rc == 0, r.stderr
    assert r.summary["tokens"]["decode"] > 0
    assert_report_whole(r.stdout, r.summary)

    # `profinfer report TRACE | cat` and `profinfer graph TRACE | cat`
    report = subprocess.run([*PROFINFER, "report", str(trace)], capture_output=True, text=True,
                            env=pipe_env, timeout=120)
    assert report.returncode == 0, report.stderr
    assert_report_whole(report.stdout, r.summary)
    graph = subprocess.run([*PROFINFER, "graph", str(trace)], capture_output=True, text=True,
                           env=pipe_env, timeout=120)
    assert graph.returncode == 0, graph.stderr
    assert "…" not in graph.stdout
    nodes = int(graph.stdout.split(" nodes,")[0].rsplit(" ", 1)[1])
    rows = [l for l in graph.stdout.splitlines() if l.startswith("│")]
    # One line per node, numbered in graph order, every cell filled.
    cells = [[c.strip() for c in l.strip("│").split("│")] for l in rows[1:]]
    assert 0 < len(cells) <= nodes
    assert all(len(c) == 9 and all(c) for c in cells)
    assert [int(c[0]) for c in cells] == sorted(int(c[0]) for c in cells)


MISSING = "/nonexistent-dir/sub"


@pytest.mark.parametrize("option,name", [("-o", "x.pftrace"), ("--json", "x.json")])
def test_unwritable_output_refused_before_record_runs(llama_build, tiny_model, llama_env,
                                                      option, name):
    started = time.monotonic()
    p = subprocess.run([*PROFINFER, "record", option, f"{MISSING}/{name}", "--",
                        *completion_cmd(llama_build, tiny_model, n=8)],
                       capture_output=True, text=True, env=llama_env, timeout=120)
    # One line on stderr and nothing on stdout: llama.cpp, had it run, would have logged to
    # stderr and printed its text to stdout.
    msg = one_line_error(p)
    assert f"{MISSING}/{name}" in msg and "No such file or directory" in msg
    assert p.stdout == ""
    assert time.monotonic() - started < 10


def test_unwritable_output_refused_before_attach(llama_build, tiny_model, llama_env):
    target = Target(endless_cmd(llama_build, tiny_model), llama_env)
    try:
        started = time.monotonic()
        p = subprocess.run([*PROFINFER, "attach", "--pid", str(target.proc.pid), "--duration", "30",
                            "--json", f"{MISSING}/x.json"], capture_output=True, text=True, timeout=120)
        assert f"{MISSING}/x.json" in one_line_error(p)
        assert time.monotonic() - started < 10      # refused, not profiled for 30 s
        assert target.still_generating()
    finally:
        target.stop()


def test_unwritable_output_refused_before_demo(tmp_path):
    p = subprocess.run([*PROFINFER, "demo", "-o", f"{MISSING}/demo.pftrace"], capture_output=True,
                       text=True, timeout=120, cwd=tmp_path)
    assert f"{MISSING}/demo.pftrace" in one_line_error(p)
    assert not list(tmp_path.iterdir())


def same_outputs_as(a: dict, b: dict) -> None:
    for key in ("decode_calls", "tokens", "lost_events"):
        assert a[key] == b[key], key
    assert [(o["op"], o["count"]) for o in a["ops"]] == [(o["op"], o["count"]) for o in b["ops"]]


def rescued(stderr: str, option: str, path: str, rescue_dir: Path) -> Path:
    """The one error line for a failed output, and the file it says the output went to."""
    errors = [l for l in stderr.splitlines() if l.startswith("profinfer: error")]
    assert len(errors) == 1, stderr
    assert "Traceback" not in stderr
    line = errors[0]
    assert line.startswith(f"profinfer: error: cannot write {option} {path} ("), line
    saved = Path(line.rsplit(" is saved in ", 1)[1])
    assert saved.parent == rescue_dir and saved.name.startswith("profinfer-unsaved-")
    assert saved.stat().st_size > 0
    return saved


def report_json(trace: Path, tmp_path: Path) -> dict:
    """`profinfer report --json` of a saved trace."""
    again = tmp_path / "again.json"
    rep = subprocess.run([*PROFINFER, "report", str(trace), "--json", str(again)],
                         capture_output=True, text=True, timeout=120)
    assert rep.returncode == 0, rep.stderr
    return json.loads(again.read_text())


def test_timeline_that_cannot_be_written_is_saved_elsewhere(llama_build, tiny_model, llama_env,
                                                            tmp_path):
    rescue = tmp_path / "rescue"
    rescue.mkdir()
    env = {**llama_env, "TMPDIR": str(rescue)}
    # /dev/full opens for writing, and every write to it fails: a full disk, after the check.
    r = run_profinfer(["record", "-o", "/dev/full", "--",
                       *completion_cmd(llama_build, tiny_model, n=12)], env=env, tmp_path=tmp_path)
    assert r.rc == 1
    assert r.summary["tokens"]["decode"] > 0
    saved = rescued(r.stderr, "-o", "/dev/full", rescue)
    assert saved.suffix == ".pftrace"
    same_outputs_as(report_json(saved, tmp_path), r.summary)


def test_summary_that_cannot_be_written_is_saved_elsewhere(llama_build, tiny_model, llama_env,
                                                           tmp_path):
    rescue = tmp_path / "rescue"
    rescue.mkdir()
    trace = tmp_path / "run.pftrace"
    p = subprocess.run([*PROFINFER, "record", "-o", str(trace), "--json", "/dev/full", "--",
                        *completion_cmd(llama_build, tiny_model, n=12)], capture_output=True,
                       text=True, timeout=300, env={**llama_env, "TMPDIR": str(rescue)})
    assert p.returncode == 1
    saved = rescued(p.stderr, "--json", "/dev/full", rescue)
    assert saved.suffix == ".json"
    summary = json.loads(saved.read_text())
    assert summary["tokens"]["decode"] > 0
    same_outputs_as(summary, report_json(trace, tmp_path))


def test_attach_output_dir_removed_meanwhile(llama_build, tiny_model, llama_env, tmp_path):
    rescue, out_dir = tmp_path / "rescue", tmp_path / "out"
    rescue.mkdir()
    out_dir.mkdir()
    target = Target(endless_cmd(llama_build, tiny_model), llama_env)
    try:
        # its token and graph levels: what the rescued trace is checked for, without 2 s of ops to write
        p = start_profinfer(["attach", "--pid", str(target.proc.pid), "--duration", "2", "--levels", "token,graph",
                             "-o", str(out_dir / "x.pftrace")], env={**os.environ, "TMPDIR": str(rescue)})
        out_dir.rmdir()      # empty: the check before attaching left nothing there
        stdout, stderr = p.communicate(timeout=120)
    finally:
        target.stop()
    assert p.returncode == 1
    saved = rescued(p.early_stderr + stderr, "-o", str(out_dir / "x.pftrace"), rescue)
    assert report_json(saved, tmp_path)["tokens"]["decode"] > 0


def test_record_exits_with_the_commands_status(llama_build, tiny_model, llama_env, tmp_path):
    cmd = completion_cmd(llama_build, tmp_path / "missing.gguf", n=8)
    truth = subprocess.run(cmd, capture_output=True, env=llama_env, timeout=120).returncode
    assert truth != 0
    r = run_profinfer(["record", "--", *cmd], env=llama_env, tmp_path=tmp_path)
    assert r.rc == truth, r.stderr
    assert r.summary is not None and r.summary["decode_calls"] == 0   # outputs still written
    assert f"exited with status {truth}" in r.stderr


def test_record_of_a_killed_command_exits_128_plus_signal(llama_build, tiny_model, llama_env,
                                                          tmp_path):
    summary, trace = tmp_path / "s.json", tmp_path / "run.pftrace"
    p = start_profinfer(["record", "--json", str(summary), "-o", str(trace), "--",
                         *endless_cmd(llama_build, tiny_model)], env=llama_env)
    try:
        (child,) = psutil.Process(p.pid).children()
        time.sleep(1.5)      # generating
        child.send_signal(signal.SIGKILL)
        p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 128 + signal.SIGKILL
    data = json.loads(summary.read_text())
    assert data["tokens"]["decode"] > 0 and trace.stat().st_size > 0
