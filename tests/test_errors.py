"""Bad input ends with one clear line and a non-zero exit, never a traceback."""
from __future__ import annotations

import os
import select
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import PROFINFER, completion_cmd
from profinfer.core.profile.model import GraphCall, OpSlice, Profile, TokenCall
from profinfer.exporters.perfetto import write_perfetto


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


def run(args, timeout=120, **kw):
    return subprocess.run([*PROFINFER, *args], capture_output=True, text=True, timeout=timeout, **kw)


def without_token() -> dict:
    """This environment without PROFINFER_TOKEN: a token file is read only where it is unset."""
    return {k: v for k, v in os.environ.items() if k != "PROFINFER_TOKEN"}


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
    msg = one_line_error(run(["report", str(tmp_path / "none.pftrace")]))
    assert "cannot read" in msg and "No such file" in msg, msg


@pytest.fixture
def trace(tmp_path) -> Path:
    """A small valid trace (one decode call of one matmul), written as record writes one."""
    path = tmp_path / "t.pftrace"
    ops = [OpSlice(1, 0, 0, 1000, 1000, "MUL_MAT", "x-0", (8, 1, 1, 1), "f32", 0xC, srcs=(0xA, 0xB),
                   src_views=(0, 0), src_ne=((8, 8, 1, 1), (8, 1, 1, 1)), src_dtypes=("f32", "f32"))]
    write_perfetto(Profile(pid=1, graphs=[GraphCall(1, 0, 2000, "CPU", 1)], ops=ops,
                           tokens=[TokenCall(1, 0, 2000, 1, False)]), path)
    return path


@pytest.fixture
def fifo(tmp_path) -> Path:
    """A FIFO nothing writes to or reads from: opening it plainly, either way, waits for ever."""
    path = tmp_path / "fifo.pftrace"
    os.mkfifo(path)
    return path


def test_inputs_that_are_not_regular_files_are_refused_at_once(trace, fifo, tmp_path):
    """A FIFO or a device where a trace, a pack or a token is read: one line at once (run's
    timeout fails a wait), never a read without end; diff says 2 (no run to compare)."""
    pack = tmp_path / "fifo.toml"
    os.mkfifo(pack)
    for args, code in ((["report", str(fifo)], 1), (["report", "/dev/zero"], 1), (["graph", str(fifo)], 1),
                       (["diff", str(trace), str(fifo)], 2), (["diff", str(trace), f"{trace},{tmp_path}"], 2),
                       (["record", "--pack", str(pack), "--", "true"], 1),
                       (["capture", "-p", "1", "-o", str(tmp_path / "c"), "--token-file", str(fifo)], 1),
                       (["capture", "-p", "1", "-o", str(tmp_path / "c"), "--token-file", "/dev/zero"], 1)):
        p = run(args, timeout=30, env=without_token())
        assert p.returncode == code, (args, p.stderr)
        assert "not a regular file" in one_line_error(p), args


def test_a_fifo_with_a_reader_gets_the_whole_output(trace, tmp_path):
    """Checked writable first, a FIFO whose reader is waiting still gets the graph whole: the
    check's descriptor stays open, or its close would end the reader's input first (the
    graph, a few hundred bytes, fits the pipe's buffer: read once the command ended)."""
    fifo = tmp_path / "g.dot"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        p = run(["graph", str(trace), "-o", str(fifo)], timeout=60)
        assert p.returncode == 0, p.stderr
        got = b""
        while chunk := os.read(reader, 65536):
            got += chunk
    finally:
        os.close(reader)
    assert got.startswith(b"digraph") and got.rstrip().endswith(b"}"), got


def test_outputs_that_cannot_be_written_are_refused_before_any_work(trace, fifo, tmp_path):
    for args in (["graph", str(trace), "-o", str(fifo)], ["graph", str(trace), "-o", str(tmp_path / "no" / "g.dot")],
                 ["capture", "-p", "1", "-o", str(fifo)]):
        assert "cannot write -o" in one_line_error(run(args, timeout=30)), args


@pytest.mark.parametrize("args", [["record", "--duration", "inf", "--", "true"],
                                  ["record", "--duration", "nan", "--", "true"],
                                  ["diff", "--confidence", "nan", "a", "b"],
                                  ["capture", "-p", "1", "--seconds", "nan", "-o", "x"],
                                  ["daemon", "--budget", "nan"], ["daemon", "--otlp-interval", "nan"]])
def test_numbers_that_are_not_finite_are_refused(args):
    assert "is not a finite number" in one_line_error(run(args))


def test_diff_says_74_for_an_output_it_cannot_write(trace, tmp_path):
    p = run(["diff", "--json", "/dev/full", str(trace), str(trace)])       # opens, then ENOSPC
    assert "cannot write /dev/full" in one_line_error(p) and p.returncode == 74, p.stderr
    p = run(["diff", "--html", str(tmp_path / "no" / "d.html"), str(trace), str(trace)])
    assert "cannot write --html" in one_line_error(p) and p.returncode == 74, p.stderr


def test_diff_says_2_for_bad_input_never_a_failed_gate(trace, tmp_path):
    (tmp_path / "runs" / "sub.pftrace").mkdir(parents=True)
    for args in ([str(trace), str(tmp_path / "none.pftrace")], [str(trace), str(tmp_path / "runs")],
                 ["--noise", "abc", str(trace), str(trace)], ["--fail-above", "x=", str(trace), str(trace)]):
        p = run(["diff", "--fail-above", "5%", *args])
        one_line_error(p)
        assert p.returncode == 2, (args, p.stderr)


def test_a_trace_whose_names_are_not_text(trace, tmp_path):
    """One byte of an interned op name flipped (it stays framed protobuf): refused, not drawn."""
    data = trace.read_bytes()
    assert data.count(b"MUL_MAT") >= 1
    bad = tmp_path / "bad.pftrace"
    bad.write_bytes(data.replace(b"MUL_MAT", b"MUL\xc8MAT"))
    for command in ("report", "graph"):
        assert "not UTF-8 text" in one_line_error(run([command, str(bad)])), command


def test_tokens_that_cannot_be_sent(tmp_path):
    token = tmp_path / "token"
    token.write_bytes(b"\xff\xfe")
    token.chmod(0o600)
    assert "is not text" in one_line_error(run(["capture", "-p", "1", "-o", str(tmp_path / "c"),
                                                "--token-file", str(token)], env=without_token()))
    p = run(["capture", "-p", "1", "-o", str(tmp_path / "c")], env={**os.environ, "PROFINFER_TOKEN": "a\nb"})
    assert "PROFINFER_TOKEN holds characters a token cannot have" in one_line_error(p)


def test_what_answers_at_the_url_but_is_no_daemon(tmp_path):
    """A listener that is not the daemon (a user's, while it restarts): an HTML error page, or
    JSON of another shape; each is one line."""
    (tmp_path / "status").write_text('{"pid": 1}')
    server = subprocess.Popen([sys.executable, "-u", "-m", "http.server", "--bind", "127.0.0.1", "0"],
                              cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        ready = select.select([server.stdout], [], [], 30)[0]
        assert ready, "http.server did not say its port"
        port = int(server.stdout.readline().split(" port ")[1].split()[0])
        url = f"http://127.0.0.1:{port}"
        assert "did not answer as a profinfer daemon does" in one_line_error(run(["status", "--url", url]))
        assert "the daemon answered 404" in one_line_error(run(["status", "--url", url + "/missing"]))
    finally:
        server.kill()
        server.wait()
    pem = tmp_path / "bad.pem"
    pem.write_text("not a certificate")
    assert "not a PEM CA certificate" in one_line_error(run(["status", "--url", "https://127.0.0.1:9",
                                                             "--cacert", str(pem)]))


_PACK = "engine='x'\nbpf='y'\nlibraries=['a']\ndecoder='z'\n"


@pytest.mark.parametrize("text, says", [
    ("engine='x'\nbpf='y'\nlibraries=3\ndecoder='z'\n", "libraries must be"),
    (_PACK + "[[probe]]\nfunction='f'\n", "each [[probe]] is a table with a level"),
    (_PACK + "[[probe]]\nlevel='op'\n", "names a function or a pattern"),
    (_PACK + "[[probe]]\nlevel='op'\nfunction='f'\npattern='g'\n", "names a function or a pattern"),
    (_PACK + "[[probe]]\nlevel='op'\npattern='('\n", "is no regular expression"),
    (_PACK + "[[probe]]\nlevel='op'\nfunction=''\n", "names a function or a pattern"),
    (_PACK + "[[probe]]\nlevel='op'\npattern='g'\ncallers='h'\n", "callers (a pattern, as text) go with a function"),
    (_PACK + "[[probe]]\nlevel='op'\nfunction='f'\ncallers='('\n", "is no regular expression"),
    (_PACK + "[[probe]]\nlevel='op'\nfunction='f'\nargs='abc'\n", "args are a list"),
    (_PACK + "[[probe]]\nlevel='op'\nfunction='f'\nargs=[7]\n", "argument numbers, 1 to 6")])
def test_probe_packs_of_the_wrong_shape(tmp_path, text, says):
    pack = tmp_path / "p.toml"
    pack.write_text(text)
    assert says in one_line_error(run(["record", "--pack", str(pack), "--", "true"]))
    pack.write_bytes(b"\x80\x81 not text")
    assert "not UTF-8 text" in one_line_error(run(["record", "--pack", str(pack), "--", "true"]))


@pytest.mark.parametrize("plugin, pack, says", [
    ('bpf="dup.bpf.c", collector="collector:C"', 'bpf = "other.bpf.c"\nlibraries = ["libdup.so"]\n',
     "bpf in its pack.toml: its plugin (dupplugin.PLUGIN) declares them"),
    ('', 'libraries = ["libdup.so"]\n', "a pack.toml, but no bpf or collector in its PLUGIN")],
    ids=["declared twice", "declared nowhere"])
def test_a_plugins_pack_declares_only_the_binaries_facts(tmp_path, plugin, pack, says):
    """A bundled pack's program and collector are its plugin's: in its pack.toml too, or in
    neither, is one clear line."""
    (tmp_path / "dupplugin").mkdir()
    (tmp_path / "dupplugin" / "__init__.py").write_text(
        "from profinfer.core.base.registry import Engine\n"
        f"PLUGIN = Engine('dupplugin', __name__, title='dup'{', ' + plugin if plugin else ''})\n")
    (tmp_path / "dupplugin" / "pack.toml").write_text(pack)
    env = {**os.environ, "PROFINFER_PLUGINS": "dupplugin",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    assert says in one_line_error(run(["record", "--pack", "dupplugin", "--", "true"], env=env))


@pytest.mark.parametrize("env", [{"PROFINFER_PLUGINS": ":"}, {"PROFINFER_PLUGINS": ".relative"}])
def test_environment_values_that_name_nothing(trace, env):
    assert "cannot load it" in one_line_error(run(["report", str(trace)], env={**os.environ, **env}))


def test_a_daemon_setting_in_the_environment_that_is_no_number():
    p = run(["daemon"], env={**os.environ, "PROFINFER_SERIES_TTL_S": "abc"})
    assert "PROFINFER_SERIES_TTL_S='abc'" in one_line_error(p)


@pytest.mark.parametrize("args,said", [
    (["--trigger", "call_p99.9 > 1s"], "p99.6 or below"),
    (["--trigger", "tpot_p99 > 3x baseline", "--trigger-window", "0s"], "--trigger-window '0s'"),
    (["--trigger", "tpot_p99 > 3x baseline", "--trigger-baseline", "soon"], "--trigger-baseline 'soon'")])
def test_flight_recorder_settings_that_cannot_be_met(args, said):
    assert said in one_line_error(run(["daemon", *args]))


@pytest.mark.parametrize("args", [["attach", "--pid", "1", "--bogus"], ["attach"],
                                  ["attach", "--pid", "1", "--levels", "token,frobs"],
                                  ["attach", "--pid", "1", "--counters", "cycles,frobs"],
                                  ["attach", "--pid", "1", "--counters", "a,b,c,d,e"],
                                  ["frobnicate"]])
def test_bad_options(args):
    one_line_error(run(args))
