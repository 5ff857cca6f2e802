"""An engine's collector and the runtime levels beside it, driven as one."""
from __future__ import annotations

import select

from profinfer.core.plugin.collector import Collector
from profinfer.core.plugin.packs import Pack
from profinfer.core.profile.model import Profile


class CollectorGroup:
    """An engine's collector and the runtime levels beside it (cuda), driven as one: each
    has its own event buffer; the engine's programs keep each thread's open spans in a map
    the levels share, so a CUDA call carries the step and op it was made in."""

    def __init__(self, first: Collector):
        self.members: list[Collector] = [first]

    @property
    def engine(self) -> Collector:
        return self.members[0]

    def add(self, member: Collector, engine: bool = False) -> None:
        """A level beside the engine; or the engine, when a level was found first."""
        if engine:
            self.members.insert(0, member)
        else:
            self.members.append(member)

    def member(self, pack: Pack) -> Collector | None:
        return next((m for m in self.members if m.pack is pack), None)

    def __getattr__(self, name):            # pid, attach_s, n_probes, ...: the engine's
        return getattr(self.members[0], name)

    @property
    def warnings(self) -> list[str]:
        return [w for m in self.members for w in m.warnings]

    @property
    def n_events(self) -> int:
        return sum(m.n_events for m in self.members)

    @property
    def decoding(self) -> bool:
        return any(m.decoding for m in self.members)

    @property
    def started(self) -> bool:
        """The engine's work began (the CPU shares count from here): its own first event, not
        a level's (a CUDA runtime registers kernels and allocates while a model loads)."""
        engine = self.members[0]
        if not engine.pack.level:
            return engine.decoding or bool(engine.n_events)
        return self.decoding or bool(self.n_events)

    def fileno(self) -> int:
        return self.members[0].fileno()

    def filenos(self) -> list[int]:
        return [m.fileno() for m in self.members]

    def poll(self, timeout_ms: int = 100) -> None:
        if len(self.members) > 1 and timeout_ms:
            select.select(self.filenos(), [], [], timeout_ms / 1000)
            timeout_ms = 0
        for m in self.members:
            m.poll(timeout_ms)

    def refresh_process_info(self) -> None:
        for m in self.members:
            m.refresh_process_info()

    def other_target_processes(self) -> list[int]:
        return sorted({p for m in self.members for p in m.other_target_processes()}
                      - {self.members[0].pid})

    def lost(self) -> int:
        return sum(m.lost() for m in self.members)

    def finish(self) -> Profile:
        """The engine's profile with the levels' calls in it, each call's op named by the
        engine that opened it."""
        engine = self.members[0]
        levels = self.members[1:]
        for m in levels:
            m.name_op = lambda _engine, index, e=engine: e.op_name(index)
        level_profiles = [m.finish() for m in levels]
        prof = engine.finish()
        for lp in level_profiles:
            prof.absorb(lp)
        return prof

    def detach(self) -> None:
        for m in self.members:
            m.detach()
