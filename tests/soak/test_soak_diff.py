"""diff's false alarms measured at length: every pair of eleven runs of one command (55
comparisons of one run a side) and ten of five runs a side. Its figures go to
bench/results.md."""
from __future__ import annotations

import itertools
import random

import pytest

from test_diff import REPEATS, SIDE, _alarms, _record, models  # noqa: F401 (a fixture)


@pytest.fixture(scope="module")
def base_runs(llama_build, llama_env, models, tmp_path_factory):
    d = tmp_path_factory.mktemp("base")
    return [_record(llama_build, models["base"], llama_env, d / f"base{i}.pftrace") for i in range(REPEATS + 1)]


def test_the_same_command_again_shows_no_significant_change(base_runs):
    """Every pair of the 11 runs of one command and build (55 comparisons of one run a
    side), and ten of five runs against five others: at most one in ten may report a
    significant change at 95% (the false-alarm bound diff's docs state), and each says nothing
    differs. Every pair, not ten: one odd run (an op twice its usual time, its memory placed
    so for the whole process) would make two of ten neighbouring pairs alarm at once."""
    pairs = list(itertools.combinations(base_runs, 2))
    single = _alarms(pairs)
    print(f"one run a side: false alarms in {len(single)} of {len(pairs)}: {single}")
    rng = random.Random(1)
    groups = []
    for _ in range(REPEATS):
        six = rng.sample(base_runs, 2 * SIDE)
        groups.append((six[:SIDE], six[SIDE:]))
    pooled = _alarms(groups)
    print(f"five runs a side: false alarms in {len(pooled)} of {REPEATS}: {pooled}")
    assert len(single) <= len(pairs) // 10 and len(pooled) <= REPEATS // 10, (single, pooled)
