"""The cache roofs against an outside reader, sysbench: a timed comparison of bandwidths (best
of 3 on both sides), so in the soak tier; the roofs' shapes and their use stay in the default
tier (tests/core/test_cache_roofs.py)."""
from __future__ import annotations

import re
import shutil
import subprocess

from test_cache_roofs import THREADS, measured  # noqa: F401 (a fixture)

SYSBENCH_S = 1      # each run reads for this long (a total size took minutes at a small block)


def sysbench_read_gbps(block_bytes: int) -> float:
    """Best of 3 runs of sysbench's memory read test, 2 threads each reading its own block
    for SYSBENCH_S; the block a power of two at most `block_bytes` (sysbench 1.0 refuses others)."""
    block_bytes = 1 << (block_bytes.bit_length() - 1)
    best = 0.0
    for _ in range(3):
        out = subprocess.run(["sysbench", "memory", f"--threads={THREADS}", f"--memory-block-size={block_bytes}",
                              "--memory-total-size=1P", f"--time={SYSBENCH_S}", "--memory-oper=read",
                              "--memory-scope=local", "run"], capture_output=True, text=True, timeout=60,
                             check=True).stdout
        mib_s = float(re.search(r"\(([\d.]+) MiB/sec\)", out).group(1))
        best = max(best, mib_s * (1 << 20) / 1e9)
    return best


def test_cache_roofs_against_sysbench(measured):
    """sysbench (an outside reader, scalar loads) at the same per-thread working sets.

    What is true here: a roof is the most a reader can get, so no level's roof may be far
    below what sysbench reads at that working set (it reads 8 bytes a load; ours vector
    loads, so ours is higher, not a copy of its figure). sysbench's DRAM-sized read (256 MiB
    blocks) and our DRAM roof measure the same thing: within a factor 2 (noise of a shared
    VM). And where sysbench reads a level's working set clearly faster than DRAM, that level
    is faster than DRAM on this machine, and our roof for it must be above our DRAM roof.
    Best of 3 on both sides; no ordering between the levels is asserted (sysbench's L1, L2 and
    L3 figures are all bounded by its scalar loads, so it cannot say)."""
    assert shutil.which("sysbench"), "sysbench is installed by setup.sh"
    _, entry = measured
    dram = sysbench_read_gbps(256 << 20)
    assert 0.5 < entry["read_gbps"] / dram < 2, (entry["read_gbps"], dram)
    for c in entry["caches"]:
        outside = sysbench_read_gbps(c["working_set_bytes"])
        assert c["gbps"] > 0.8 * outside, (c, outside)
        if outside > 1.5 * dram:
            assert c["gbps"] > 1.5 * entry["read_gbps"], (c, outside, dram, entry["read_gbps"])
