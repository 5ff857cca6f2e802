"""`calibrate`'s work: this machine's roofs and what a probe hit costs here (a measurement
taken while the machine is busy, or whose repetitions disagree, is repeated and never
cached: UnreliableMeasurement, exit 75); what a hit costs one running engine (--pid); how much
runs of one command vary here (--spread-of)."""
from __future__ import annotations

from profinfer.traces import load_trace, trace_paths


def run_spread(runs: str) -> str:
    """The spread of one command's runs (traces joined by commas, or a directory), kept for
    diff; what was kept, said."""
    from profinfer.exporters import comparison, runspread
    paths = trace_paths(runs)
    entry = comparison.spread_of([load_trace(p) for p in paths], paths)
    runspread.store(entry)
    return runspread.describe(entry)


def engine_price(pid: int, windows: int, window_s: float, note) -> str:
    """A hit's price in the running engine `pid` (its steps timed with and without the
    probes), cached for its build; said beside the loop's price."""
    from profinfer.core import pricing
    from profinfer.core.calibration import engineprice, probecost
    from profinfer.core.ebpf import kernel
    kernel.require_root()
    loop = probecost.cached()
    price = pricing.calibrate(pid, windows, window_s, note=note)
    return engineprice.describe(price, loop["emulated_ns"] if loop else None)


def machine(threads: int | None, force: bool, attempts: int, echo, note, error) -> None:
    """The roofs, then a uprobe hit's cost (each tried on its own); the last failure raised,
    any before it said by `error`."""
    from profinfer.core.calibration import machine_roofs, probecost
    from profinfer.core.calibration.loadcheck import UnreliableMeasurement
    from profinfer.core.ebpf import kernel
    failed: list[UnreliableMeasurement] = []
    try:
        r = machine_roofs.calibrate(threads, force, attempts, note=note)
        echo(f"{machine_roofs.describe(r)}\n  checked: {r['check']}; measured {r['measured_at']}")
    except UnreliableMeasurement as e:
        failed.append(e)
    kernel.require_root()     # a uprobe's cost is measured by placing one
    try:
        c = probecost.calibrate(force, attempts, note=note)
        echo(f"{probecost.describe(c)}\n  checked: {c['check']}; measured {c['measured_at']}")
    except UnreliableMeasurement as e:
        failed.append(e)
    for e in failed[:-1]:
        error(str(e))
    if failed:
        raise failed[-1]
