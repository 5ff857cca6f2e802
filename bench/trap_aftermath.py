"""What a uprobe hit costs the work around it (bench/trap_aftermath.c): ns a hit adds per call,
by how many cache lines the work reads (data) or runs (code) between calls, and whether
those lines lie one per page (as many TLB entries) or packed in few pages; or how many
indirect calls it makes (branches: what the predictors learnt, if a trap clears them).
Alternating plain and probed rounds in one process; the median of each.

    /work/main/.venv/bin/python bench/trap_aftermath.py [--rounds 8] [--json OUT]

Prints a markdown table. A price that rises with the lines read is paid for what the work
between hits evicts (its own lines after the trap, or the kernel's trap path before it): a
calibration in a tight loop (`profinfer calibrate`) misses it, and a target with a large
working set pays it.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from probe_emulation import alternate, build, write_json              # noqa: E402
from profinfer.core.target.symbols import load_elf                          # noqa: E402

LINES = (0, 16, 64, 256, 1024)
# data read between calls (packed lines), 256 KiB to 4 MiB: past L2, as an engine reads its
# weights and activations between two of its probes (larger: a call's own time varies by more
# than a hit costs)
WORKING_SETS = (4096, 16384, 65536)
LAYOUTS = ("packed", "spread", "code-packed", "code-spread", "branches")
WORK_NS = 2_000_000         # each round's calls: ~this much plain CPU time


def measure(binary: str, offset: int, layout: str, lines: int, rounds: int) -> tuple[float, float]:
    """(plain ns per call, ns a hit adds): medians of alternating rounds, after one pair
    left out (warming up)."""
    calls = max(300, WORK_NS // (50 + 2 * lines) * 10)
    got = alternate(binary, [layout, str(lines), str(calls)], offset, rounds, warmup=1)
    assert got is not None, "cannot open the uprobe"
    plain, probed = got
    return statistics.median(plain), statistics.median(probed) - statistics.median(plain)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--json")
    args = ap.parse_args()
    binary = build("trap_aftermath")
    offset = load_elf(binary).symbols["ta_probed"].file_offset
    rows = []
    print(f"kernel {platform.release()}\n\n| lines (branches: calls) after each call | layout | "
          "plain ns per call | ns a hit adds |\n|---|---|---|---|")
    for lines in LINES:
        for layout in LAYOUTS[:1] if lines == 0 else LAYOUTS:
            plain, extra = measure(binary, offset, layout, lines, args.rounds)
            rows.append({"lines": lines, "layout": layout, "plain_ns": plain, "hit_ns": extra})
            print(f"| {lines} | {layout} | {plain:.0f} | {extra:.0f} |", flush=True)
    for lines in WORKING_SETS:
        plain, extra = measure(binary, offset, "packed", lines, args.rounds)
        rows.append({"lines": lines, "layout": "packed", "plain_ns": plain, "hit_ns": extra})
        print(f"| {lines} ({lines * 64 >> 10} KiB) | packed | {plain:.0f} | {extra:.0f} |", flush=True)
    if args.json:
        write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
