"""Whether this build lets the op level time each node with one probe per thread (the graph
loop's barriers, llamacpp.bpf.c's op_node_end), and the facts those probes need.

The programs follow ggml_graph_compute_thread's walk over the graph: they need the loop
function's DWARF (which of its barrier calls are the loop's own, not ops' inlined into it;
where the threadpool keeps its graph), and the rule by which the loop skips a node. Where
any of it is missing the op level keeps two probes per node (node start and barrier)."""
from __future__ import annotations

import os
from dataclasses import dataclass

from profinfer.core.base import config
from profinfer.core.target import dwarf
from profinfer.core.base.errors import ProfinferError
from profinfer.core.target.symbols import ElfInfo, Symbol

# ggml_op_is_empty(): nodes the loop passes over without computing or meeting a barrier
EMPTY_OPS = ("NONE", "RESHAPE", "TRANSPOSE", "VIEW", "PERMUTE")
_STRUCTS = ("ggml_threadpool", "ggml_cgraph", "ggml_tensor")


@dataclass
class GraphWalk:
    tp_off_cgraph: int
    cg_off_nodes: int
    cg_off_n_nodes: int
    t_off_flags: int
    compute_flag: int          # 0: this build's loop computes every non-empty node
    empty_ops: tuple[int, ...]
    inlined: list[tuple[int, int]]   # code inlined into the loop function (vaddr ranges)

    def is_loop_call(self, loop: Symbol, offset: int) -> bool:
        """A call at loop+offset is the loop's own, not inside an op inlined into it."""
        pc = loop.vaddr + offset
        return not any(low <= pc < high for low, high in self.inlined)


DESIGNS = ("one-probe", "two-probe")


def requested_design() -> str:
    """PROFINFER_OP_DESIGN: "one-probe" (the default, where the build allows it) or
    "two-probe" (node start and barrier, always)."""
    design = config.text("PROFINFER_OP_DESIGN") or DESIGNS[0]
    if design not in DESIGNS:
        raise ProfinferError(f"PROFINFER_OP_DESIGN={design}: give one of {', '.join(DESIGNS)}")
    return design


def graph_walk(elf: ElfInfo, loop: Symbol, op_names: list[str]) -> tuple[GraphWalk | None, str]:
    """The facts for `loop` (ggml_graph_compute_thread in `elf`), or None and why not."""
    if requested_design() == "two-probe":
        return None, "PROFINFER_OP_DESIGN=two-probe"
    if not elf.dwarf_path:
        return None, f"no DWARF for {os.path.basename(elf.path)}"
    facts = dwarf.function_facts(elf.dwarf_path, loop.vaddr, _STRUCTS,
                                 "GGML_TENSOR_FLAG_")
    if not facts:
        return None, f"no DWARF for {loop.name}"
    structs = facts["structs"]
    try:
        tp_cgraph = structs["ggml_threadpool"]["cgraph"]
        nodes, n_nodes = structs["ggml_cgraph"]["nodes"], structs["ggml_cgraph"]["n_nodes"]
        flags = structs["ggml_tensor"]["flags"]
    except KeyError as e:
        return None, f"{loop.name}'s DWARF has no {e.args[0]}"
    missing = [op for op in EMPTY_OPS if op not in op_names]
    if missing:
        return None, f"this build has no op {missing[0]}"
    return GraphWalk(tp_cgraph, nodes, n_nodes, flags,
                     facts["enums"].get("GGML_TENSOR_FLAG_COMPUTE", 0),
                     tuple(op_names.index(op) for op in EMPTY_OPS),
                     [tuple(r) for r in facts["inlined"]]), ""
