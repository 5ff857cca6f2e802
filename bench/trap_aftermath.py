"""What a uprobe hit costs the work after it (bench/trap_aftermath.c): ns a hit adds per call,
by how many cache lines the work reads (data) or runs (code) after each call, and whether
those lines lie one per page (as many TLB entries) or packed in few pages. Alternating plain and probed rounds in one
process; the median of each.

    /work/main/.venv/bin/python bench/trap_aftermath.py [--rounds 8] [--json OUT]

Prints a markdown table. A price that rises with the lines read, more when spread over pages,
is paid outside the probed call: a calibration in a tight loop (`profinfer calibrate`) misses
it, and a target with a large working set pays it.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from profinfer.core.perf_event_open import perf_event_open          # noqa: E402
from profinfer.core.probecost import _uprobe_attr                    # noqa: E402
from profinfer.core.symbols import load_elf                          # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
LINES = (0, 16, 64, 256, 1024)
WORK_NS = 2_000_000         # each round's calls: ~this much plain CPU time


def build() -> str:
    out = os.path.join(tempfile.mkdtemp(prefix="trap_aftermath."), "trap_aftermath")
    subprocess.run(["gcc", "-O2", "-o", out, os.path.join(HERE, "trap_aftermath.c")], check=True)
    return out


def measure(binary: str, offset: int, layout: str, lines: int, rounds: int) -> tuple[float, float]:
    """(plain ns per call, ns a hit adds): medians of alternating rounds."""
    calls = max(2000, WORK_NS // (50 + 2 * lines) * 10)
    proc = subprocess.Popen([binary, layout, str(lines), str(calls), str(2 * rounds + 2)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    plain, probed = [], []
    try:
        for r in range(2 * rounds + 2):
            fd = -1
            if r >= 2 and r % 2:
                attr, _buf = _uprobe_attr(binary.encode(), offset, False)
                fd = perf_event_open(attr, proc.pid, -1)
                assert fd >= 0, "cannot open the uprobe"
            try:
                proc.stdin.write("\n")
                proc.stdin.flush()
                ns = float(proc.stdout.readline())
                if r >= 2:          # the first two: warming up
                    (probed if r % 2 else plain).append(ns)
            finally:
                if fd >= 0:
                    os.close(fd)
    finally:
        proc.stdin.close()
        proc.kill()
        proc.wait()
    return statistics.median(plain), statistics.median(probed) - statistics.median(plain)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--json")
    args = ap.parse_args()
    binary = build()
    offset = load_elf(binary).symbols["ta_probed"].file_offset
    rows = []
    print(f"kernel {platform.release()}\n\n| lines read after each call | layout | plain ns per call | "
          "ns a hit adds |\n|---|---|---|---|")
    for lines in LINES:
        for layout in (("packed",) if lines == 0 else ("packed", "spread", "code-packed", "code-spread")):
            plain, extra = measure(binary, offset, layout, lines, args.rounds)
            rows.append({"lines": lines, "layout": layout, "plain_ns": plain, "hit_ns": extra})
            print(f"| {lines} | {layout} | {plain:.0f} | {extra:.0f} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"kernel": platform.release(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
