"""What a uprobe hit costs in a process like an engine's, not only in a bare loop: the same
emulated hit (bench/hit_in_process.c, a nop5) timed in a Python process that is bare, that
has imported torch (its OpenMP pool started by a matmul) or vLLM's native library, that runs
a sibling thread spinning, napping or mapping and unmapping memory, or that keeps AVX2 /
AVX-512 state live across the calls. Alternating plain and probed rounds in one process (a plain perf uprobe, no BPF), the
calling thread's CPU time and the wall time, medians.

    /work/main/.venv/bin/python bench/hit_in_process.py [--python VLLM_VENV_PYTHON]

Prints a markdown table. A price that does not move from the bare row means the engine's
process itself (its threads, mappings, vector state) does not make a hit dearer.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from probe_emulation import alternate                                # noqa: E402
from profinfer.core.target.symbols import load_elf                          # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
CALLS, ROUNDS, WARMUP = 200_000, 14, 1
CASES = ("bare", "torch", "vllm", "spinning sibling", "napping sibling", "mapping sibling", "avx2", "avx512")
CHILD = r"""
import ctypes, os, sys, time
lib_path, case, facts, calls, rounds = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
case, wall = case.split(":")[0], case.endswith(":wall")
if case in ("torch", "vllm"):
    import torch
    torch.set_num_threads(2)
    a = torch.randn(256, 256)
    (a @ a).sum()
    if case == "vllm":
        import vllm._C  # noqa: F401
lib = ctypes.CDLL(lib_path)
for name in ("hp_loop", "hp_loop_avx2", "hp_loop_avx512"):
    getattr(lib, name).argtypes = [ctypes.c_long]
if case.endswith("sibling"):
    lib.hp_start(("spinning", "napping", "mapping").index(case.split()[0]))
loop = {"avx2": lib.hp_loop_avx2, "avx512": lib.hp_loop_avx512}.get(case, lib.hp_loop)
with open("/proc/self/status") as f, open("/proc/self/maps") as m, open(facts, "w") as out:
    out.write(f"{f.read().split('Threads:')[1].split()[0]} {len(m.readlines())}")
for _ in range(rounds):
    sys.stdin.readline()
    clock = time.perf_counter_ns if wall else time.thread_time_ns
    t0 = clock()
    loop(calls)
    print((clock() - t0) / calls, flush=True)
"""


def measure(python: str, lib: str, offset: int, case: str, clock: str) -> tuple[str, str, float, float]:
    """(threads, mappings, plain ns per call, ns a hit adds) of one case, by the calling
    thread's CPU time or by wall time (`clock`: a hit that waits for a lock shows there only)."""
    facts = os.path.join(os.path.dirname(lib), f"{case}.facts")
    got = alternate(python, ["-c", CHILD, lib, f"{case}:{clock}", facts, str(CALLS)], offset, ROUNDS,
                    WARMUP, probed_file=lib)
    assert got is not None, "cannot open the uprobe"
    with open(facts) as f:
        threads, maps = f.read().split()
    plain, probed = got
    return threads, maps, statistics.median(plain), statistics.median(probed) - statistics.median(plain)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--python", help="a Python with torch and vLLM (vLLM's venv); without it, "
                    "the torch and vllm cases are left out")
    args = ap.parse_args()
    lib = os.path.join(tempfile.mkdtemp(prefix="hit_in_process."), "libhit.so")
    subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-pthread", "-o", lib,
                    os.path.join(HERE, "hit_in_process.c")], check=True)
    offset = load_elf(lib).symbols["hp_probed"].file_offset
    print("| process | threads | mappings | plain ns per call | ns a hit adds (thread CPU) | ns a hit adds (wall) |\n"
          "|---|---|---|---|---|---|")
    for case in CASES:
        needs_torch = case in ("torch", "vllm")
        if needs_torch and not args.python:
            continue
        python = args.python if needs_torch else sys.executable
        threads, maps, plain, hit = measure(python, lib, offset, case, "cpu")
        hit_wall = measure(python, lib, offset, case, "wall")[3]
        print(f"| {case} | {threads} | {maps} | {plain:.0f} | {hit:.0f} | {hit_wall:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
