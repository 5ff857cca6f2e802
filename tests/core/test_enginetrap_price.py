"""enginetrap.price(): a hit's price from an engine's steps in windows with and without bare
probes (pure logic), on steps made with a known extra time a step in the probed windows."""
from __future__ import annotations

import numpy as np
import pytest

from profinfer.core.calibration.enginetrap import price
from profinfer.core.calibration.loadcheck import UnreliableMeasurement
from profinfer.core.profile.model import Step

WINDOW_NS, GAP_NS = 1_000_000_000, 50_000_000      # windows, and the placing or removal between
STEP_NS, EXTRA_NS, HITS = 2_000_000, 100_000, 50    # a step, what the probes add to it, its hits


def _engine(pairs: int, drift: float = 0.0, seed: int = 0):
    """Steps back to back through alternating windows (off, on, off, ...), each probed step
    EXTRA_NS longer, every step's period jittered by 2% and the machine drifting by `drift`
    a window; the windows as TrapSampler records them; the bare program's hits."""
    rng = np.random.default_rng(seed)
    off, on, steps, t, runs = [], [], [], 0, 0
    for w in range(2 * pairs + 1):
        probed = w % 2 == 1
        (on if probed else off).append((t, t + WINDOW_NS))
        end = t + WINDOW_NS
        while t < end:
            period = (STEP_NS * (1 + drift * w) + (EXTRA_NS if probed else 0)) * (1 + 0.02 * rng.standard_normal())
            steps.append(Step(pid=1, tid=1, start_ns=int(t), end_ns=int(t) + 5_000, n_tokens=4 if len(steps) % 8 else 20))
            runs += HITS if probed else 0
            t += int(period)
        t += GAP_NS
    return steps, on, off, runs


def test_the_extra_time_a_step_over_its_hits_less_the_program_is_the_price():
    steps, on, off, runs = _engine(10)
    ns, se, compared, hits_per_step, step_ns = price(steps, on, off, runs, runs * 100)
    assert hits_per_step == pytest.approx(HITS, rel=0.02)
    assert step_ns == pytest.approx(STEP_NS, rel=0.01)
    assert ns == pytest.approx(EXTRA_NS / HITS - 100, rel=0.1) and 0 < se < 0.1 * ns
    assert compared > 0.9 * len(steps)


def test_a_steady_drift_of_the_machine_cancels():
    # 1% slower every window: 20% across the run, ten times what the probes add
    steps, on, off, runs = _engine(10, drift=0.01)
    ns, _, _, _, _ = price(steps, on, off, runs, 0)
    assert ns == pytest.approx(EXTRA_NS / HITS, rel=0.1)


def test_too_few_windows_are_refused():
    steps, on, off, runs = _engine(2)
    with pytest.raises(UnreliableMeasurement, match="too few busy windows"):
        price(steps, on, off, runs, 0)
