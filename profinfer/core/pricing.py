"""`profinfer calibrate --pid`: the engine's traps priced by driving profiling sessions of it
(calibration/enginetrap.py measures and prices; this finds the engine, its sites and its
steps, which only the top of the core may do)."""
from __future__ import annotations

import os
import time

from profinfer.core.base.errors import ProfinferError
from profinfer.core.calibration.engineprice import EnginePrice, save
from profinfer.core.calibration.enginetrap import measure
from profinfer.core.calibration.loadcheck import UnreliableMeasurement
from profinfer.core.plugin.packfinder import engine_process
from profinfer.core.plugin.packs import load_pack, pack_names
from profinfer.core.profile.model import Step
from profinfer.core.session import Session, SessionOptions


def calibrate(pid: int, windows: int, window_s: float, note=lambda m: None) -> EnginePrice:
    """Price the engine's traps in process `pid` (or the descendant that runs it), cache the
    price for its builds and return it."""
    packs = [p for p in map(load_pack, pack_names()) if not p.level]
    pack, engine_pid, files = engine_process(packs, pid)
    cls = pack.collector_class()
    if cls.PRICED_LEVEL is None:
        raise ProfinferError(f"{pack.engine}: its probes' price cannot be measured in the engine "
                             "(its plugin has no steps to time it by)")
    plan = cls(engine_pid, {cls.PRICED_LEVEL, cls.FLOOR_LEVEL}, pack, files, root=f"/proc/{engine_pid}/root")
    sites = plan.pricing_sites()
    if not sites:
        raise ProfinferError(f"PID {engine_pid}: no {cls.PRICED_LEVEL}-level probe sites to price")
    n = sum(len(offsets) for _, _, offsets in sites)
    note(f"PID {engine_pid} ({pack.engine}): {n} {cls.PRICED_LEVEL}-level sites, a probe that does nothing "
         f"on them in {windows} of {2 * windows} windows of {window_s:g} s, its steps timed at the "
         f"{cls.FLOOR_LEVEL} level")

    def record_steps(seconds: float, begin) -> list[Step]:
        session = Session(engine_pid, SessionOptions({cls.FLOOR_LEVEL}, seconds, timeline=False))
        session.on_attached = lambda: begin(lambda: session.stop_reason.append("windows done"))
        prof = session.run()
        return [s for s in prof.steps if s.pid == engine_pid]     # the probes' process's steps

    trap_ns, se_ns, steps, hits_per_step, step_ns = measure(engine_pid, sites, record_steps, windows, window_s)
    if not trap_ns > 2 * se_ns:
        raise UnreliableMeasurement(f"not cached: a hit priced at {trap_ns / 1e3:.2f} µs ± {se_ns / 1e3:.2f} does not "
                             "stand out of the windows' noise (twice its standard error): run it again under "
                             "a steady load, with more --windows")
    try:
        with open(f"/proc/{engine_pid}/cmdline", "rb") as f:
            command = f.read(4096).replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        command = ""
    result = EnginePrice(trap_ns, se_ns, windows, steps, hits_per_step, step_ns, engine_pid, command,
                         time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), sorted({os.path.basename(p) for p, _, _ in sites}))
    save(result, plan.priced_builds())
    return result
