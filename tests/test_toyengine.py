"""A third engine added without touching profinfer: tests/toyengine/ is an engine kept outside
the tree (PROFINFER_PLUGINS=toyengine), its C library built here with gcc. Its program logs
its own times around each call (a truth outside profinfer); recording, the report, the
Perfetto trace read back and the daemon's metrics must each agree with that log.

Each probe's times must lie between the function's own times and its caller's: a probe fires
after the call and before the function's first clock read, and at its return after its last
one and before the caller's next."""
from __future__ import annotations

import json
import os
import re
import subprocess
import time
import tomllib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

from conftest import run_profinfer  # noqa: E402
from daemon_helpers import _STARTED, Daemon, _get, kill_started, series  # noqa: E402
from test_exporters import check_trace_structure  # noqa: E402

TOY = TESTS / "toyengine"
OP_NAMES = tomllib.loads((TOY / "pack.toml").read_text())["ops"]


@dataclass
class Call:
    """One decode call, or one op call, as the program logged it."""
    what: str                 # "prefill", "decode", or the op's name
    tid: int
    outer: tuple[int, int]    # the caller's clock reads around the call
    inner: tuple[int, int]    # the function's own first and last
    seq: int = -1
    pos0: int = -1
    n_tokens: int = 0

    def holds(self, start: int, end: int) -> bool:
        return self.outer[0] <= start <= self.inner[0] and self.inner[1] <= end <= self.outer[1]


@dataclass
class ToyLog:
    decodes: list[Call]
    ops: list[Call]

    @classmethod
    def read(cls, path: Path) -> "ToyLog":
        decodes, ops, own, inner = [], [], [], {}
        for line in path.read_text().splitlines():
            kind, *f = line.split()
            v = [int(x) for x in f]
            if kind == "opself":
                own.append((v[1], v[2]))
            elif kind == "opcall":
                ops.append(Call(OP_NAMES[v[0]], v[1], (v[2], v[3]), own.pop(0)))
            elif kind == "decode":
                inner[tuple(v[:3])] = (v[3], (v[4], v[5]))
            elif kind == "call":
                tid, own_times = inner.pop(tuple(v[:3]))
                decodes.append(Call("prefill" if v[1] == 0 else "decode", tid, (v[3], v[4]), own_times,
                                    v[0], v[1], v[2]))
        assert not own and not inner, "every call logged by both sides"
        return cls(decodes, ops)

    def sequences(self) -> dict[int, list[Call]]:
        out: dict[int, list[Call]] = {}
        for c in self.decodes:
            out.setdefault(c.seq, []).append(c)
        return out

    def ttft_bounds(self, seq: list[Call]) -> tuple[int, int]:
        """TTFT: the prompt call's own duration at least, its caller's at most."""
        first = seq[0]
        return first.inner[1] - first.inner[0], first.outer[1] - first.outer[0]

    def generation_bounds(self, seq: list[Call]) -> tuple[int, int]:
        """From the prompt call's end to the last call's end (TPOT times the decode tokens)."""
        first, last = seq[0], seq[-1]
        return last.inner[1] - first.outer[1], last.outer[1] - first.inner[1]


@pytest.fixture(scope="module")
def toy(tmp_path_factory) -> Path:
    """The toy engine's library and program, built with gcc."""
    d = tmp_path_factory.mktemp("toy")
    subprocess.run(["gcc", "-O1", "-g", "-shared", "-fPIC", "-o", str(d / "libtoyengine.so"),
                    str(TOY / "program" / "toyengine.c")], check=True)
    subprocess.run(["gcc", "-O1", "-g", "-o", str(d / "toymain"), str(TOY / "program" / "toymain.c"),
                    f"-L{d}", "-ltoyengine", f"-Wl,-rpath,{d}"], check=True)
    return d


@pytest.fixture
def toy_env() -> dict[str, str]:
    """profinfer with the toy engine registered from outside its tree."""
    path = os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PROFINFER_PLUGINS": "toyengine", "PYTHONPATH": path}


def test_profinfer_does_not_name_the_toy_engine():
    """Adding the toy engine touched no file of profinfer's: none names it."""
    root = TESTS.parent / "profinfer"
    named = [str(f) for f in root.rglob("*") if f.is_file() and f.suffix in (".py", ".h", ".c", ".toml")
             and re.search(r"\btoy", f.read_text(), re.I)]
    assert not named


def test_record_report_perfetto(toy, toy_env, tmp_path):
    log, trace = tmp_path / "toy.log", tmp_path / "run.pftrace"
    r = run_profinfer(["record", "-o", str(trace), "--", str(toy / "toymain"), str(log)],
                      env=toy_env, tmp_path=tmp_path)
    assert r.rc == 0, r.stderr
    truth = ToyLog.read(log)
    assert len(truth.decodes) == 18 and len(truth.ops) == 90

    # the JSON summary written by record: tokens and sequences
    s = r.summary
    assert s["meta"]["engine"] == "toy engine"
    # the kernel ran each of the four programs once a call: the cost line counts those runs
    assert int(s["meta"]["cost:bpf_runs"]) == 2 * (len(truth.decodes) + len(truth.ops))
    assert s["decode_calls"] == len(truth.decodes)
    assert s["tokens"] == {"prefill": sum(c.n_tokens for c in truth.decodes if c.what == "prefill"),
                           "decode": sum(c.n_tokens for c in truth.decodes if c.what == "decode")}
    seqs = truth.sequences()
    assert [x["seq"] for x in s["sequence_latency"]] == sorted(seqs)
    for x in s["sequence_latency"]:
        lo, hi = truth.ttft_bounds(seqs[x["seq"]])
        assert lo <= x["ttft_ns"] <= hi
        lo, hi = truth.generation_bounds(seqs[x["seq"]])
        n = x["decode_tokens"]
        assert lo - n <= x["tpot_ns"] * n <= hi + n         # tpot_ns: whole nanoseconds

    # the trace read back by report: the same op counts and the same latency line as record's
    rep = run_profinfer(["report", str(trace)], env=toy_env, tmp_path=tmp_path)
    assert rep.rc == 0, rep.stderr
    counts = Counter(c.what for c in truth.ops)
    for out in (r.stdout, rep.stdout):
        rows = dict(re.findall(r"│ (\w+)\s+│\s+([\d,]+) │", out.split("Phases")[0]))
        assert {k: int(v.replace(",", "")) for k, v in rows.items()} == counts
    latency = [ln for ln in r.stdout.splitlines() if ln.startswith("TTFT")]
    assert latency and latency == [ln for ln in rep.stdout.splitlines() if ln.startswith("TTFT")]
    assert "sequences 2" in latency[0]
    assert rep.summary["sequence_latency"] == s["sequence_latency"]

    # the Perfetto file, read as trace_processor would (not by profinfer's reader): each
    # decode call a slice on its thread, each op a slice inside it, every one where the log
    # puts it
    slices = sorted(check_trace_structure(trace)["slices"], key=lambda x: x["ts"])
    calls = [x for x in slices if x["depth"] == 0]
    ops = [x for x in slices if x["depth"] == 1]
    assert len(calls) == len(truth.decodes) and len(ops) == len(truth.ops)
    for x, c in zip(calls, truth.decodes):
        assert x["name"] == c.what and c.holds(x["ts"], x["ts"] + x["dur"]), (x, c)
        assert x["args"]["n_tokens"] == c.n_tokens
    for x, c in zip(ops, truth.ops):
        assert x["name"] == c.what and c.holds(x["ts"], x["ts"] + x["dur"]), (x, c)


@pytest.fixture
def daemon(tmp_path, toy_env):
    d = Daemon(tmp_path, env=toy_env)
    yield d
    d.stop()
    kill_started()


def _metrics_until(d: Daemon, pid: int, want: dict, timeout: float = 20) -> str:
    """The daemon's /metrics, polled until the process's token series equal want."""
    deadline, text = time.monotonic() + timeout, ""
    while time.monotonic() < deadline:
        text = _get(d.url + "/metrics", d.token)[1].decode()
        if series(text, "profinfer_tokens_total", pid, "phase") == want:
            break
        time.sleep(0.2)
    return text


def test_daemon_metrics(toy, daemon, tmp_path):
    """The daemon finds the toy process by its library, watches it before it decodes (it
    waits for a line on stdin), and exports its tokens, calls and TTFT as its log counts."""
    log = tmp_path / "toy.log"
    proc = subprocess.Popen([str(toy / "toymain"), str(log), "--wait"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    _STARTED.append(proc)
    assert proc.stdout.readline().strip() == "ready"
    watched = daemon.watched(proc.pid)
    assert watched["engine"] == "toy engine", watched
    proc.stdin.write("go\n")
    proc.stdin.close()
    assert proc.wait(timeout=60) == 0
    truth = ToyLog.read(log)
    tokens = Counter()
    for c in truth.decodes:
        tokens[c.what] += c.n_tokens
    text = _metrics_until(daemon, proc.pid, {k: float(v) for k, v in tokens.items()})
    assert series(text, "profinfer_tokens_total", proc.pid, "phase") == tokens, daemon.text()
    assert series(text, "profinfer_decode_calls_total", proc.pid, "phase") == Counter(c.what for c in truth.decodes)
    seqs = truth.sequences()
    assert series(text, "profinfer_time_to_first_token_seconds_count", proc.pid, None) == {"": len(seqs)}
    (ttft_sum,) = series(text, "profinfer_time_to_first_token_seconds_sum", proc.pid, None).values()
    lo = sum(truth.ttft_bounds(s)[0] for s in seqs.values()) / 1e9
    hi = sum(truth.ttft_bounds(s)[1] for s in seqs.values()) / 1e9
    assert lo - 1e-9 <= ttft_sum <= hi + 1e-9
    (tpot_sum,) = series(text, "profinfer_time_per_output_token_seconds_sum", proc.pid, None).values()
    lo = sum(truth.generation_bounds(s)[0] for s in seqs.values()) / 1e9
    hi = sum(truth.generation_bounds(s)[1] for s in seqs.values()) / 1e9
    assert lo - 1e-9 <= tpot_sum <= hi + 1e-9
    assert json.loads(_get(daemon.url + "/status", daemon.token)[1])   # still serving
