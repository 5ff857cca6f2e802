"""On-demand traces for the daemon's POST /capture: each a `profinfer attach` of its own.

The capture runs isolated from the daemon: `python -I` (neither the daemon's directory nor
PYTHONPATH nor a user site on sys.path), in `/`, with an environment of CAPTURE_ENV and the
PROFINFER_* settings only (never the token). A runtime level's follower stops the target at
each exec and dlopen until it has probed the new code; if the capture dies before it lets the
target go (a timeout, the OOM killer), the daemon continues what it left stopped."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator

import psutil

from profinfer.core.base import config
from profinfer.core.target import procfs
from profinfer.core.plugin.packs import KERNEL_LEVELS, LEVELS, MIN_DURATION_S, RUNTIME_LEVELS
from profinfer.daemon.http.tokens import TOKEN_ENV

MAX_CAPTURE_S = 300
MAX_CAPTURES = 2             # at once (each is a full attach: its own CPU and memory)
MAX_PER_TENANT = 1           # of them a trigger's for one tenant's processes (one tenant's
                             # incidents never take every slot)
# the biggest trace sent back: it is held in the daemon's memory until sent, and the target
# decides how many events it makes (PROFINFER_MAX_TRACE_BYTES sets it lower)
MAX_TRACE_BYTES = 128 * 1024 * 1024
CAPTURE_LEVELS = set(LEVELS) | {"step"} | set(KERNEL_LEVELS) | set(RUNTIME_LEVELS)
# What the capture may see of the daemon's environment: a compiler on PATH and the cache under
# HOME (a BPF object not built yet), the locale, the temporary directory; PROFINFER_* settings
# (the cache, prebuilt objects, probe options) but PROFINFER_TOKEN.
CAPTURE_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "LC_CTYPE", "TMPDIR")
SIGSTOP_BIT = 1 << (signal.SIGSTOP - 1)       # in /proc/PID/status's pending-signal masks
# The capture's first lines: it gets SIGTERM (and ends its session, letting what it follows
# go) when the daemon's thread that started it dies; if the daemon is already gone, it ends.
# (its memory: the first the kernel kills where the pod's runs out, as the parse worker, not
# the daemon, whose death would leave held processes stopped)
_CHILD = ("import ctypes, signal, os, sys\n"
          "ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG\n"
          "if os.getppid() != int(sys.argv[1]): sys.exit(1)\n"
          "try: open('/proc/self/oom_score_adj', 'w').write('1000')\n"
          "except OSError: pass\n"
          "from profinfer.cli import main\n"
          "main(sys.argv[2:])\n")


class BadRequest(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def capture_env(environ: dict[str, str], tmpdir: str) -> dict[str, str]:
    env = {k: v for k, v in environ.items()
           if k in CAPTURE_ENV or (k.startswith("PROFINFER_") and k != TOKEN_ENV)}
    env["TMPDIR"] = tmpdir
    return env


def temp_root() -> str:
    """Where captures write: $TMPDIR, else /tmp (read at each capture: never the daemon's
    current directory, tempfile's last resort)."""
    return os.environ.get("TMPDIR") or "/tmp"


TEMP_PREFIX = "profinfer-capture-"


def _temp_prefix() -> str:
    """A capture's temporary directory names its daemon, (pid, start): a later start can tell
    one a killed daemon left from one a live daemon still writes."""
    me = procfs.process_stat(os.getpid())
    return f"{TEMP_PREFIX}{os.getpid()}-{me[0] if me else 0}-"


def remove_stale_temp(root: str, note) -> None:
    """Remove the capture directories under root whose daemon is gone (killed mid-capture):
    only directories of this user's (not a link, not a tenant's), named by a (pid, start)
    that no live process has. (A daemon sharing root from another PID namespace would look
    gone: the shipped unit and pod each have a temporary directory of their own.)"""
    try:
        entries = list(os.scandir(root))
    except OSError:
        return
    for entry in entries:
        if not entry.name.startswith(TEMP_PREFIX):
            continue
        parts = entry.name[len(TEMP_PREFIX):].split("-")
        if len(parts) < 3 or not (parts[0].isdigit() and parts[1].isdigit()):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            continue
        owner = procfs.process_stat(int(parts[0]))
        if owner is not None and owner[0] == int(parts[1]):
            continue                    # its daemon lives: its capture may still be writing
        shutil.rmtree(entry.path, ignore_errors=True)
        note(f"removed {entry.path}: a capture's temporary directory its daemon (PID {parts[0]}) left")


def max_trace_bytes() -> int:
    """PROFINFER_MAX_TRACE_BYTES where it is a positive number under MAX_TRACE_BYTES, else that."""
    try:
        asked = int(config.text("PROFINFER_MAX_TRACE_BYTES") or MAX_TRACE_BYTES)
    except ValueError:
        return MAX_TRACE_BYTES
    return min(MAX_TRACE_BYTES, asked) if asked > 0 else MAX_TRACE_BYTES


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _tree(pid: int) -> list[psutil.Process]:
    try:
        p = psutil.Process(pid)
        return [p] + p.children(recursive=True)
    except psutil.Error:
        return []


def _held(pid: int) -> bool:
    """Stopped, or about to be (SIGSTOP pending: sent from BPF, not yet acted on)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        return (fields["State"].split()[0] == "T"
                or bool((int(fields["ShdPnd"], 16) | int(fields["SigPnd"], 16)) & SIGSTOP_BIT))
    except (OSError, KeyError, ValueError, IndexError):
        return False


def _stopped_tree(pid: int) -> set[tuple[int, int]]:
    """The processes of pid's tree held stopped now, each as (pid, start time in ticks)."""
    out = set()
    for p in _tree(pid):
        try:
            st = procfs.process_stat(p.pid)
            if st is not None and _held(p.pid):
                out.add((p.pid, st[0]))
        except psutil.Error:
            pass
    return out


class Captures:
    """At most one capture per process, MAX_CAPTURES at once; each runs as a process of its
    own (`profinfer attach --duration`), so that its memory, its CPU and its failures are not
    the daemon's, and the trace comes back as the file it wrote."""

    def __init__(self, agent, note):
        self.agent = agent
        self.note = note
        self.running: dict[int, float] = {}      # PID: what its capture was priced at (the budget's)
        self.tenants: dict[int, str] = {}         # PID: the tenant of a trigger's capture running
        self.lock = threading.Lock()
        self.temp_prefix = _temp_prefix()           # this daemon's (pid, start), once
        remove_stale_temp(temp_root(), note)

    @contextlib.contextmanager
    def slot(self, query: dict[str, list[str]], who: str = "") -> Iterator[Callable[[], bytes]]:
        """A capture's place, held until the with block ends: the trace is sent inside it, so
        that MAX_CAPTURES also bounds the traces held in memory while slow clients read them."""
        pid, seconds, levels = self._parse(query)
        price = self._within_budget(pid, levels, query.get("force", ["0"])[0] == "1", who)
        with self._place(pid, price):
            yield lambda: self._capture(pid, seconds, levels)[0]

    def run(self, pid: int, seconds: float, levels: set[str], price: float,
            tenant: str | None = None) -> tuple[bytes, dict]:
        """A capture the daemon itself starts (a trigger's, its levels already fitted to the
        budget, at `price`; `tenant`: its process's, of whom MAX_PER_TENANT run at once): its
        trace and its summary; BadRequest where it could not be made."""
        with self._place(pid, price, tenant):
            return self._capture(pid, seconds, levels)

    @contextlib.contextmanager
    def _place(self, pid: int, price: float, tenant: str | None = None) -> Iterator[None]:
        """One capture a process, MAX_CAPTURES at once (a trigger's: MAX_PER_TENANT a
        tenant): held until the block ends, its price counted against the process's budget
        meanwhile."""
        with self.lock:
            if pid in self.running:
                raise BadRequest(409, f"a capture of PID {pid} is already running")
            if len(self.running) >= MAX_CAPTURES:
                raise BadRequest(429, f"{MAX_CAPTURES} captures are running; try again later")
            if tenant is not None and list(self.tenants.values()).count(tenant) >= MAX_PER_TENANT:
                raise BadRequest(429, f"a triggered capture of its tenant ({tenant}) is running; "
                                      "another tenant's may take the other place")
            self.running[pid] = price
            if tenant is not None:
                self.tenants[pid] = tenant
        try:
            yield
        finally:
            with self.lock:
                self.running.pop(pid, None)
                self.tenants.pop(pid, None)

    def _parse(self, query: dict[str, list[str]]) -> tuple[int, float, set[str]]:
        try:
            pid = int(query["pid"][0])
            seconds = float(query.get("seconds", ["10"])[0])
        except (KeyError, ValueError, IndexError):
            raise BadRequest(400, "pid (an integer) and seconds (a number) are required") from None
        if not MIN_DURATION_S <= seconds <= MAX_CAPTURE_S:      # nan too
            raise BadRequest(400, f"seconds must be in [{MIN_DURATION_S}, {MAX_CAPTURE_S}]")
        levels = {v.strip() for v in query.get("levels", ["token,graph,op"])[0].split(",") if v.strip()}
        bad = levels - CAPTURE_LEVELS
        if bad or not levels:
            raise BadRequest(400, f"unknown level(s) {', '.join(sorted(bad)) or '(none)'}; "
                                  f"choose from {','.join(sorted(CAPTURE_LEVELS))}")
        with self.agent.lock:
            watched = pid in self.agent.watches
        if not watched:
            raise BadRequest(404, f"PID {pid} is not an inference process this daemon watches")
        return pid, seconds, levels

    def _within_budget(self, pid: int, levels: set[str], force: bool, who: str) -> float:
        """A capture counts against the budget: refused (429, and why) where the process's cost
        now plus the capture's would go over it, unless forced, which is logged; its price."""
        governor = getattr(self.agent, "governor", None)
        with self.agent.lock:
            w = self.agent.watches.get(pid)
        if governor is None or w is None:
            return 0.0
        fits, why = governor.capture_fits(w, levels)
        if not fits:
            if not force:
                raise BadRequest(429, f"{why}; ask with force=1 to capture anyway")
            self.note(f"capture forced over the budget by {who or 'an unknown peer'}: {why}")
        return governor.capture_price(w, levels)

    def _capture(self, pid: int, seconds: float, levels: set[str]) -> tuple[bytes, dict]:
        root = temp_root()
        try:
            tmp = tempfile.TemporaryDirectory(prefix=self.temp_prefix, dir=root)
        except OSError as e:
            raise BadRequest(503, f"cannot make the capture's temporary directory in {root}: {e.strerror}; "
                                  "give the daemon a writable one (TMPDIR, systemd PrivateTmp=yes, "
                                  "a Kubernetes emptyDir on /tmp)") from None
        with tmp:
            trace, summary = os.path.join(tmp.name, "t.pftrace"), os.path.join(tmp.name, "s.json")
            cmd = [sys.executable, "-I", "-c", _CHILD, str(os.getpid()), "attach", "--pid", str(pid),
                   "--levels", ",".join(sorted(levels)), "--duration", f"{seconds:g}", "--quiet",
                   "-o", trace, "--json", summary]
            stopped_before = _stopped_tree(pid)
            # its own session: a timeout kills all it started
            proc = subprocess.Popen(cmd, cwd="/", env=capture_env(os.environ, root), stdin=subprocess.DEVNULL,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                    start_new_session=True)
            try:
                _, stderr = proc.communicate(timeout=seconds + 300)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                self._continue_left(pid, stopped_before)
                raise BadRequest(504, f"the capture of PID {pid} did not end") from None
            if proc.returncode != 0:         # it may have failed before letting the target go
                self._continue_left(pid, stopped_before)
            if proc.returncode < 0:
                raise BadRequest(500, f"the capture of PID {pid} was killed ({_signal_name(-proc.returncode)})")
            if proc.returncode != 0 or not os.path.exists(trace):
                gone = not os.path.exists(f"/proc/{pid}")
                last = (stderr.strip().splitlines() or [f"the capture ended with status {proc.returncode}"])[-1]
                raise BadRequest(410 if gone else 500,
                                 f"PID {pid} exited during the capture" if gone else last)
            with open(summary) as f:
                told = json.load(f)
            stopped = told.get("meta", {}).get("stopped_by", "")
            if stopped.startswith("target exited"):
                # what came before the exit is kept (a crash is often the incident), said so
                # in the trace's own meta (stopped_by) and in the summary
                told["partial"] = f"PID {pid} exited during the capture: {stopped}"
            limit = max_trace_bytes()
            with open(trace, "rb") as f:
                data = f.read(limit + 1)
            if len(data) > limit:
                raise BadRequest(507, f"the trace of PID {pid} is over {limit:,} bytes, more than the daemon "
                                      "sends back: capture fewer seconds or fewer levels")
        self.note(f"captured PID {pid} for {seconds:g} s at {','.join(sorted(levels))}: {len(data):,} bytes"
                  + (f" (partial: {told['partial']})" if "partial" in told else ""))
        return data, told

    def _continue_left(self, pid: int, stopped_before: set[tuple[int, int]]) -> None:
        """SIGCONT to the processes of pid's tree that a dead capture left stopped: each one
        held now that was not held when it began (someone else's stop stays), and not one the
        daemon's own discovery holds. Its BPF programs went with it: no new stop comes."""
        discovery = getattr(self.agent, "discovery", None)
        ours = set(discovery.held_now()) if discovery is not None else set()
        for p, started in _stopped_tree(pid) - stopped_before:
            if p in ours:
                continue
            if procfs.signal_process(p, started, signal.SIGCONT):     # the same process, by pidfd
                self.note(f"PID {p} continued: the capture that stopped it died")
