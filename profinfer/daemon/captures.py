"""On-demand traces for the daemon's POST /capture: each a `profinfer attach` of its own."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading

from ..probepack import KERNEL_LEVELS, LEVELS, RUNTIME_LEVELS

MAX_CAPTURE_S = 300
MAX_CAPTURES = 2             # at once (each is a full attach: its own CPU and memory)
CAPTURE_LEVELS = set(LEVELS) | {"step"} | set(KERNEL_LEVELS) | set(RUNTIME_LEVELS)


class BadRequest(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class Captures:
    """At most one capture per process, MAX_CAPTURES at once; each runs as a process of its
    own (`profinfer attach --duration`), so that its memory, its CPU and its failures are not
    the daemon's, and the trace comes back as the file it wrote."""

    def __init__(self, agent, note):
        self.agent = agent
        self.note = note
        self.running: set[int] = set()
        self.lock = threading.Lock()

    def run(self, query: dict[str, list[str]]) -> bytes:
        try:
            pid = int(query["pid"][0])
            seconds = float(query.get("seconds", ["10"])[0])
        except (KeyError, ValueError, IndexError):
            raise BadRequest(400, "pid (an integer) and seconds (a number) are required") from None
        if not 0 < seconds <= MAX_CAPTURE_S:
            raise BadRequest(400, f"seconds must be in (0, {MAX_CAPTURE_S}]")
        levels = {v.strip() for v in query.get("levels", ["token,graph,op"])[0].split(",") if v.strip()}
        bad = levels - CAPTURE_LEVELS
        if bad or not levels:
            raise BadRequest(400, f"unknown level(s) {', '.join(sorted(bad)) or '(none)'}; "
                                  f"choose from {','.join(sorted(CAPTURE_LEVELS))}")
        with self.agent.lock:
            watched = pid in self.agent.watches
        if not watched:
            raise BadRequest(404, f"PID {pid} is not an inference process this daemon watches")
        with self.lock:
            if pid in self.running:
                raise BadRequest(409, f"a capture of PID {pid} is already running")
            if len(self.running) >= MAX_CAPTURES:
                raise BadRequest(429, f"{MAX_CAPTURES} captures are running; try again later")
            self.running.add(pid)
        try:
            with tempfile.TemporaryDirectory(prefix="profinfer-capture-") as tmp:
                trace, summary = os.path.join(tmp, "t.pftrace"), os.path.join(tmp, "s.json")
                cmd = [sys.executable, "-m", "profinfer.cli", "attach", "--pid", str(pid), "--levels",
                       ",".join(sorted(levels)), "--duration", f"{seconds:g}", "--quiet",
                       "-o", trace, "--json", summary]
                try:
                    done = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 300)
                except subprocess.TimeoutExpired:
                    raise BadRequest(504, f"the capture of PID {pid} did not end") from None
                if done.returncode != 0 or not os.path.exists(trace):
                    gone = not os.path.exists(f"/proc/{pid}")
                    last = (done.stderr.strip().splitlines() or ["failed"])[-1]
                    raise BadRequest(410 if gone else 500,
                                     f"PID {pid} exited during the capture" if gone else last)
                with open(summary) as f:
                    stopped = json.load(f).get("meta", {}).get("stopped_by", "")
                if stopped.startswith("target exited"):
                    raise BadRequest(410, f"PID {pid} exited during the capture")
                with open(trace, "rb") as f:
                    data = f.read()
            self.note(f"captured PID {pid} for {seconds:g} s at {','.join(sorted(levels))}: {len(data):,} bytes")
            return data
        finally:
            with self.lock:
                self.running.discard(pid)
