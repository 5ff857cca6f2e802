"""Reading files other processes control (their ELF symbols, their DWARF) away from the
daemon's loop, with a deadline and a memory limit of their own, in a process confined to
reading (core/target/confine.py: two capabilities, Landlock, seccomp).

A tenant can offer a 50 GB "libllama.so", a symbol table a section header says is huge, or
a DWARF bomb. Read in the daemon, any of them would stall its loop (/healthz turns 503 and
the liveness probe restarts it, again and again) or exhaust its memory limit. Here each
reading runs in one worker process (a fresh interpreter: nothing of the daemon's state, no
token) whose address space is limited. Readings are queued per tenant (`on_behalf_of`: a
pod, or a process's own root) and served a tenant at a time in turn, each tenant's in the
order asked: a tenant's many slow files delay another's by one reading at most, not by all
of them; a tenant's queue holds at most MAX_QUEUED (a reading past that gives NotReady, and
is asked again at a later scan). A tenant whose readings have cost a deadline (strikes,
forgotten STRIKE_S after its last) is served after the tenants with fewer (fewest first), not
within GRACE_S of their last reading, and at the latest after MAX_PASSED_OVER others: a
tenant's new process, whose files are a few readings asked one after another, then waits for
the one reading running when the first was asked, not for one of the slow tenant's between
each of its own. The loop waits for a new reading only when the worker is
idle, and for at most WAIT_S in all per loop turn (`pump()` starts a turn): one not done by
then gives NotReady, and is looked at again at a later scan, when it is. What the worker
sends back is bounded (MAX_RESULT_BYTES): a larger result fails that reading. A reading that
runs past DEADLINE_S has its worker killed: that reading fails, is told once, and is not
tried again for that key (a file's identity): such failures (a deadline, a result over the
cap, the worker dead) are remembered without eviction (a tenant makes at most one a deadline
per queue turn; evicted, the same files were read again for ever). A reading that fails fast
(the reader's own error) is told once and read again when asked again. Without `start()`
(the CLI: one target, the user's own) readings run in the caller, as before.
"""
from __future__ import annotations

import contextvars
import importlib
import os
import pickle
import resource
import select
import socket
import subprocess
import sys
import time
import contextlib
from collections import OrderedDict, deque
from multiprocessing import reduction
from multiprocessing.connection import Connection
from pathlib import Path

from profinfer.core.target import procfs
from profinfer.core.base.errors import ProfinferError

WAIT_S = 2.0           # the loop waits at most this long per turn for readings (held processes: 2 s)
DEADLINE_S = 20.0      # a reading still running after this is killed, and not tried again (the
                       # daemon's: PROFINFER_PARSE_DEADLINE_S, core/base/config.py)
# the worker's address space beyond its imports: room for the largest DWARF scan, while the
# worker and the daemon together fit the manifest's 512 MiB (sizes in bench/results.md)
MEMORY_BYTES = 320 << 20
STARTUP_S = 30.0       # the worker's imports
_KEEP = 256            # results not collected yet, remembered
MAX_QUEUED = 16        # readings waiting per tenant
# after a reading of a tenant whose readings never cost a deadline, one of a tenant whose did
# waits this long (past the loop's next turns: the first's next reading may follow)
GRACE_S = 2.0
MAX_PASSED_OVER = 8    # a tenant waiting while this many others' readings start goes next
MAX_STRUCK = 1024      # tenants whose strikes are remembered
STRIKE_S = 600.0       # a tenant's strikes are forgotten this long after its last
HOST = "host"          # the tenant of readings asked on nobody's behalf
# one result, pickled: several times the largest symbol table read (bench/results.md)
MAX_RESULT_BYTES = 32 << 20


class NotReady(ProfinferError):
    """Being read in the worker: ask again later (not a failure)."""


class _Worker:
    def __init__(self, wait_s: float, deadline_s: float, memory_bytes: int):
        self.wait_s, self.deadline_s, self.memory_bytes = wait_s, deadline_s, memory_bytes
        self.proc: subprocess.Popen | None = None
        self.conn: Connection | None = None
        # per tenant, in turn (the next served is the first's first): (key, module, function, args)
        self.queues: OrderedDict[str, deque] = OrderedDict()
        self.current: tuple | None = None    # (key, sent at, tenant)
        self.done: OrderedDict = OrderedDict()      # key -> result
        # key -> why: what cost a deadline or the worker (killed past its deadline, a result
        # over the cap, the worker dead), never evicted: read again, it would cost as much
        self.failed: dict = {}
        # key -> why: what failed fast (the reader's own error: a file gone meanwhile, a
        # malformed one), the newest _KEEP: cheap to read again, and not one a transient
        # cause (a process exiting mid-read) should refuse for good
        self.refused: OrderedDict = OrderedDict()
        # tenant -> its readings that cost a deadline or the worker: the fewest served first
        self.strikes: dict[str, int] = {}
        self.struck_at: dict[str, float] = {}    # tenant -> its last strike (monotonic s)
        self.clean_read_at = float("-inf")   # when a reading of a tenant without strikes last ended
        self.passed_over: dict[str, int] = {}    # tenant -> readings started while it waited
        self.ready = False                   # the worker's imports done (its "ready" read)
        self.confinement: dict = {}          # what the worker applied to itself (confine.confine)
        self.modules: set[str] = set()       # the readers' modules the worker imported before it
        self.started = 0                     # workers started (one more after each kill)
        self.wait_left = wait_s              # this loop turn's wait, for every reading together

    def _spawn(self, wait_ready: bool = False) -> None:
        mine, theirs = socket.socketpair()
        # -I: no PYTHONPATH, no user site, not the current directory; the package's own
        # directory named instead, so the worker runs the daemon's code; no environment
        package_dir = str(Path(__file__).resolve().parents[3])     # holds profinfer/
        self.modules = set(_PRELOADED)
        code = (f"import sys; sys.path.insert(0, {package_dir!r}); "
                f"from profinfer.core.target.parsing import serve; "
                f"serve({theirs.fileno()}, {self.memory_bytes}, {sorted(self.modules)!r})")
        self.proc = subprocess.Popen([sys.executable, "-I", "-c", code], pass_fds=[theirs.fileno()],
                                     cwd="/", env={}, stdin=subprocess.DEVNULL, close_fds=True)
        theirs.close()
        self.conn = Connection(mine.detach())
        self.started += 1
        self.ready = False
        # at the daemon's start, its imports done before its first reading is timed (a
        # loaded node: seconds); a worker started again after a kill: its reading's deadline
        # runs from its "ready" (the imports are nobody's file), within STARTUP_S
        if wait_ready:
            if not self.conn.poll(STARTUP_S):
                self._kill()
                raise OSError("the reader did not start")
            self.confinement = self.conn.recv()[1]
            self.ready = True

    def _kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
        if self.conn is not None:
            self.conn.close()
        self.proc = self.conn = None

    def _remember(self, table: dict, key, value) -> None:
        table[key] = value
        if table is not self.failed and len(table) > _KEEP:
            table.popitem(last=False)

    def _next(self) -> tuple | None:
        """The next reading: the first tenant's first, in turn among the tenants with the
        fewest costly failures; that tenant then last in turn. None (not yet) where all that
        waits is of tenants with such failures, within GRACE_S of another's last reading: a
        process's readings are asked one after another (each once the one before is read),
        and one of theirs started between them would delay each by a deadline."""
        tenant = self._chosen()
        if tenant is None:
            return None
        # the others waiting were passed over once more
        self.passed_over = {t: self.passed_over.get(t, 0) + 1 for t in self.queues if t != tenant}
        queue = self.queues[tenant]
        reading = queue.popleft()
        self.queues.move_to_end(tenant)
        if not queue:
            del self.queues[tenant]
        return tenant, reading

    def _chosen(self) -> str | None:
        """The tenant whose reading runs next (_next), None: none now. A tenant passed over
        for MAX_PASSED_OVER readings in a row goes next whatever its strikes (slower, never
        starved)."""
        if not self.queues:
            return None
        waited = [t for t in self.queues if self.passed_over.get(t, 0) >= MAX_PASSED_OVER]
        if waited:
            return waited[0]
        least = min(self._strikes(t) for t in self.queues)
        if least and time.monotonic() - self.clean_read_at < GRACE_S:
            return None
        return next(t for t in self.queues if self._strikes(t) == least)

    def _queued(self, key) -> bool:
        return any(q[0] == key for queue in self.queues.values() for q in queue)

    def advance(self, wait_s: float, until=None) -> None:
        """Collect what the worker finished, send it the next reading, kill one past its
        deadline; for up to wait_s while `until` is not done yet."""
        end = time.monotonic() + wait_s
        while True:
            if self.current is None and self.queues:
                nxt = self._next()
                if nxt is None:          # only struck tenants wait, within the grace
                    return
                tenant, (key, module, function, args) = nxt
                try:
                    if module not in self.modules:
                        # the worker imports a reader's module before it confines itself
                        # (after, an import may need what it no longer may: a program, a
                        # temporary file): a module it lacks means a new worker that has it
                        _PRELOADED.add(module)
                        self._kill()
                    if self.proc is None or self.proc.poll() is not None:
                        self._kill()
                        self._spawn()
                    _send_reading(self.conn, module, function, args)
                except (OSError, pickle.PicklingError) as e:
                    self._kill()        # told this once (a fork refused now may work later)
                    self._remember(self.refused, key, f"the reader could not be started: {e}")
                    continue
                self.current = (key, time.monotonic(), tenant)
            if self.current is None:
                return
            key, sent, tenant = self.current
            now = time.monotonic()
            limit = self.deadline_s if self.ready else STARTUP_S
            if now - sent >= limit:
                self._kill()
                self.current = None
                if self.ready:
                    self._fail(tenant, key, f"reading it took over {self.deadline_s:g} s: skipped")
                else:           # the worker's own start: told once, read again when asked
                    self._remember(self.refused, key, "the reader did not start: read again later")
                continue
            if until is not None and (until in self.done or until in self.failed or until in self.refused):
                return
            left = min(end, sent + limit) - now
            try:
                if not select.select([self.conn], [], [], max(left, 0))[0]:
                    if time.monotonic() >= end:
                        return
                    continue            # its deadline: killed above
                message = pickle.loads(self.conn.recv_bytes(MAX_RESULT_BYTES))
                if isinstance(message, tuple) and message[0] == "ready":    # a new worker's imports done
                    self.ready, self.confinement = True, message[1]              # the reading's time begins
                    self.current = (key, time.monotonic(), tenant)
                    continue
                ok, value = message
            except (EOFError, OSError, pickle.UnpicklingError) as e:
                # over the maximum length, the rest of the message is left unread: a new worker
                why = (f"its result is over {MAX_RESULT_BYTES >> 20} MiB: skipped"
                       if "bad message length" in str(e) else "its reader died (out of memory?): skipped")
                self._kill()
                self.current = None
                self._fail(tenant, key, why)
                continue
            self.current = None
            if ok is None:
                self._fail(tenant, key, value)
            else:
                self._remember(self.done if ok else self.refused, key, value)
                if not self._strikes(tenant):
                    self.clean_read_at = time.monotonic()

    def _fail(self, tenant: str, key, why: str) -> None:
        """A costly failure: remembered for good, and one more strike of its tenant's (at
        most MAX_STRUCK tenants remembered: the one struck longest ago goes)."""
        self.failed[key] = why
        self.strikes[tenant] = self._strikes(tenant) + 1
        self.struck_at[tenant] = time.monotonic()
        if len(self.strikes) > MAX_STRUCK:
            gone = min(self.strikes, key=self.struck_at.get)
            del self.strikes[gone], self.struck_at[gone]

    def _strikes(self, tenant: str) -> int:
        """The tenant's strikes, forgotten STRIKE_S after its last."""
        if tenant in self.strikes and time.monotonic() - self.struck_at[tenant] > STRIKE_S:
            del self.strikes[tenant], self.struck_at[tenant]
        return self.strikes.get(tenant, 0)

    def run(self, key, module: str, function: str, args: tuple, tenant: str = HOST):
        if key in self.failed:
            raise ProfinferError(self.failed[key])
        if key in self.refused:
            raise ProfinferError(self.refused.pop(key))     # told once, read again when asked again
        if key not in self.done:
            if not (self.current and self.current[0] == key) and not self._queued(key):
                # a new reading, in its tenant's queue (each tenant's turn comes); waited
                # for only when it starts now, and within what is left of this turn's wait
                queue = self.queues.get(tenant)
                if queue is not None and len(queue) >= MAX_QUEUED:
                    self.advance(0)
                    raise NotReady(f"its tenant has {MAX_QUEUED} files waiting to be read (asked again later)")
                self.queues.setdefault(tenant, deque()).append((key, module, function, args))
                starts_now = (self.current is None and self._chosen() == tenant
                              and self.queues[tenant][0][0] == key)
                if starts_now and self.wait_left > 0:
                    t0 = time.monotonic()
                    self.advance(self.wait_left, until=key)
                    self.wait_left -= time.monotonic() - t0
                else:
                    self.advance(0)
            else:
                self.advance(0)
        if key in self.done:
            return self.done.pop(key)     # the caller keeps it (its own cache)
        if key in self.failed:
            raise ProfinferError(self.failed[key])
        if key in self.refused:
            raise ProfinferError(self.refused.pop(key))
        raise NotReady("still being read (looked at again later)")

    def status(self) -> dict:
        """What waits, by tenant; what failed at a cost (deadline, size, the worker), in all and
        by tenant (the tenants served after the others)."""
        def top(counts: dict) -> dict:
            return dict(sorted(counts.items(), key=lambda kv: -kv[1])[:SHOWN_TENANTS])
        return {"deadline_s": self.deadline_s, "waiting": top({t: len(q) for t, q in self.queues.items()}),
                "reading_for": self.current[2] if self.current else None,
                "failed": len(self.failed), "failed_by_tenant": top(self.strikes),
                "workers_started": self.started, "confinement": self.confinement}

    def close(self) -> None:
        self._kill()


_worker: _Worker | None = None


_PRELOADED: set[str] = set()


def preload(module: str) -> None:
    """Declare a module whose readings the worker runs often: the worker imports it before its
    address space is limited, as it does numpy, pyelftools and capstone."""
    _PRELOADED.add(module)


def start(wait_s: float = WAIT_S, deadline_s: float = DEADLINE_S, memory_bytes: int = MEMORY_BYTES) -> None:
    """Readings from now on run in a worker process (the daemon); it is started at once
    (a failed start is tried again at the first reading)."""
    global _worker
    if _worker is None:
        _worker = _Worker(wait_s, deadline_s, memory_bytes)
        try:
            _worker._spawn(wait_ready=True)
        except OSError:
            pass


def stop() -> None:
    global _worker, _status
    _status = {}
    if _worker is not None:
        _worker.close()
        _worker = None


SHOWN_TENANTS = 16      # status(): the tenants with the most readings waiting, or the most strikes
_status: dict = {}


def pump() -> None:
    """A new loop turn: finished readings collected, the next one sent (never waits), and
    the turn's wait (WAIT_S) for new readings given again."""
    global _status
    if _worker is not None:
        _worker.wait_left = _worker.wait_s
        _worker.advance(0)
        _status = _worker.status()


def status() -> dict:
    """The worker's state as of the last loop turn (for /status: read from another thread)."""
    return _status


# whose readings are asked now: a tenant, or a process whose tenant is told (the resolver)
# only when a reading is asked (a context variable: each thread, and each task, its own)
_tenant: contextvars.ContextVar[str | int] = contextvars.ContextVar("profinfer_parsing_tenant", default=HOST)


@contextlib.contextmanager
def on_behalf_of(tenant: str):
    """The readings asked within are queued as this tenant's (a pod, a root: daemon.tenants)."""
    token = _tenant.set(tenant)
    try:
        yield
    finally:
        _tenant.reset(token)


# a process's tenant, where the daemon says how to tell it (set_tenant_resolver)
_resolver = None


def set_tenant_resolver(resolve) -> None:
    """How a process's tenant is told (resolve(pid) -> tenant; None: not told, the readings
    stay the caller's): for readings asked about a process outside on_behalf_of (a level
    naming what a process ran, while its events are drained)."""
    global _resolver
    _resolver = resolve


@contextlib.contextmanager
def on_behalf_of_process(pid: int):
    """The readings asked within are queued as the process's tenant's (as the resolver tells
    it, when one is asked: nothing is read for a call that asks none), else as the caller's."""
    if _resolver is None:
        yield
        return
    token = _tenant.set(pid)
    try:
        yield
    finally:
        _tenant.reset(token)


def run(key, module: str, function: str, *args):
    """module.function(*args), a reading of a file a tenant controls: in the worker once
    started (NotReady while it runs or waits in its tenant's queue; ProfinferError once it
    failed or timed out, for that key from then on), else here."""
    if _worker is None:
        return getattr(importlib.import_module(module), function)(*args)
    tenant = _tenant.get()
    if isinstance(tenant, int):         # on_behalf_of_process: its tenant told now
        tenant = _resolver(tenant) if _resolver is not None else HOST
    return _worker.run(key, module, function, args, tenant)


def _send_reading(conn: Connection, module: str, function: str, args: tuple) -> None:
    """A reading, and a descriptor of the root of each process whose files it names
    (/proc/PID/root/...) and of each mapped file it names (/proc/PID/map_files/...): the
    worker, confined (Landlock), may open neither itself (procfs.descriptors_given)."""
    wanted: dict = {}
    for a in args:
        if isinstance(a, str) and (m := procfs.ROOT_PATH.fullmatch(a)):
            wanted[int(m.group(1))] = (f"/proc/{m.group(1)}/root", os.O_DIRECTORY)
        elif isinstance(a, str) and procfs.MAP_FILES_PATH.fullmatch(a):
            wanted[a] = (a, 0)          # a mapped file deleted or replaced: the file itself
    given = {}
    try:
        for key, (path, flags) in wanted.items():
            try:
                given[key] = os.open(path, os.O_PATH | os.O_CLOEXEC | flags)
            except OSError:
                pass            # gone: the reading fails there, as it would have
        conn.send((module, function, args, list(given)))
        for fd in given.values():
            reduction.send_handle(conn, fd, 0)
    finally:
        for fd in given.values():
            os.close(fd)


def _receive_reading(conn: Connection) -> tuple:
    module, function, args, keys = conn.recv()
    return module, function, args, {key: reduction.recv_handle(conn) for key in keys}


def serve(fd: int, memory_bytes: int, modules: list[str]) -> None:
    """The worker: readings in, results out, until the daemon closes its end."""
    conn = Connection(fd)
    # the first the kernel kills when the daemon's memory runs out: a reading fails and the
    # worker is started again, where the daemon's death would leave held processes stopped
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")
    except OSError:
        pass
    import numpy  # noqa: F401  (what the readings import, before the limit is set)
    import elftools.elf.elffile  # noqa: F401
    import capstone  # noqa: F401
    for module in modules:
        importlib.import_module(module)
    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (vm + memory_bytes, vm + memory_bytes))
    from profinfer.core.target import confine
    conn.send(("ready", confine.confine()))     # from here on it can read, and little else
    while True:
        try:
            module, function, args, given = _receive_reading(conn)
        except (EOFError, OSError):
            return
        try:
            with procfs.descriptors_given(given):
                result = (True, getattr(importlib.import_module(module), function)(*args))
        except ProfinferError as e:
            result = (False, str(e))
        except MemoryError:         # None: as costly as a deadline, remembered for good
            result = (None, f"over {memory_bytes >> 20} MiB to read: skipped")
        except Exception as e:       # whatever a tenant's file makes a reader raise
            result = (False, f"unreadable ({type(e).__name__}: {e})")
        try:
            conn.send(result)
        except (OSError, pickle.PicklingError) as e:
            conn.send((False, f"its result could not be sent back: {e}"))
