"""What the vLLM collector probes in one target, and where, resolved at attach: the native ops
of the engine's libraries and the library each is in (ops.py), torch's kernel wrappers probed
for them (wrappers.py), the place of each probe set on an op's own function, the sites where
a trap is measured in the target (core.calibration.insitu), each op's spec (pv_op_spec: how
BPF reads and sends its calls), and the probes' sites in the order they are attached."""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

from profinfer.core.base.errors import ProfinferError
from profinfer.core.calibration import engineprice, insitu
from profinfer.core.target.arch import placement
from profinfer.engines.vllm.decode.calls import TensorLayoutCheck
from profinfer.engines.vllm.probes import ops as native, wrappers

ENTRY_PROGRAM, RETURN_PROGRAM, END_PROGRAM = "vop_enter", "vop_return", "vop_end"
# calls counted, not sent: one in how many calls of the ops the trap is measured on is sent
# meanwhile (their medians are what it compares: a sample does)
TRAP_SAMPLE_ONE_IN = 8


@dataclass
class OpPlan:
    """What is probed, resolved at attach: the native ops and the library each is in, the
    torch kernel wrappers probed for them (by library path: wrappers.py), where the probes of
    each op probed on its own function sit, the pack's step rules, the arguments cost models
    read values of, and the TensorImpl layout the probes read tensors by (checked as records
    come)."""
    ops: list[native.NativeOp] = field(default_factory=list)
    op_library: list[str] = field(default_factory=list)
    wrappers: dict[str, wrappers.WrapperPlan] = field(default_factory=dict)
    placements: dict[str, placement.Placement] = field(default_factory=dict)  # op: its function's probes' place
    step_rules: dict = field(default_factory=dict)
    cost_values: dict[str, int] = field(default_factory=dict)   # op: the argument a cost model reads values of
    tensor_check: TensorLayoutCheck | None = None
    # where a probe that does nothing would cost each call of an op one more trap (insitu.py):
    # op index: (path, file_id, file offset), in the op's own function's entry block
    trap_sites: dict[int, tuple[str, tuple[int, int] | None, int]] = field(default_factory=dict)
    traps: insitu.TrapSampler | None = None      # measuring a trap in the target, once calls come
    trap_ops: list[int] = field(default_factory=list)   # the ops it is measured on
    return_probes: int = 0      # places whose calls end at a return probe, not an end probe
    stepped_sites: set[tuple[str, int]] = field(default_factory=set)   # (path, file offset)
    # a hit's price measured in an engine of this build (profinfer calibrate --pid)
    engine_price: engineprice.EnginePrice | None = None

    # ---- what is probed ----

    def find_ops(self, elfs: list, declared: list | None, warnings: list[str]) -> None:
        """The native ops of the engine's libraries to probe: the pack's declared ones, or
        every op schema that matches a C++ function (an op not probed is said in warnings)."""
        for elf in elfs:
            placement.require_supported(elf.path)
            found, skipped = native.declared_ops(elf, declared) if declared else native.native_ops(elf)
            self.ops.extend(found)
            self.op_library.extend([os.path.basename(elf.path)] * len(found))
            if skipped:
                warnings.append(f"{os.path.basename(elf.path)}: not probed: {', '.join(skipped)}")
        if not self.ops:
            raise ProfinferError(f"{', '.join(e.path for e in elfs)}: no op schema matches a "
                                 "C++ function: not a torch custom-op library profinfer can read")

    def keep_ops(self, names: set[str]) -> None:
        """Only the ops of these names stay probed (the step ops, without the op level)."""
        keep = [i for i, op in enumerate(self.ops) if op.name in names]
        self.ops = [self.ops[i] for i in keep]
        self.op_library = [self.op_library[i] for i in keep]

    def find_wrappers(self, elfs: list) -> None:
        """torch's kernel wrappers to probe for each library's ops, where its code shows them
        (wrappers.py); the ops of a library without are probed on their own functions."""
        for elf in elfs:
            mine = [op for op, lib in zip(self.ops, self.op_library) if lib == os.path.basename(elf.path)]
            found = wrappers.plan(elf, mine) if mine else None
            if found is not None:
                self.wrappers[elf.path] = found

    def find_cost_values(self, cost_rules: dict) -> None:
        """The argument whose values a cost model needs (attention: each sequence's length)."""
        for name, rule in cost_rules.items():
            op = next((o for o in self.ops if o.name == name), None)
            arg = rule.get("attention", {}).get("seq_lens")
            names = [a.name for a in op.schema.args] if op else []
            if arg in names and op.kinds[names.index(arg)] != native.SKIP:
                self.cost_values[name] = names.index(arg)

    def spec(self, dt: dict, op: native.NativeOp, i: int, sending: set[int]) -> np.ndarray:
        """Op i's spec (pv_op_spec): its arguments' kinds and slots, whether its calls begin a
        step and which argument's values they read, and whether a call counted is sent."""
        spec = np.zeros(1, dt["pv_op_spec"])
        spec["n_args"] = len(op.kinds)
        spec["kind"][0, :len(op.kinds)] = op.kinds
        spec["slot"][0, :len(op.slots)] = op.slots
        rule = self.step_rules.get(op.name)
        spec["values_of"] = rule.values_arg if rule else self.cost_values.get(op.name, 0xff)
        spec["starts_step"] = int(rule is not None)
        # counted in BPF, still sent: what a step or a cost model reads per call, and for now
        # a sample of the calls of the ops the in-target trap is measured on
        spec["send"] = (1 if rule is not None or op.name in self.cost_values
                        else TRAP_SAMPLE_ONE_IN if i in sending else 0)
        return spec

    # ---- where the probes go ----

    def sites(self, elfs: list, paths: dict[str, str], engine_files: list) -> list[tuple]:
        """Where the op level's probes go in each library, in the order they are attached:
        (program, path, file_id, file offsets, cookies, return probe). The probes run for
        the followed tgids only (BPF's filter), on the files. engine_files: every library
        of the engine, in the order BPF numbers them."""
        out = []
        for elf in elfs:
            path = paths.get(elf.path, elf.path)
            offsets, cookies, ends = self._wrapper_probes(elf, engine_files)
            # where a call has no end probe, a return probe shares its entry's place
            returned = [(o, c) for o, c, e in zip(offsets, cookies, ends) if e is None]
            found = self.wrappers.get(elf.path)
            file_id = elf.file_id if path == elf.path else None     # a copy: as it was read
            for i, op in enumerate(self.ops):
                sym = elf.find(op.symbol) if self.op_library[i] == os.path.basename(elf.path) else None
                if sym is None:
                    continue
                code = elf.code_bytes(sym, 64)
                if found and op.name in found.covered:
                    self._note_trap_site(i, path, file_id, sym, code, 0)
                    continue
                # on the op's own function: the entry probe reads every argument register and
                # the stack, placed where none has moved (placement.choose), else on the
                # first instruction; the return probe shares its place (the stack pointer has
                # not moved: the return address is still on top)
                place = placement.choose(code, (1, 2, 3, 4, 5, 6))
                self.placements[op.name] = place
                if not place.emulated:
                    self.stepped_sites.add((path, sym.file_offset + place.offset))
                offsets.append(sym.file_offset + place.offset)
                cookies.append(i)
                returned.append((offsets[-1], i))
                self._note_trap_site(i, path, file_id, sym, code, place.offset)
            if not cookies:
                continue
            # the ends first: a call entered between the two has no open span to close
            ended = [(e, c) for c, e in zip(cookies, ends) if e is not None]
            if ended:
                out.append((END_PROGRAM, path, file_id, [e for e, _ in ended], [c for _, c in ended], False))
            if returned:
                out.append((RETURN_PROGRAM, path, file_id, [o for o, _ in returned],
                            [c for _, c in returned], True))
            out.append((ENTRY_PROGRAM, path, file_id, offsets, cookies, False))
        return out

    def _note_trap_site(self, op: int, path: str, file_id, sym, code: bytes, after: int) -> None:
        """Where in the op's own function, past `after` (its probe's place, or its first
        instruction: a wrapper calls it), an instruction the kernel emulates runs on every
        call (its entry block): where a trap is measured in the target (insitu.py)."""
        at = placement.next_emulated(code, after)
        if at is not None and op not in self.trap_sites:
            self.trap_sites[op] = (path, file_id, sym.file_offset + at)

    def _wrapper_probes(self, elf, engine_files: list) -> tuple[list[int], list[int], list[int | None]]:
        """The file offsets and cookies of the kernel wrappers probed for the library's ops,
        and the file offset of each one's end probe (None: a return probe instead)."""
        found = self.wrappers.get(elf.path)
        if found is None:
            return [], [], []
        lib = engine_files.index(elf)
        return ([w.symbol.file_offset + w.place.offset for w in found.wrappers],
                [wrappers.cookie(w.at, lib, found.fn_offset, w.symbol.vaddr + w.place.offset)
                 for w in found.wrappers],
                [None if w.ends_at is None else w.symbol.file_offset + w.ends_at for w in found.wrappers])
