"""Shared fixtures: the real workload (llama.cpp + GGUF models) and a way to run profinfer."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from profinfer import workload

PROFINFER = [sys.executable, "-m", "profinfer.cli"]
PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time there was"


@pytest.fixture(scope="session")
def llama_build() -> Path:
    return workload.ensure_llama_build()


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    return workload.ensure_model("tiny")


@pytest.fixture(scope="session")
def big_model() -> Path:
    return workload.ensure_model("llama-1.5b")


@pytest.fixture(scope="session")
def llama_env(llama_build) -> dict[str, str]:
    return {**os.environ, **workload.llama_env(llama_build)}


def completion_cmd(build: Path, model: Path, n: int = 24, threads: int = 2, prompt: str = PROMPT,
                   extra: tuple[str, ...] = ()) -> list[str]:
    return workload.completion_command(build, model, prompt, n, threads, extra=extra)


@dataclass
class Run:
    rc: int
    stdout: str
    stderr: str
    summary: dict | None


def run_profinfer(args: list[str], env=None, timeout=600, tmp_path: Path | None = None,
                  json_summary: bool = True) -> Run:
    cmd = list(PROFINFER)
    out = None
    if json_summary and tmp_path is not None:
        out = tmp_path / "summary.json"
        cmd += [args[0], "--json", str(out), *args[1:]]
    else:
        cmd += args
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    summary = json.loads(out.read_text()) if out is not None and out.exists() else None
    return Run(p.returncode, p.stdout, p.stderr, summary)


_PERF = re.compile(r"(?:llama_perf_context_print|common_perf_print):\s+(prompt eval|eval) time =\s+([\d.]+) ms /\s+(\d+) (tokens|runs)")


def llama_perf(text: str) -> dict[str, tuple[float, int]]:
    """llama.cpp's own numbers: {"prompt eval": (ms, tokens), "eval": (ms, runs)}."""
    return {m.group(1): (float(m.group(2)), int(m.group(3))) for m in _PERF.finditer(text)}


def with_llama_log(run, tries: int = 4):
    """Call run() until llama.cpp's own perf lines made it into its output.

    llama-completion logs through an asynchronous logger that it never flushes at exit
    (upstream issue 22142): under CPU load its last lines are lost, with or without a
    profiler (measured: 13 of 20 plain runs beside two busy processes). Such a run says
    nothing about profinfer, so it is repeated; the assertions then use a complete run.
    """
    for _ in range(tries):
        result = run()
        if getattr(result, "rc", getattr(result, "returncode", 0)) != 0:
            return result  # a real failure: let the test's own assertion report it
        text = result.stderr if isinstance(result.stderr, str) else result.stderr.decode()
        if {"prompt eval", "eval"} <= llama_perf(text).keys():
            return result
    raise AssertionError(f"llama.cpp's perf lines missing in {tries} runs")


def our_bpf_programs() -> list[str]:
    """Names of loaded BPF programs that belong to profinfer's llama.cpp pack."""
    out = subprocess.run(["bpftool", "prog", "show", "--json"], capture_output=True, text=True).stdout
    ours = ("token_enter", "token_return", "op_start", "op_start_fused", "op_barrier",
            "sched_switch", "sched_wakeup")
    return [p.get("name", "") for p in json.loads(out or "[]")
            if p.get("name", "").startswith(ours + ("graph_enter_", "graph_return_"))]


def leftover_uprobe_events() -> list[str]:
    """uprobe events registered through tracefs (BCC's fallback path), if tracefs is mounted."""
    for mnt in ("/sys/kernel/tracing", "/sys/kernel/debug/tracing"):
        p = Path(mnt) / "uprobe_events"
        if p.exists():
            return [l for l in p.read_text().splitlines() if l.strip()]
    return []


def endless_cmd(build: Path, model: Path, threads: int = 2) -> list[str]:
    """A generation that runs until killed (context shift, EOS ignored)."""
    return workload.completion_command(build, model, PROMPT, -1, threads,
                                       extra=("--context-shift", "--ignore-eos", "-c", "256"))


class Target:
    """A llama.cpp process generating in the background, for attach tests."""

    def __init__(self, cmd: list[str], env):
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        time.sleep(1.0)  # past model load: generating
        assert self.proc.poll() is None

    def alive(self) -> bool:
        return self.proc.poll() is None

    def cpu_ticks(self) -> int:
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])

    def still_generating(self) -> bool:
        before = self.cpu_ticks()
        time.sleep(0.5)
        return self.alive() and self.cpu_ticks() > before

    def stop(self):
        self.proc.kill()
        self.proc.wait()


def start_profinfer(args: list[str], env=None) -> subprocess.Popen:
    """Start profinfer in the background and wait until its probes are attached."""
    p = subprocess.Popen([*PROFINFER, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=env)
    err = []
    for line in p.stderr:
        err.append(line)
        if "attached" in line or line.startswith("profinfer: error"):
            break
    assert "attached" in "".join(err), "".join(err)
    p.early_stderr = "".join(err)
    return p


@pytest.fixture(scope="session")
def moe_model() -> Path:
    return workload.ensure_model("tiny-moe")
