"""The toy engine's collector: toy_decode calls as token calls, toy_op calls as ops. The
attach sequence, polling, lost records and detaching are the core's (Collector); this is what
differs: which functions to probe (the pack's [[probe]]s), and what its records mean."""
from __future__ import annotations

import os

import numpy as np

from profinfer.core.target import process
from profinfer.core.target.arch import placement
from profinfer.core.plugin.collector import Collector, add_hits, program_costs
from profinfer.core.base.errors import ProfinferError
from profinfer.core.profile.model import OpSlice, Profile, TokenCall
from profinfer.core.plugin.packs import copies_of_probed, resolve
from profinfer.core.ebpf.transport import RecordSlots


class ToyCollector(Collector):
    HEADER = "toyengine.h"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.op_names: list[str] = list(self.pack.raw.get("ops", ()))
        self.elfs, self.probes, self.return_traps = [], [], {}
        self.probed_files: set[tuple[int, int]] = set()
        self._slots = RecordSlots(self.dt["toy_event"])
        self._records: list[np.ndarray] = []     # every record, for finish
        self._untaken: list[np.ndarray] = []     # decode records a daemon has not taken yet
        self._calls: dict[int, int] = {}         # calls seen, by record kind (probe hits)

    # ---- attach (the hooks of Collector.attach) ----

    def _prepare(self) -> None:
        self.elfs = self._mapped_engine_files()
        if not self.elfs:
            raise ProfinferError(f"no {self.pack.engine} in process {self.pid}")
        self.probes, self.warnings = resolve(self.pack, self.elfs, self.levels)
        # a return probe sits on the first instruction: its own trap, where the entry probe
        # sits further in, costs what that instruction's does (read now: the files may go)
        self.return_traps = {id(p): placement.choose(p.elf.code_bytes(p.symbol, 64)) for p in self.probes}


    def _programs(self) -> set[str]:
        return {fn for p in self.probes for fn in (p.entry_fn, p.return_fn)}

    def _attach_probes(self, probes=None, paths: dict[str, str] | None = None) -> None:
        """Each probe on its ELF's file, or on paths[that file] (another copy of it)."""
        for p in self.probes if probes is None else probes:
            path = (paths or {}).get(p.elf.path, p.elf.path)
            file_id = p.elf.file_id if path == p.elf.path else None
            self.obj.attach_uprobe(p.entry_fn, path, p.symbol.file_offset + p.place.offset,
                                   self._probe_pid(), file_id=file_id)
            self.obj.attach_uprobe(p.return_fn, path, p.symbol.file_offset, self._probe_pid(),
                                   retprobe=True, file_id=file_id)
            self.n_probes += 2
            self.probed_files.add(process.file_key(path))

    def attach_files(self, lib_paths: list[tuple[str, str]]) -> list[str]:
        copies, skipped = copies_of_probed(self.pack, lib_paths, self.elfs, self.probed_files, self.root)
        for elf, host in copies:
            self._attach_probes([p for p in self.probes if p.elf is elf], {elf.path: host})
        return skipped

    # ---- collect ----

    def _on_record(self, data, size) -> None:
        self._slots.add(data, size)

    def _parse(self) -> None:
        ev = self._slots.take()
        if ev is None:
            return
        ev = ev.copy()
        self._records.append(ev)
        decodes = ev[ev["kind"] == self.consts["TOY_EV_DECODE"]]
        self._untaken.append(decodes)
        for kind, n in zip(*np.unique(ev["kind"], return_counts=True)):
            self._calls[int(kind)] = self._calls.get(int(kind), 0) + int(n)
        self.n_events += len(ev)
        self.n_decode_tokens += int(decodes["n_tokens"][decodes["pos0"] > 0].sum())
        self.decoding = True

    def take_tokens_by_process(self) -> dict[int, list[TokenCall]]:
        """The decode calls since the last take, by process (a daemon's shared probes),
        handed over and forgotten with the records behind them."""
        parts, self._untaken, self._records = self._untaken, [], []
        out: dict[int, list[TokenCall]] = {}
        for r in np.sort(np.concatenate(parts), order="start_ns") if parts else ():
            out.setdefault(int(r["tgid"]), []).append(_token(r))
        return out

    def cost_counts(self) -> dict[str, int]:
        """What the probes cost so far (a daemon's governor reads it)."""
        stats = self._program_stats()
        if not stats:
            return {}
        cost = program_costs(stats)
        for p in self.probes:
            kind = self.consts["TOY_EV_DECODE" if p.spec.level == "token" else "TOY_EV_OP"]
            first = self.return_traps[id(p)]
            add_hits(cost, self._calls.get(kind, 0), p.place.emulated, returns=True,
                     return_trap_emulated=(first.emulated and first.offset == 0) if p.place.offset else None)
        return cost

    # ---- finish ----

    def finish(self) -> Profile:
        self._drain()
        lost = self._stop_counting_lost()
        cost = self.cost_counts()
        self.detach()
        ev = np.sort(np.concatenate(self._records), order="start_ns") if self._records else \
            np.zeros(0, self.dt["toy_event"])
        decodes = ev[ev["kind"] == self.consts["TOY_EV_DECODE"]]
        ops = ev[ev["kind"] == self.consts["TOY_EV_OP"]]
        prof = Profile(pid=self.pid, process_name=process.process_name(self.pid) or "",
                       thread_names=dict(self.thread_names), lost_events=lost)
        prof.tokens = [_token(r) for r in decodes]
        prof.ops = [OpSlice(int(r["tid"]), int(r["cpu"]), int(r["start_ns"]), int(r["end_ns"]),
                            int(r["end_ns"]), self._op_name(int(r["op"])), "", (0, 0, 0, 0), "")
                    for r in ops]
        prof.meta.update(self._shared_meta())
        prof.meta["pack"] = self.pack.name
        prof.meta.update((f"build_id:{os.path.basename(e.path)}", e.build_id) for e in self.elfs)
        prof.meta.update((f"cost:{k}", str(v)) for k, v in cost.items())
        return prof

    def _op_name(self, op: int) -> str:
        return self.op_names[op] if 0 <= op < len(self.op_names) else f"op#{op}"


def _token(r) -> TokenCall:
    """A decode call, its batch one run of one sequence."""
    n = int(r["n_tokens"])
    return TokenCall.of_batch(int(r["tid"]), int(r["start_ns"]), int(r["end_ns"]), n, int(r["ret"]),
                              ((int(r["seq"]), int(r["pos0"]), n),))
