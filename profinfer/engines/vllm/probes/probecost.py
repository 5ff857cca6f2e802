"""What vLLM's probes cost: the probe hits behind the programs' runs, by what each costs
(core.calibration.selfcost), and one trap as the target pays it (core.calibration.insitu):
the ops it is measured on (the few called most, looked at as calls come), and its reading
from their calls at the end."""
from __future__ import annotations

import time

import numpy as np

from profinfer.core.calibration import engineprice, insitu
from profinfer.core.plugin.collector import add_hits, program_costs
from profinfer.engines.vllm.decode.calls import CallRecords
from profinfer.engines.vllm.decode.totals import CountedCalls
from profinfer.engines.vllm.probes.probeplan import OpPlan

# the in-target trap is measured on this many of the ops called most (insitu.py)
TRAP_OPS = 3
# calls counted, not sent: how often the counts are looked at for the ops called most
TRAP_LOOK_S = 1.0


def probe_costs(plan: OpPlan, stats: dict[str, tuple[int, int]], per_op: dict[str, int],
                tallies: dict[str, int]) -> dict[str, int]:
    """The kernel's count of our programs' runs and run time, and the probe hits behind
    them by what each costs (selfcost): each call's entry trap, emulated or
    single-stepped where its probe sits (a wrapper's: emulated), and its return, whose
    probe shares the entry's place (one trap), or, through a wrapper with an end probe,
    that probe's emulated trap; and the wrapper hits that sent nothing (`unsent`: calls of
    other functions of a probed signature, in `tallies`), by how each ended."""
    if not stats:
        return {}
    out = program_costs(stats)
    ended = set().union(*(w.ended_after_call for w in plan.wrappers.values()))
    for name, n in per_op.items():
        place = plan.placements.get(name)       # None: seen through a wrapper
        if place is None and name in ended:
            add_hits(out, n, True, return_trap_emulated=True)
        else:
            add_hits(out, n, place.emulated if place else True, returns=True)
    returned = tallies.get("unsent_returned", 0)
    add_hits(out, max(0, tallies.get("unsent", 0) - returned), True, return_trap_emulated=True)
    add_hits(out, returned, True, returns=True)
    add_hits(out, stats.get(insitu.PROGRAM, (0, 0))[1], True)    # the trap measure's own
    return out


def calls_so_far(counted: CountedCalls, obj, ev: np.ndarray | None) -> tuple[np.ndarray, int] | None:
    """Calls by op index, and the process that made most, from these records, or where
    calls are counted from the counts (looked at every TRAP_LOOK_S); None: not now."""
    if not counted.on:
        return np.bincount(ev["op"].astype(np.int64)), int(np.bincount(ev["tgid"]).argmax())
    now = time.monotonic()
    if now < counted.look_at:
        return None
    counted.look_at = now + TRAP_LOOK_S
    by_process = counted.reader.calls_by_process(obj)
    if not by_process:
        return None
    return counted.reader.calls_by_op(obj), max(by_process, key=by_process.get)


def trap_ops(calls: np.ndarray, trap_sites: dict) -> list[int]:
    """The few ops called most that have a site: a probe placed and removed at a handful of
    sites, not at every op's, for each window (placing one rewrites the target's code page)."""
    return [int(i) for i in np.argsort(-calls, kind="stable")
            if calls[i] and int(i) in trap_sites][:TRAP_OPS]


def trap_sites_by_file(ops: list[int], trap_sites: dict) -> list[tuple[str, tuple | None, list[int]]]:
    """These ops' sites, by file: (path, file_id, file offsets), as insitu.TrapSampler takes them."""
    by_file: dict[tuple, list[int]] = {}
    for i in ops:
        path, file_id, offset = trap_sites[i]
        by_file.setdefault((path, file_id), []).append(offset)
    return [(path, file_id, offsets) for (path, file_id), offsets in by_file.items()]


def trap_in_situ(plan: OpPlan, records: CallRecords, stats: dict[str, tuple[int, int]]) -> dict[str, str]:
    """One emulated trap as the calls paid it (insitu.py), less the bare program's run:
    the accounting prices the emulated hits at it (selfcost)."""
    if plan.engine_price is not None:
        return {"trap_in_situ_ns": f"{plan.engine_price.trap_ns:.0f}",
                "trap_priced": engineprice.provenance(plan.engine_price)}
    traps = plan.traps
    if traps is None:
        return {}
    ns, runs = stats.get(insitu.PROGRAM, (0, 0))
    start, end, kind = records.timed()
    at_trap_ops = np.isin(kind >> 32, plan.trap_ops)
    found = traps.trap_ns(start[at_trap_ops], end[at_trap_ops], kind[at_trap_ops], bare=(runs, ns))
    out = {"trap_in_situ_windows": str(len(traps.on))}
    if found is not None:
        out["trap_in_situ_ns"], out["trap_in_situ_calls"] = f"{found[0]:.0f}", str(found[1])
    return out
