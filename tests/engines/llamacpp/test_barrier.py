"""llama.cpp's barrier read for one trap's price (engines/llamacpp/probes/barrier.py)."""
from __future__ import annotations

import numpy as np

from profinfer.engines.llamacpp.probes import barrier


def test_trap_at_fused_entries_is_the_last_arrivers_gap():
    # three releases, two threads each: the thread that left the barrier last goes on at
    # once (the smaller gap); the median of those
    release = np.array([100, 100, 500, 500, 900, 900])
    gap = np.array([1300, 1100, 900, 4000, 1250, 1200])
    assert barrier.trap_at_fused_entries(release, gap) == 1100
