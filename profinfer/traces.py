"""The saved traces the commands read: one trace (`report`, `calibrate --spread-of`), a side
of `diff` (a trace, traces joined by commas, or a directory of them), and two sides compared
with diff's options checked. Bad input is a ProfinferError (one line)."""
from __future__ import annotations

import os

from profinfer.core.base.errors import ProfinferError
from profinfer.core.profile.model import Profile


def load_trace(trace: str, shown: frozenset[str] = frozenset()) -> Profile:
    """A saved trace, with the optional report tables `shown` asked for (Profile.shown)."""
    from profinfer.exporters.trace_reader import TraceFormatError, read_trace
    try:
        profile = read_trace(trace)
        profile.shown = shown
        return profile
    except TraceFormatError as e:
        raise ProfinferError(str(e)) from None
    except OSError as e:        # missing, a loop of links, not a regular file (a FIFO, a device)
        raise ProfinferError(f"cannot read {trace}: {e.strerror}") from None


def trace_paths(arg: str) -> list[str]:
    """A side of diff: a trace, a comma-separated list of traces, or a directory of them."""
    if os.path.isdir(arg):
        try:
            found = sorted(os.path.join(arg, f) for f in os.listdir(arg) if f.endswith(".pftrace"))
        except OSError as e:
            raise ProfinferError(f"cannot list {arg}: {e.strerror}") from None
        if not found:
            raise ProfinferError(f"{arg}: a directory without .pftrace files")
        return found
    return [p for p in arg.split(",") if p] or [arg]


def compare_sides(before: str, after: str, gates, noise: str, confidence: float, statistic: str) -> dict:
    """diff's comparison, its options checked first."""
    from profinfer.exporters import comparison
    rules = tuple(comparison.parse_gate(g) for g in gates)
    floor = comparison.parse_percent(noise, "--noise")
    sides = (trace_paths(before), trace_paths(after))
    return comparison.compare_profiles([load_trace(p) for p in sides[0]],
                                       [load_trace(p) for p in sides[1]], floor, confidence, rules, sides,
                                       statistic)


def write_diff_html(result: dict, path: str) -> None:
    from profinfer.viewers import difftable, html
    html.write_html(result, path, kind="diff", labels={"sections": difftable.SECTION_TITLES})
