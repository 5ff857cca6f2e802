"""What the daemon's discovery from the kernel costs processes (bpf/discover.bpf.c).

Two prices, each in alternating windows (discovery attached, then not) in one run:
- an unrelated process: a shell loop exec'ing /bin/true (the exec tracepoint's map lookup,
  the loader hook's two traps and its look at the names a start adds); per exec;
- an engine-like one: a process that dlopens a library named like an engine's (a copy of
  libm named libllama.so), so it is held at its loader's hook until user space lets it go
  (as the agent does once it has attached); per dlopen, the stop and the round trip.

Each window's user space answers as the agent would: an executable not seen before is
recorded as no engine; a held process is continued at once. Beside the timed difference
(which a busy 2-core machine resolves poorly for a ~1 ms exec), the kernel's own count:
BPF time and program runs per exec, the runs of the loader program being uprobe hits priced
at this machine's calibrated trap cost (profinfer calibrate; call sites: emulated).

    python bench/discovery_cost.py [--windows 10] [--execs 400] [--dlopens 40] [--round-trips 20000]
"""
from __future__ import annotations

import argparse
import os
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from profinfer.core.ebpf import libbpf
from profinfer.core.calibration import probecost
from profinfer.daemon.discovery.kernel import NodeDiscovery
from profinfer.core.plugin.packs import load_pack, pack_names

DLOPEN_LOOP = """
import ctypes, os, sys, time
t0 = time.perf_counter()
for i in range(int(sys.argv[2])):
    path = os.path.join(sys.argv[1], f"{i}", "libllama.so")
    ctypes.CDLL(path)
print((time.perf_counter() - t0) / int(sys.argv[2]))
"""


def true_loop(n: int) -> float:
    """Seconds per exec of /bin/true from a shell loop."""
    t0 = time.perf_counter()
    subprocess.run(["bash", "-c", f"for i in $(seq {n}); do /bin/true; done"], check=True)
    return (time.perf_counter() - t0) / n


PING_PONG = """
import os, sys, time
n = int(sys.argv[1])
a, b = os.pipe(), os.pipe()
if os.fork() == 0:
    for _ in range(n):
        os.read(a[0], 1); os.write(b[1], b"x")
    os._exit(0)
t0 = time.perf_counter()
for _ in range(n):
    os.write(a[1], b"x"); os.read(b[0], 1)
print((time.perf_counter() - t0) / n)
"""


def ping_pong(n: int) -> float:
    """Seconds per round trip of a byte between two processes (on a 2-core machine, at
    least two context switches each)."""
    return float(subprocess.run([sys.executable, "-c", PING_PONG, str(n)], check=True,
                                capture_output=True, text=True).stdout)


def dlopen_loop(libs: str, n: int) -> float:
    out = subprocess.run([sys.executable, "-c", DLOPEN_LOOP, libs, str(n)], check=True,
                         capture_output=True, text=True).stdout
    return float(out)


class Answering:
    """The agent's part: executables recorded, held processes continued at once."""

    def __init__(self, d: NodeDiscovery):
        self.d, self.stop, self.held = d, threading.Event(), 0
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        while not self.stop.is_set():
            select.select([self.d.fileno()], [], [], 0.1)
            for ev in self.d.events():
                if ev.what == "exec":
                    self.d.executable(ev.file, False)
                else:
                    self.held += 1
                    self.d.release(ev.tgid, done=True)

    def close(self):
        self.stop.set()
        self.thread.join()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--windows", type=int, default=10)
    ap.add_argument("--execs", type=int, default=400)
    ap.add_argument("--dlopens", type=int, default=40)
    ap.add_argument("--round-trips", type=int, default=20000)
    args = ap.parse_args()
    packs = [load_pack(n) for n in pack_names()]
    libs = tempfile.mkdtemp(prefix="pi-discovery-bench-")
    libm = next(p for p in ("/lib/x86_64-linux-gnu/libm.so.6", "/usr/lib/x86_64-linux-gnu/libm.so.6")
                if os.path.exists(p))
    for i in range(args.dlopens):          # each dlopen a new file: a new list change
        os.makedirs(os.path.join(libs, str(i)))
        shutil.copy(libm, os.path.join(libs, str(i), "libllama.so"))
    rows = {"true": ([], []), "dlopen": ([], []), "switch": ([], [])}
    held = 0
    stats_fd = libbpf.enable_run_time_stats()
    counted: dict[str, list[int]] = {}     # program: [ns, runs] over the "on" true loops
    switch_counted = [0, 0]                # the hold deadline's switch program over the ping-pongs
    try:
        for w in range(args.windows):
            for on in ((True, False) if w % 2 == 0 else (False, True)):
                d = answering = None
                if on:
                    d = NodeDiscovery(packs)
                    d.hook_loader(os.getpid())
                    answering = Answering(d)
                    true_loop(20)          # its executables recorded, as a running agent has them
                try:
                    before = d.obj.program_stats() if on else {}
                    rows["true"][not on].append(true_loop(args.execs))
                    for prog, (ns, runs) in (d.obj.program_stats().items() if on else ()):
                        c = counted.setdefault(prog, [0, 0])
                        c[0] += ns - before.get(prog, (0, 0))[0]
                        c[1] += runs - before.get(prog, (0, 0))[1]
                    rows["dlopen"][not on].append(dlopen_loop(libs, args.dlopens))
                    before = d.deadline.program_stats() if on and d.deadline else {}
                    rows["switch"][not on].append(ping_pong(args.round_trips))
                    if before:
                        ns, runs = d.deadline.program_stats()["hold_deadline_retry"]
                        switch_counted[0] += ns - before["hold_deadline_retry"][0]
                        switch_counted[1] += runs - before["hold_deadline_retry"][1]
                finally:
                    if answering is not None:
                        answering.close()
                        held += answering.held
                        d.close()
    finally:
        shutil.rmtree(libs)
    if stats_fd >= 0:
        os.close(stats_fd)
    print(f"{args.windows} windows each way, alternating; {held} holds answered")
    execs = args.windows * args.execs
    trap = (probecost.cached() or {}).get("emulated_ns")
    for prog, (ns, runs) in sorted(counted.items()):
        print(f"  {prog}: {runs / execs:.2f} runs and {ns / execs:.0f} ns of BPF per exec")
    hits = counted.get("discover_loader", [0, 0])[1] / execs
    if trap:
        bpf_ns = sum(ns for ns, _ in counted.values()) / execs
        print(f"  counted: {bpf_ns + hits * trap:.0f} ns per exec ({hits:.2f} uprobe hits at {trap:.0f} ns, "
              "plus BPF time)")
    if switch_counted[1]:
        print(f"  hold_deadline_retry: {switch_counted[1]} runs over the ping-pongs, "
              f"{switch_counted[0] / switch_counted[1]:.1f} ns of BPF a run (nothing pending)")
    units = {"true": "exec", "dlopen": "dlopen", "switch": "round trip"}
    for name, (on, off) in rows.items():
        diffs = [a - b for a, b in zip(on, off)]
        se = statistics.stdev(diffs) / len(diffs) ** 0.5 if len(diffs) > 1 else float("nan")
        print(f"{name}: {statistics.median(off) * 1e6:.0f} us without, {statistics.median(on) * 1e6:.0f} us "
              f"with; paired difference {statistics.mean(diffs) * 1e6:+.1f} us "
              f"(standard error {se * 1e6:.1f} us) per {units[name]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
