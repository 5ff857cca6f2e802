"""The calibration a recording is judged with, kept in the recording itself.

At record time the roofs (calibrate) and probe trap costs (probecost) of the machine that ran
the target go into Profile.meta ("roofs:*", "trap:*"), and so into the saved trace. Reports
of a trace use those, wherever they are read; a trace without them (recorded before they
were stored, or before `profinfer calibrate` ran) falls back to this machine's calibration,
and says so.
"""
from __future__ import annotations

import os
import platform
from dataclasses import dataclass

from profinfer.core.calibration import hits, machine_roofs, probecost
from profinfer.core.profile.model import Profile
from profinfer.core.profile.opcolumns import as_columns
from profinfer.core.calibration.roofline import Roofs

ROOF_KEYS = ("read_gbps", "triad_gbps", "fma_gflops", "threads", "check", "measured_at")
STAMPED_TRAP_KEYS = hits.TRAP_KEYS + ("check", "measured_at")


def _op_threads(profile: Profile) -> int:
    """Threads an op runs on: ggml's workers as recorded; for ops that are calls (vLLM), the
    CPUs the process may use (torch's intra-op threads split each op)."""
    if profile.calls:
        try:
            return int(profile.meta["cpus_online"])
        except (KeyError, ValueError):
            return os.cpu_count() or 1
    return len(as_columns(profile.ops).thread_ids()) or 1


def stamp(profile: Profile) -> None:
    """Store this machine's checked roofs (for the recording's op threads) and trap costs."""
    meta = profile.meta
    roofs = machine_roofs.cached(_op_threads(profile)) if profile.ops or profile.calls else None
    if roofs is not None:
        meta.update((f"roofs:{k}", str(roofs[k])) for k in ROOF_KEYS if k in roofs)
        if "caches" in roofs:      # "roofs:caches" = "L1,L2,L3"; then each level's bandwidth and size
            meta["roofs:caches"] = ",".join(c["level"] for c in roofs["caches"])
            for c in roofs["caches"]:
                meta[f"roofs:{c['level']}_gbps"] = str(c["gbps"])
                meta[f"roofs:{c['level']}_bytes"] = str(c["bytes"])
        meta["roofs:cpu"] = machine_roofs.cpu_model()
        meta["roofs:cpus"] = str(os.cpu_count())
    trap = probecost.cached()
    if trap is not None:
        meta.update((f"trap:{k}", str(trap[k])) for k in STAMPED_TRAP_KEYS if k in trap)
        meta["trap:cpu"] = machine_roofs.cpu_model()
        meta["trap:kernel"] = platform.release()


@dataclass
class Judged:
    """A calibration value and where it came from."""
    value: object            # Roofs, a trap-cost dict, or None when there is none
    stored: bool             # taken from the recording (False: this machine's, or none)
    origin: str              # one line: whose calibration it is

    def as_json(self) -> dict:
        return {"stored_in_trace": self.stored, "origin": self.origin}


def _stored_roofs(meta: dict[str, str]) -> Roofs | None:
    """The roofs stamped into a recording's meta (a recording made before the cache roofs
    were stored, or with a calibration that lacks them: DRAM only)."""
    try:
        entry = {"fma_gflops": float(meta["roofs:fma_gflops"]), "read_gbps": float(meta["roofs:read_gbps"])}
        levels = [lvl for lvl in meta.get("roofs:caches", "").split(",") if lvl]
        entry["caches"] = [{"level": lvl, "gbps": meta[f"roofs:{lvl}_gbps"], "bytes": meta[f"roofs:{lvl}_bytes"]}
                           for lvl in levels]
        return machine_roofs.entry_roofs(entry)
    except (KeyError, ValueError):
        return None


def _without_caches(roofs: Roofs) -> str:
    return "" if roofs.caches else ("; the cache roofs were not measured (calibrated before they were: "
                                    "`profinfer calibrate --force`)")


def roofs(profile: Profile) -> Judged:
    meta = profile.meta
    stored = _stored_roofs(meta)
    if stored is not None:
        return Judged(stored, True, f"roofs stored in the recording ({meta.get('roofs:cpu', '?')}, "
                                    f"{meta.get('roofs:threads', '?')} threads, checked, measured "
                                    f"{meta.get('roofs:measured_at', '?')}){_without_caches(stored)}")
    local = machine_roofs.cached(_op_threads(profile))
    if local is None:
        return Judged(None, False, "no roofs in the recording nor calibration on this machine: "
                                   "run `profinfer calibrate` once")
    judged = machine_roofs.entry_roofs(local)
    return Judged(judged, False,
                  f"the recording stores no roofs: judged with this machine's ({machine_roofs.cpu_model()}, "
                  f"{local['threads']} threads), not necessarily the recording machine's"
                  f"{_without_caches(judged)}")


def trap_costs(profile: Profile) -> Judged:
    meta = profile.meta
    try:
        stored = {k: float(meta[f"trap:{k}"]) for k in hits.TRAP_KEYS}
    except (KeyError, ValueError):
        stored = None
    if stored is not None:
        return Judged(stored, True, f"trap costs stored in the recording: {meta.get('trap:cpu', '?')}, "
                                    f"kernel {meta.get('trap:kernel', '?')}")
    local = probecost.cached()
    if local is None:
        return Judged(None, False, "no trap costs in the recording nor on this machine")
    return Judged({k: local[k] for k in hits.TRAP_KEYS}, False,
                  f"the recording stores no trap costs: this machine's are used ({machine_roofs.cpu_model()}, "
                  f"kernel {platform.release()})")
