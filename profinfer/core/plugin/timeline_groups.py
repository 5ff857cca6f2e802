"""A timeline's bound in the JSON summary (its decode calls, its engine steps): at most
MAX_TIMELINE_POINTS entries, a longer run's items merged into consecutive groups of k each, so
that a page draws a bounded number of bars whatever the run's length."""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import TypeVar

# The most entries a summary's timeline holds (and a page draws).
MAX_TIMELINE_POINTS = 2000

T = TypeVar("T")


def groups(items: Sequence[T]) -> tuple[int, list[Sequence[T]]]:
    """k, and the items (in their order) in consecutive groups of k, the last one shorter:
    k = ceil(len / MAX_TIMELINE_POINTS), 1 for a run that fits."""
    k = max(1, math.ceil(len(items) / MAX_TIMELINE_POINTS))
    return k, [items[i:i + k] for i in range(0, len(items), k)]


def merged_phase(phases: Iterable[str]) -> str:
    """A group's phase: its items' common phase, or "mixed"."""
    distinct = set(phases)
    return distinct.pop() if len(distinct) == 1 else "mixed"
