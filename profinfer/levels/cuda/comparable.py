"""The cuda level's quantities for `diff` (core.compare.Series) (pure logic).

- "launches <kernel>": the kernel's launches (graph captures excluded) per engine step, where
  the engine has steps; else one sample, the program's count (shown, not judged: a count
  needs no interval);
- "copy <kind>", "sync <call>": the host's time in each such call (or group of calls counted
  in BPF: their mean), a sample per call.
"""
from __future__ import annotations

from collections import defaultdict

import numpy as np

from profinfer.core.diff.compare import Series
from profinfer.core.profile.model import Profile


def series(profile: Profile) -> list[Series]:
    calls = profile.cuda_calls
    if not calls:
        return []
    out: list[Series] = []
    steps = sorted({c.step for c in calls if c.step})
    launches: dict[str, defaultdict] = defaultdict(lambda: defaultdict(int))
    for c in calls:
        if c.what == "launch" and not c.captured and c.kernel:
            launches[c.kernel][c.step] += c.count
    for kernel, per_step in sorted(launches.items(), key=lambda kv: -sum(kv[1].values())):
        total = sum(per_step.values())
        samples = (np.array([per_step.get(s, 0) for s in steps], np.float64) if steps
                   else np.array([total], np.float64))
        out.append(Series("kernel", f"launches {kernel}", "launches per step" if steps else "launches",
                          samples, total))
    timed: dict[tuple[str, str], list[tuple[float, int]]] = defaultdict(list)
    for c in calls:
        host = c.total_ns if c.count > 1 or not c.end_ns else c.end_ns - c.start_ns
        if c.what == "copy" and host > 0:
            timed[("copy", f"copy {c.copy_kind or c.api}")].append((host / c.count, c.count))
        elif c.what == "sync" and host > 0:
            timed[("cuda", f"sync {c.api}")].append((host / c.count, c.count))
    for (section, name), rows in timed.items():
        out.append(Series(section, name, "ns per call", np.array([v for v, _ in rows], np.float64),
                          sum(n for _, n in rows)))
    return out
