"""Every setting profinfer reads from the environment (PROFINFER_*), read here and nowhere else
(tests/test_configuration.py holds that), with its default and meaning: docs/configuration.md
lists the same, and `profinfer doctor` shows the ones in effect. Settings are read at each
use, as the bundled workloads and the tests set some for the processes they start; the
daemon's waits once, when the daemon imports waits.py (so a bad one stops the daemon, in one
line, and no other command). A bad wait is refused (ProfinferError), never taken as the default."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

from profinfer.core.base.errors import ProfinferError


@dataclass(frozen=True)
class Setting:
    name: str
    default: str          # as a person reads it
    meaning: str
    secret: bool = False  # shown as set, never its value


TOKEN = "PROFINFER_TOKEN"
_WAITS = "a wait of the daemon's: docs/configuration.md"
SETTINGS: dict[str, Setting] = {s.name: s for s in (
    Setting("PROFINFER_SERIES_TTL_S", "300", _WAITS),
    Setting("PROFINFER_STALL_S", "30", _WAITS),
    Setting("PROFINFER_STEP_UP_S", "20", _WAITS),
    Setting("PROFINFER_HOLD_STUCK_S", "18", _WAITS),
    Setting("PROFINFER_HOLD_DEADLINE_S", "6", _WAITS),
    Setting("PROFINFER_PARSE_DEADLINE_S", "20", _WAITS),
    Setting("PROFINFER_REQUEST_DEADLINE_S", "10", _WAITS),
    Setting("PROFINFER_NVML_STALL_S", "5", _WAITS),
    Setting("PROFINFER_WATCH_GRACE_S", "60", _WAITS),
    Setting("PROFINFER_BASELINE_SAMPLE_S", "5", _WAITS),
    Setting("PROFINFER_CACHE", "~/.cache/profinfer", "the cache of BPF objects, calibrations, layouts, workloads"),
    Setting("PROFINFER_BPF_PREBUILT", "unset", "a folder of prebuilt BPF objects, used where root's alone"),
    Setting("PROFINFER_HOST_ROOT", "/proc/1/root", "where the daemon reads the host's files"),
    Setting(TOKEN, "unset", "the daemon's control token (else a token file)", secret=True),
    Setting("PROFINFER_PLUGINS", "unset", "more plug-in packages to load, comma-separated"),
    Setting("PROFINFER_UPROBE_LINKS", "uprobe-multi links on Linux 6.6+", "perf: perf-event uprobes instead"),
    Setting("PROFINFER_OP_DESIGN", "one-probe", "two-probe: an entry and an end probe per node"),
    Setting("PROFINFER_OP_PROBES", "the op programs", "bare: a probe that does nothing at the op level's points"),
    Setting("PROFINFER_NODE_CHECK", "by the node's identity", "content: every node's tensor read and checked"),
    Setting("PROFINFER_THREAD_SLOTS", "from the target's threads", "the per-thread array of open spans' size"),
    Setting("PROFINFER_MAX_TRACE_BYTES", "128 MiB", "a daemon capture's trace is cut at this size (lower only)"),
)}


def text(name: str) -> str | None:
    """The setting `name` (one of SETTINGS) as the environment holds it now, else None."""
    if name not in SETTINGS:
        raise KeyError(f"{name} is not a profinfer setting")
    return os.environ.get(name)


def in_effect() -> list[tuple[str, str]]:
    """The settings the environment sets, with their values (a secret's: "set")."""
    return [(n, "set" if s.secret else os.environ[n]) for n, s in SETTINGS.items() if n in os.environ]


def env_seconds(name: str, minimum: float = 0.0) -> float:
    """A number of seconds (`minimum` or more) from the environment, else the setting's default."""
    given = text(name)
    if given is None:
        return float(SETTINGS[name].default)
    try:
        value = float(given)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < minimum:
        raise ProfinferError(f"{name}={given!r}: give a number of seconds, {minimum:g} or more")
    return value
