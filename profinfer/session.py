"""One profiling session: attach, poll until told to stop, always detach, return the Profile.

Stops on --duration, SIGINT, SIGTERM, or the target's exit. Detaching happens in a finally
block, and libbpf creates uprobes through the perf uprobe PMU, so even a SIGKILL of profinfer
leaves nothing behind: the kernel drops the probes with our file descriptors.
"""
from __future__ import annotations

import os
import resource
import signal
import sys
import time
from typing import Callable

from . import discovery, kernel
from .collector import Collector
from .errors import ProfinferError
from .model import Profile
from .probepack import load_pack

# The collector sleeps this long between drains unless BPF wakes it (the ring buffer past
# its wakeup level; perf buffers every PERF_WAKEUP_EVENTS records) or a signal stops it:
# each drain costs CPU that, on a machine the inference threads fill, is taken from them
# (at 4 drains a second, 0.09% of the target's CPU on the 1.5B model; at 1, ~0.03%).
POLL_MS = 1000
# Until the target decodes (a model still loading), drains are this frequent, so that its
# CPU time is counted from its first llama_decode to within one of them.
POLL_BEFORE_DECODING_MS = 20
REFRESH_S = 5.0     # thread names and mappings are read again this often (and at the end)


def _alive(pid: int, child_status: list[int] | None, child_cpu: list[float]) -> bool:
    if child_status is not None:
        if child_status:
            return False
        try:
            done, status, usage = os.wait4(pid, os.WNOHANG)
        except ChildProcessError:
            return False
        if done:
            child_status.append(os.waitstatus_to_exitcode(status))
            child_cpu.append(usage.ru_utime + usage.ru_stime)
        return done == 0
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def _cpu_s(pid: int) -> float | None:
    """CPU time (user + system, all threads) `pid` has used so far."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def _own_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _rss_kb() -> int:
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmRSS:"))


class StatusLine:
    """A live one-line status on stderr (only on a terminal)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.t0 = time.monotonic()
        self.last = 0.0
        self.last_tokens = 0
        self.rate = 0.0

    def update(self, coll: Collector, force: bool = False) -> None:
        now = time.monotonic()
        if not self.enabled or (now - self.last < 0.5 and not force):
            return
        if now - self.last >= 0.5:
            # Current decode rate: tokens since the previous update, not since attach.
            self.rate = (coll.n_decode_tokens - self.last_tokens) / (now - self.last) if self.last else 0.0
            self.last, self.last_tokens = now, coll.n_decode_tokens
        el = now - self.t0
        sys.stderr.write(f"\rprofinfer: {el:6.1f} s | {self.rate:7.2f} tok/s | "
                         f"{coll.n_events:>10,} events | {coll.lost():,} lost ")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")


def profile_process(pid: int, levels: set[str], duration: float | None = None,
                    lib_paths: list[tuple[str, str]] | None = None, child_status: list[int] | None = None,
                    on_attached: Callable[[], None] | None = None,
                    tensor_layout: str | None = None, buffer: str = "auto",
                    counters: list[str] | None = None, status: bool | None = None,
                    warn: Callable[[str], None] = lambda m: None,
                    note: Callable[[str], None] = lambda m: None) -> Profile:
    """Profile `pid` until stopped. With child_status (a list), pid is our child: its exit
    code is appended there when it ends."""
    kernel.require_root()
    if child_status is None and not discovery.process_exists(pid):
        raise ProfinferError(f"no process with PID {pid}")
    if lib_paths is None:
        lib_paths = [(m.host_path, m.path) for m in discovery.mapped_files(pid)]
    coll = Collector(pid, levels, load_pack(), lib_paths, root=f"/proc/{pid}/root",
                     tensor_layout=tensor_layout, buffer=buffer, counters=counters)
    stop_reason: list[str] = []

    def on_signal(signum, _frame):
        stop_reason.append(signal.Signals(signum).name)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    line = StatusLine(sys.stderr.isatty() if status is None else status)
    try:
        coll.attach()
        cpu_at_attach = _own_cpu_s()
        # The target's CPU time, and ours, are counted from its first llama_decode (BPF sends
        # an event at its entry; without the token level, from the first event), so that
        # loading a model does not dilute the shares.
        target_cpu_from, own_cpu_from = _cpu_s(pid), cpu_at_attach
        counting_from_decode = False
        child_cpu: list[float] = []
        for w in coll.warnings:
            warn(w)
        note(f"attached {coll.n_probes} probes to PID {pid} in {coll.attach_s:.2f} s "
             f"(levels {','.join(sorted(levels))})")
        coll.refresh_process_info()
        if on_attached:
            on_attached()
        deadline = time.monotonic() + duration if duration else None
        last_refresh = 0.0
        while not stop_reason:
            wait_ms = POLL_MS if counting_from_decode else POLL_BEFORE_DECODING_MS
            if deadline:
                wait_ms = max(0, min(wait_ms, int((deadline - time.monotonic()) * 1000) + 1))
            coll.poll(wait_ms)
            if not counting_from_decode and (coll.decoding or coll.n_events):
                target_cpu_from, own_cpu_from, counting_from_decode = _cpu_s(pid), _own_cpu_s(), True
            now = time.monotonic()
            if now - last_refresh > REFRESH_S:
                coll.refresh_process_info()
                last_refresh = now
            line.update(coll)
            if deadline and now >= deadline:
                stop_reason.append("duration")
            elif not _alive(pid, child_status, child_cpu):
                stop_reason.append("target exited" + (f" ({child_status[0]})" if child_status else ""))
        line.update(coll, force=True)
        coll.refresh_process_info()
        collecting_rss_kb = _rss_kb()
        own_cpu = _own_cpu_s()
        # the target's CPU time while probed: what the probes' cost is a share of
        target_cpu = child_cpu[0] if child_cpu else _cpu_s(pid)
        if target_cpu is not None and target_cpu_from is not None:
            target_cpu -= target_cpu_from
        profile = coll.finish()
        profile.meta["stopped_by"] = stop_reason[0] if stop_reason else ""
        profile.meta["events"] = str(coll.n_events)
        profile.meta["wall_s"] = f"{time.monotonic() - line.t0:.3f}"
        # The collector's own memory, not the target's: the peak (ru_maxrss, KiB, includes
        # BCC's compile) and the resident size while collecting ended.
        profile.meta["collector_max_rss_kb"] = str(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
        profile.meta["collector_rss_kb"] = str(collecting_rss_kb)
        # CPU the collector itself used while the target ran (on a small machine it is taken
        # from the inference threads): the part of the overhead that is ours, not the probes'.
        profile.meta["collector_cpu_s"] = f"{own_cpu - cpu_at_attach:.3f}"
        profile.meta["collector_cpu_decoding_s"] = f"{own_cpu - own_cpu_from:.3f}"
        if target_cpu is not None:
            profile.meta["target_cpu_s"] = f"{target_cpu:.3f}"
        from . import recorded_calibration
        recorded_calibration.stamp(profile)     # the roofs and trap costs that judge this run
        return profile
    finally:
        line.close()
        coll.detach()
        for s, h in old.items():
            signal.signal(s, h)
