"""What the llama.cpp collector probes in one target, and how: the pack's probes resolved in
its libraries, the op names and ggml_tensor layout of its build, the op level's design (one
probe per node where graphwalk.py finds what it needs, else two), the size of the per-thread
op state, and the layout of the decode batch; and the object's config (`cfg`) they make."""
from __future__ import annotations

import platform

import numpy as np

from profinfer.core.base import config
from profinfer.core.target import dwarf
from profinfer.core.ebpf import kernel
from profinfer.core.base.errors import ProfinferError
from profinfer.core.plugin.packs import Pack, ProbeSpec, resolve
from profinfer.engines.llamacpp.probes import ggml, graphwalk, requests

# llama_batch_ext (b11434): tokens' offset, a token's size, its pos[0] and its seq_ids
KNOWN_BATCH_EXT = (64, 96, 80, 24)
# std::unordered_set: the first node's pointer (_M_before_begin / __p1_) sits 16 bytes in, in
# libstdc++ and libc++ alike; a node holds its value after the next pointer (libstdc++), or
# after the next pointer and the hash (libc++)
SEQ_SET_FIRST_NODE = 16
SEQ_NODE_VALUE = {"libstdc++": 8, "libc++": 16}
# sends an exiting thread's last ops and frees its op state (a raw tracepoint, not a probe)
THREAD_EXIT_PROGRAM = "op_thread_exit"
BARRIER_PROGRAM = "op_barrier"
# the one-probe design's programs (graphwalk.py): the loop's entry, fused ops, its barriers
LOOP_PROGRAM, NODE_END_PROGRAM = "op_graph_loop", "op_node_end"
OP_PROGRAMS = ("op_start", "op_start_fused", BARRIER_PROGRAM,
               LOOP_PROGRAM, "op_fused_mark", NODE_END_PROGRAM)
BARE_PROGRAM = "bare_hit"
# the programs told when the target may change graphs, and the functions that do
GRAPHS_CHANGED_PROGRAMS = ("graphs_changed", "context_made")
GRAPH_CHANGERS = {"ggml_init", "ggml_reset", "ggml_new_graph_custom"}
TOKEN_EXT_PROGRAMS = ("token_enter_ext", "token_enter_ext_seqs")


def graph_backend(spec: ProbeSpec) -> bool | None:
    """A graph probe's pack table says whether its arg 1 points to a ggml_backend; None: not
    a graph probe."""
    graph = spec.table.get("graph")
    return None if graph is None else graph["backend"]


def walk_entry(spec: ProbeSpec) -> str | None:
    """An op probe's program in the one-probe design ("": none in that design; None: the
    probe is not one of either design's)."""
    return spec.table.get("walk_entry")



class ProbePlan:
    def __init__(self, pack: Pack, elfs: list, levels: set[str], buffer: str,
                 consts: dict[str, int], warnings: list[str]):
        self.pack = pack
        self.elfs = elfs
        self.levels = levels
        self.buffer = buffer
        self.consts = consts
        self.warnings = warnings       # the collector's: what is said at attach
        self.probes: list = []
        self.op_names: list[str] = []
        self.layout = ggml.KNOWN_LAYOUTS[0]
        self.layout_trusted = True     # from DWARF; a table layout is checked on the first nodes
        self.batch_trusted = True      # llama_batch_ext from DWARF; the table's is checked
        self.walk: graphwalk.GraphWalk | None = None
        self.op_design = ""
        self.thread_slots = 0          # size of the direct per-thread state array (0: unused)
        self.nodes_by_generation = False   # descriptions trusted between graph changes
        self.task_types: dict[int, str] = {}   # llama-server's task types by value (probes/requests.py)

    def resolve(self, forced_layout: str | None, counters: bool, n_cpus: int) -> None:
        """Resolve the pack's probes and decide how each level is probed (counters: perf
        counters are read per op)."""
        levels = set(self.levels)
        if "op" in levels:
            levels.add("graph")   # graph ends bound each thread's last barrier wait
        self.probes, warnings = resolve(self.pack, self.elfs, levels)
        self.warnings[:0] = warnings
        if "op" in levels:
            self._decode_structures(forced_layout)
        if "op" in self.levels:
            self._choose_op_design(counters)
        self.probes = [p for p in self.probes if p.entry_fn or p.return_fn]
        self.thread_slots = self._thread_slots(n_cpus)
        # Descriptions are trusted between graph changes only when every function that
        # announces one is probed (llamacpp.h), and ggml_init's by-value params are found on
        # the stack (x86-64); PROFINFER_NODE_CHECK=content reads every run instead.
        changers = {p.symbol.name for p in self.probes if p.entry_fn in GRAPHS_CHANGED_PROGRAMS}
        self.nodes_by_generation = (changers >= GRAPH_CHANGERS and platform.machine() == "x86_64"
                                    and config.text("PROFINFER_NODE_CHECK") != "content")
        if not self.nodes_by_generation:
            self.probes = [p for p in self.probes if p.entry_fn not in GRAPHS_CHANGED_PROGRAMS]
        if config.text("PROFINFER_OP_PROBES") == "bare":
            # the benchmark's floor: the op level's traps, each counted and nothing else
            for p in self.probes:
                if p.entry_fn in OP_PROGRAMS:
                    p.entry_fn = BARE_PROGRAM

    @property
    def graph_probes(self) -> list:
        """The graph probes, in the order BPF numbers them in graph events (resolve's)."""
        return [p for p in self.probes if graph_backend(p.spec) is not None]

    def programs(self) -> set[str]:
        programs = {fn for p in self.probes for fn in (p.entry_fn, p.return_fn) if fn}
        if "op" in self.levels:
            programs.add(THREAD_EXIT_PROGRAM)
        return programs

    def n_probes(self, probes=None) -> int:
        return sum(bool(p.entry_fn) + bool(p.return_fn) for p in (self.probes if probes is None else probes))

    def _choose_op_design(self, counters: bool) -> None:
        """One probe per node and thread where graphwalk.py finds what it needs, else two;
        the op probes' programs are set for the design chosen (self.op_design says which)."""
        loop = next((p for p in self.probes if walk_entry(p.spec) == LOOP_PROGRAM), None)
        barriers = [p for p in self.probes if p.entry_fn == BARRIER_PROGRAM]
        why = ""
        if counters:
            why = "counters are read at each node's start"
        elif self.buffer != "ring":
            why = "the perf-buffer build has no atomics"
        elif not kernel.release_at_least(5, 17):
            why = "the graph walk's bpf_loop needs Linux 5.17"
        elif loop is None:
            why = "no ggml_graph_compute_thread symbol"
        elif any(p.symbol is not loop.symbol for p in barriers):
            why = "barrier calls outside ggml_graph_compute_thread"
        else:
            self.walk, why = graphwalk.graph_walk(loop.elf, loop.symbol, self.op_names)
        if self.walk is None:
            self.op_design = f"two probes per node ({why})"
            return
        self.op_design = "one probe per node"
        for p in self.probes:
            if p.spec.level != "op" or walk_entry(p.spec) is None:
                continue
            p.entry_fn = walk_entry(p.spec) or None
            if p.entry_fn == NODE_END_PROGRAM and not self.walk.is_loop_call(p.symbol, p.place.offset):
                p.entry_fn = None     # an op's own barrier, inlined into the loop

    def _thread_slots(self, n_cpus: int) -> int:
        """Size of the direct per-thread state array (llamacpp.bpf.c): a power of two, two
        slots per CPU or more, at least 64; 0 in the perf-buffer build, which has no BPF
        compare-and-swap to claim a slot with. PROFINFER_THREAD_SLOTS overrides the size
        (tests use 1 to make threads share a slot, 0 to use the hash map alone)."""
        if "op" not in self.levels or self.buffer != "ring":
            return 0
        forced = config.text("PROFINFER_THREAD_SLOTS")
        if forced is not None:
            if not forced.isdigit() or (int(forced) & (int(forced) - 1)):
                raise ProfinferError(f"PROFINFER_THREAD_SLOTS={forced}: give 0 or a power of two")
            return int(forced)
        return 1 << max(6, (2 * n_cpus - 1).bit_length())

    def _decode_structures(self, forced_layout: str | None) -> None:
        base = next((e for e in self.elfs if e.find("ggml_op_name")), None)
        if base is None:
            raise ProfinferError("ggml_op_name not found in the engine's libraries: "
                                 "cannot name ops in this build")
        self.op_names = ggml.op_names(base)
        if forced_layout:
            self.layout = ggml.layout_by_name(forced_layout)
            self.layout_trusted = False
            return
        for elf in [base] + [e for e in self.elfs if e is not base]:
            if elf.dwarf_path:
                found = ggml.tensor_layout_from_dwarf(elf.dwarf_path)
                if found:
                    self.layout = found
                    return
        self.layout = ggml.KNOWN_LAYOUTS[0]
        self.layout_trusted = False
        self.warnings.append(f"no DWARF for ggml_tensor: using the {self.layout.name} layout, "
                             "validated on the first ops")

    def fill_config(self, cfg: np.ndarray) -> None:
        """This target's struct offsets, op design and per-thread state in the object's `cfg`."""
        graph_probes = self.graph_probes
        if len(graph_probes) > self.consts["PI_MAX_GRAPH_PROBES"]:
            raise ProfinferError(f"{len(graph_probes)} graph probes resolved; the BPF object has "
                                 f"{self.consts['PI_MAX_GRAPH_PROBES']}")
        self._fill_tensor_offsets(cfg)
        cfg["cg_off_n_nodes"] = 4
        cfg["token_sp_off"] = 8   # at entry sp points at the return address; the batch follows
        cfg["bext_off_tokens"], cfg["bext_token_size"], pos, seq_ids, node_value = self._batch_ext_layout()
        if seq_ids is not None and kernel.release_at_least(5, 17):   # bpf_loop
            cfg["bext_tok_off_pos"], cfg["bext_tok_off_seq"] = pos, seq_ids + SEQ_SET_FIRST_NODE
            cfg["seq_node_value"] = node_value
            for p in self.probes:
                if p.entry_fn == "token_enter_ext":
                    p.entry_fn = "token_enter_ext_seqs"
        cfg["op_mul_mat_id"] = (self.op_names.index("MUL_MAT_ID") if "MUL_MAT_ID" in self.op_names
                                else -1)
        cfg["nodes_by_generation"] = int(self.nodes_by_generation)
        cfg["thread_slots"] = self.thread_slots
        cfg["init_params_sp_off"] = 8   # above the return address (probes never move sp)
        if self.walk:
            w = self.walk
            cfg["tp_off_cgraph"], cfg["cg_off_nodes"] = w.tp_off_cgraph, w.cg_off_nodes
            cfg["cg_off_n_nodes"], cfg["t_off_flags"] = w.cg_off_n_nodes, w.t_off_flags
            cfg["compute_flag"] = w.compute_flag
            for op in w.empty_ops:
                if op < 128:
                    cfg["empty_ops"][0][op >> 6] |= np.uint64(1 << (op & 63))
        cfg["graph_has_backend"] = sum(1 << i for i, p in enumerate(graph_probes) if graph_backend(p.spec))
        self.probes, self.task_types = requests.fill(self.probes, cfg, self.warnings)

    def _fill_tensor_offsets(self, cfg: np.ndarray) -> None:
        lay = self.layout
        # as node_window()/source_window() in the BPF object compute them
        window = max(lay.type + 4, lay.ne + 32, lay.op + 4, lay.src + 24, lay.view_src + 8,
                     lay.name_off + self.consts["PI_NAME_LEN"],
                     0 if self.layout_trusted else max(lay.nb + 32, lay.view_offs + 8, lay.data + 8))
        if window > self.consts["PI_TENSOR_WINDOW"]:
            raise ProfinferError(f"this ggml_tensor layout ({lay.name}) puts the fields profinfer "
                                 f"reads {window} bytes into a tensor; it reads the first "
                                 f"{self.consts['PI_TENSOR_WINDOW']}")
        cfg["t_off_type"], cfg["t_off_ne"], cfg["t_off_op"], cfg["t_off_name"] = (
            lay.type, lay.ne, lay.op, lay.name_off)
        cfg["t_off_src"] = lay.src
        cfg["t_off_view_src"] = lay.view_src
        cfg["t_off_nb"] = lay.nb
        cfg["t_off_data"] = lay.data
        cfg["check_layout"] = int(not self.layout_trusted)   # a table layout: checked live

    def _batch_ext_layout(self) -> tuple[int, int, int, int | None, int]:
        """For the ext decode probe: llama_batch_ext.tokens' offset, a token's size, and in a
        token pos[0]'s and seq_ids' offsets (None: sequences not read), and where a seq_ids
        node holds its value."""
        probe = next((p for p in self.probes if p.entry_fn in TOKEN_EXT_PROGRAMS), None)
        if probe is None:
            return 0, 1, 0, None, 0
        node_value = SEQ_NODE_VALUE["libc++" if probe.elf.needs("libc++.so") else "libstdc++"]
        found = dwarf.struct_layout(probe.elf.dwarf_path, "llama_batch_ext") \
            if probe.elf.dwarf_path else None
        if found and "tokens" in found["members"] and "token" in found["nested"]:
            token = found.get("nested_members", {}).get("token", {})
            return (found["members"]["tokens"], found["nested"]["token"], token.get("pos", 0),
                    token.get("seq_ids") if "pos" in token else None, node_value)
        self.batch_trusted = False
        self.warnings.append("no DWARF for llama_batch_ext: using the b11434 layout, "
                             "validated on the first batches")
        return (*KNOWN_BATCH_EXT, node_value)
