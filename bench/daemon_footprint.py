"""What watching one more process costs the daemon and the kernel, to decide whether probes
should be shared per library file: N llama.cpp processes (the same build, each waiting on a
FIFO for its prompt) watched at once, for N = 1 and N = 20; the daemon's fds, BPF maps'
locked memory (fdinfo memlock), perf-event (uprobe) fds, BPF programs and RSS.

    .venv/bin/python bench/daemon_footprint.py [--n 1,20]
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

from profinfer.engines.llamacpp import workload


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def footprint(pid: int) -> dict[str, int]:
    out = {"fds": 0, "bpf_maps": 0, "map_memlock_kb": 0, "bpf_progs": 0, "perf_events": 0}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            info = open(f"/proc/{pid}/fdinfo/{fd}").read()
        except OSError:
            continue
        out["fds"] += 1
        if target == "anon_inode:bpf-map":
            out["bpf_maps"] += 1
            out["map_memlock_kb"] += next(int(l.split()[1]) for l in info.splitlines()
                                          if l.startswith("memlock:")) // 1024
        elif target == "anon_inode:bpf-prog":
            out["bpf_progs"] += 1
        elif target == "anon_inode:[perf_event]":
            out["perf_events"] += 1
    out["rss_kb"] = next(int(l.split()[1]) for l in open(f"/proc/{pid}/status") if l.startswith("VmRSS:"))
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", default="1,20")
    args = ap.parse_args()
    build, model = workload.ensure_llama_build(), workload.ensure_model("tiny")
    env = {**os.environ, **workload.llama_env(build)}
    port = _port()
    url = f"http://127.0.0.1:{port}"
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        daemon = subprocess.Popen([sys.executable, "-m", "profinfer.cli", "daemon", "--listen", f"127.0.0.1:{port}",
                                   "--token-file", f"{tmp}/token"], stderr=subprocess.DEVNULL)
        time.sleep(2)
        results["0"] = footprint(daemon.pid)
        try:
            for n in (int(x) for x in args.n.split(",")):
                procs = []
                for i in range(n):
                    fifo = f"{tmp}/p{n}-{i}"
                    os.mkfifo(fifo)
                    cmd = workload.completion_command(build, model, "x", 8, 1)
                    j = cmd.index("-p")
                    cmd[j:j + 2] = ["-f", fifo]
                    procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:
                    with urllib.request.urlopen(url + "/status") as r:
                        watched = {p["pid"] for p in json.load(r)["processes"]}
                    if {p.pid for p in procs} <= watched:
                        break
                    time.sleep(0.2)
                results[str(n)] = footprint(daemon.pid)
                print(n, json.dumps(results[str(n)]), flush=True)
                for p in procs:
                    p.kill()
                    p.wait()
                time.sleep(2)
        finally:
            daemon.terminate()
            daemon.wait(timeout=30)
    base = results["0"]
    for n, r in results.items():
        if n != "0" and int(n) > 0:
            print(f"per watched process (N={n}):", json.dumps({k: round((r[k] - base[k]) / int(n), 1) for k in r}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
