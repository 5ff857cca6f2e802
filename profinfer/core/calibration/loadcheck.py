"""Was the machine quiet while we measured it? Shared by the roof and probe-cost calibrations.

A calibration taken while other processes use the CPUs (a build, another test) measures what
was left of the machine, not the machine, and a cached one judges every later recording.
Two signals: other processes' CPU use during the measurement (all CPUs' busy time from
/proc/stat, less our own and our children's), and the spread of the measurement's
repetitions, which intermittent interference widens.
"""
from __future__ import annotations

import os
import resource
import time
from dataclasses import dataclass

from profinfer.core.base.errors import ProfinferError

# Other processes may use this much CPU (in CPUs, averaged over the measurement) before it is
# busy: an idle VM's daemons and kernel threads use ~0.02.
OTHERS_CPU_LIMIT = 0.25
RETRY_PAUSE_S = 2.0


class UnreliableMeasurement(ProfinferError):
    """A calibration failed its check and was not cached."""

    exit_code = 75  # EX_TEMPFAIL: try again later


def busy_ticks() -> int:
    """Busy time of all CPUs (user, nice, system, irq, softirq, steal), in clock ticks.

    Steal counts as busy: on a VM it is another guest holding our CPU."""
    with open("/proc/stat") as f:
        fields = f.readline().split()
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[1:9])
    return user + nice + system + irq + softirq + steal


def _own_cpu_s() -> float:
    """CPU time of this process and of the children it has waited for."""
    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        ru = resource.getrusage(who)
        total += ru.ru_utime + ru.ru_stime
    return total


@dataclass
class Load:
    wall_s: float
    others_cpus: float      # other processes' CPU use, in CPUs, averaged over wall_s

    @property
    def busy(self) -> bool:
        return self.others_cpus > OTHERS_CPU_LIMIT

    def describe(self) -> str:
        return f"other processes used {self.others_cpus:.2f} of {os.cpu_count()} CPUs"


class LoadWindow:
    """`with LoadWindow() as w: measure()` then w.load: what others used meanwhile.

    Children that do the measuring must be waited for inside the window (their CPU time is
    ours only once waited for)."""

    def __enter__(self) -> LoadWindow:
        self._t0, self._busy0, self._own0 = time.monotonic(), busy_ticks(), _own_cpu_s()
        self.load: Load | None = None
        return self

    def __exit__(self, *exc) -> None:
        wall = time.monotonic() - self._t0
        busy = (busy_ticks() - self._busy0) / os.sysconf("SC_CLK_TCK")
        own = _own_cpu_s() - self._own0
        self.load = Load(wall, max(busy - own, 0.0) / wall if wall > 0 else 0.0)


def wait_until_quiet(timeout_s: float, window_s: float = 1.0) -> bool:
    """Wait until other processes leave the CPUs alone for `window_s`; False on timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with LoadWindow() as w:
            time.sleep(window_s)
        if not w.load.busy:
            return True
    return False


def spread(values: list[float], best_of: int = 3, higher_is_better: bool = True) -> float:
    """How far apart the `best_of` best values are: 1 - worst/best among them (0: identical)."""
    top = sorted(values, reverse=higher_is_better)[:best_of]
    if len(top) < best_of or max(top) <= 0:
        return float("inf")
    return 1 - min(top) / max(top)


AGREE_LIMIT = 0.10       # runs that agree this well end the search early


def settle(measure_once, attempts: int, higher_is_better: bool, note, label: str,
           judged: tuple[str, ...] | None = None) -> tuple[dict, list[str], str]:
    """Run `measure_once` (returns (figures, problems)) until two runs without problems agree
    on the `judged` figures (default: all), or `attempts` runs were made.

    Interference that lasts a whole run (another guest on the host's cores) escapes a run's
    own check; the best of several runs that passed is the least disturbed. Returns (the best
    value of each figure over the runs that passed, [], how they agreed), or, when fewer than
    two passed, (the best figures seen, problems, ""), as soon as two can no longer pass."""
    passed: list[dict] = []
    seen: list[dict] = []
    rejected: list[str] = []         # the last rejected run's problems
    pick = max if higher_is_better else min

    def apart() -> float:
        return max(spread([p[k] for p in passed], 2, higher_is_better) for k in judged or passed[0])

    for attempt in range(attempts):
        if attempt:
            time.sleep(RETRY_PAUSE_S)
        figures, problems = measure_once()
        seen.append(figures)
        if problems:
            rejected = problems
            note(f"{label} run {attempt + 1}/{attempts} rejected: {'; '.join(problems)}")
            if len(passed) + attempts - attempt - 1 < 2:     # two passing runs are out of reach
                break
            continue
        passed.append(figures)
        if len(passed) >= 2 and apart() <= AGREE_LIMIT:
            break
    if len(passed) >= 2:
        return ({k: pick(p[k] for p in passed) for k in passed[0]}, [],
                f"{len(passed)} runs passed, the best two within {apart():.0%}")
    problems = [f"{len(passed)} of {len(seen)} runs passed, 2 needed (of {attempts} at most); the last rejected: "
                f"{'; '.join(rejected)}"]
    return {k: pick(p[k] for p in seen) for k in seen[0]}, problems, ""
