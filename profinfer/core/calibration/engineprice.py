"""A probe hit's price as an engine paid it (`profinfer calibrate --pid`, enginetrap.py),
cached by the build id of the probed files ($PROFINFER_CACHE/engine_traps.json): the
accounting of a later recording or daemon on the same build prices its emulated hits there,
and says where the price was measured.
"""
from __future__ import annotations

import fcntl
import os
from dataclasses import asdict, dataclass

from profinfer.core.target import buildcache
from profinfer.core.base.errors import ProfinferError


@dataclass(frozen=True)
class EnginePrice:
    trap_ns: float             # one hit, as the engine paid it (the bare program's run left out)
    se_ns: float               # its standard error, from the windows' spread
    windows: int               # with the probes (as many without)
    steps: int                 # steps compared, in both kinds of window
    hits_per_step: float
    step_ns: float             # a step's mean period in the windows without the probes
    pid: int
    command: str
    measured_at: str           # UTC, ISO 8601: ordered as text
    files: list[str]


def describe(p: EnginePrice, loop_ns: float | None) -> str:
    loop = "" if loop_ns is None else f"; in a loop, {loop_ns / 1e3:.2f} µs"
    return (f"a probe hit as PID {p.pid}'s engine pays it: {p.trap_ns / 1e3:.2f} µs ± {p.se_ns / 1e3:.2f} "
            f"({p.hits_per_step:.0f} hits a step of {p.step_ns / 1e6:.2f} ms, {p.steps} steps in "
            f"{2 * p.windows} windows{loop}); cached for {', '.join(p.files)}")


def _cache_path() -> str:
    return str(buildcache.cache_dir() / "engine_traps.json")


def _read() -> dict:
    """The cache, if nobody but root or this user could have written it (else {})."""
    return buildcache.load_trusted_dict(_cache_path())


def save(p: EnginePrice, build_ids: list[str]) -> None:
    """Cache `p` for each of these builds (the probed files'), replacing an older price; two
    savers at once take turns (a lock file beside it), so neither loses the other's."""
    path = _cache_path()
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(f"{path}.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            cached = _read()
            for b in build_ids:
                cached[b] = asdict(p)
            buildcache.write_json(path, cached, indent=1)
    except OSError as e:
        raise ProfinferError(f"the price could not be cached in {path}: {e.strerror}") from None


def cached(build_ids: list[str]) -> EnginePrice | None:
    """The price measured on one of these builds, the latest; None where none was."""
    found = []
    for entry in (v for k, v in _read().items() if k in build_ids):
        try:
            p = EnginePrice(**entry)
        except TypeError:                # another version's entry
            continue
        if isinstance(p.trap_ns, (int, float)) and p.trap_ns > 0 and isinstance(p.measured_at, str):
            found.append(p)
    return max(found, key=lambda p: p.measured_at, default=None)


def provenance(p: EnginePrice) -> str:
    return (f"as PID {p.pid}'s engine paid it ({p.measured_at}, {p.windows} windows: "
            f"±{p.se_ns / 1e3:.2f} µs)")
