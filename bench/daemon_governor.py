"""The daemon's overhead budget, enforced: a model generating without end while the daemon
watches it at token,op levels under --budget. Sampled twice a second from the daemon itself:
the process's levels and stated cost (/status) and its decode tokens (/metrics, for the
decode rate per window). Also the decode rate with no daemon, as the reference.

    .venv/bin/python bench/daemon_governor.py [--model tiny|llama-1.5b] [--seconds 40] [--budget 0.04]

Prints one JSON line per sample and a summary; results go in bench/results.md.
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

PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time there was"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read()


def _decode_tokens(url: str, pid: int) -> int:
    for line in _get(url + "/metrics").decode().splitlines():
        if line.startswith("profinfer_tokens_total{") and f'pid="{pid}"' in line and 'phase="decode"' in line:
            return int(float(line.rsplit(" ", 1)[1]))
    return 0


def _generate(build, model, seconds: float) -> subprocess.Popen:
    cmd = workload.completion_command(build, model, PROMPT, -1, 2,
                                      extra=("--context-shift", "--ignore-eos", "-c", "256"))
    return subprocess.Popen(cmd, env={**os.environ, **workload.llama_env(build)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _rate_alone(build, model, seconds: float) -> float:
    """Decode tokens/s with no profiler: llama.cpp's own eval line after `seconds`."""
    p = _generate(build, model, seconds)
    time.sleep(seconds)
    p.send_signal(2)          # SIGINT: llama-completion prints its perf lines
    _, err = p.communicate(timeout=60)
    for line in err.splitlines():
        if "eval time" in line and "prompt" not in line and "tokens per second" in line:
            return float(line.split("(")[1].split("ms per token,")[1].split("tokens per second")[0])
    return float("nan")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--seconds", type=float, default=40)
    ap.add_argument("--budget", type=float, default=0.04)
    args = ap.parse_args()
    build, model = workload.ensure_llama_build(), workload.ensure_model(args.model)
    alone = _rate_alone(build, model, min(15.0, args.seconds / 2))
    port = _port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as tmp:
        daemon = subprocess.Popen([sys.executable, "-m", "profinfer.cli", "daemon", "--listen", f"127.0.0.1:{port}",
                                   "--token-file", f"{tmp}/token", "--levels", "token,op",
                                   "--budget", str(args.budget)], stderr=open(f"{tmp}/daemon.log", "w"))
        time.sleep(2)
        target = _generate(build, model, args.seconds)
        t0, samples, last = time.monotonic(), [], None
        try:
            while time.monotonic() - t0 < args.seconds:
                time.sleep(0.5)
                status = json.loads(_get(url + "/status"))
                proc = next((p for p in status["processes"] if p["pid"] == target.pid), None)
                if proc is None:
                    continue
                now, tokens = time.monotonic(), _decode_tokens(url, target.pid)
                rate = (tokens - last[1]) / (now - last[0]) if last else None
                last = (now, tokens)
                s = {"t": round(now - t0, 2), "levels": proc["levels"], "cost": proc["cost_share"],
                     "decode_tok_s": None if rate is None else round(rate, 1)}
                samples.append(s)
                print(json.dumps(s), flush=True)
        finally:
            target.kill()
            target.wait()
            daemon.terminate()
            daemon.wait(timeout=30)
            log = open(f"{tmp}/daemon.log").read()
    changes = [line.split("daemon: ", 1)[1] for line in log.splitlines() if "levels " in line and "->" in line]
    at_op = [s["decode_tok_s"] for s in samples if "op" in s["levels"] and s["decode_tok_s"]]
    at_token = [s["decode_tok_s"] for s in samples if "op" not in s["levels"] and s["decode_tok_s"]]
    first_down = next((s["t"] for s in samples if "op" not in s["levels"]), None)
    summary = {"model": args.model, "budget": args.budget, "decode_tok_s_alone": alone,
               "first_step_down_s": first_down, "changes": changes,
               "decode_tok_s_at_op": round(sum(at_op) / len(at_op), 1) if at_op else None,
               "decode_tok_s_at_token": round(sum(at_token) / len(at_token), 1) if at_token else None,
               "cost_at_op": [s["cost"] for s in samples if "op" in s["levels"] and s["cost"] is not None][-3:],
               "cost_at_token": [s["cost"] for s in samples if "op" not in s["levels"] and s["cost"] is not None][-3:],
               "share_of_time_at_op": round(sum(1 for s in samples if "op" in s["levels"]) / max(len(samples), 1), 2)}
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
