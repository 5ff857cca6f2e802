"""Attach the probe pack to one process, collect its events, detach, build the Profile.

The hot path is in the kernel: op events are batched per thread in BPF and reach user space
PI_OP_BATCH at a time, and a node's description is sent once per thread (op events carry its
number); here each ring-buffer record is only copied, and parsed in bulk with numpy
between polls.
"""
from __future__ import annotations

import ctypes
import os
import platform
import re
import time

import numpy as np

from profinfer.engines.llamacpp import assemble, ggml, graphwalk

from profinfer.core import bpfobj, discovery, dwarf, kernel, layout, libbpf, selfcost
from profinfer.levels.sched import probe as schedprobe
from profinfer.core import perfevents as perfcounters
from profinfer.core.errors import ProfinferError
from profinfer.core.model import GraphCall, Profile, TokenCall, decode_tokens
from profinfer.core.packs import Pack, copies_of_probed, engine_libraries, resolve
from profinfer.core.transport import EventTransport, attach_failed, steps_begun
from profinfer.core.symbols import load_elf

VALIDATE_NODES = 64   # node descriptions checked before a table layout is trusted
PERF_PAGES_PER_CPU = 256
PERF_WAKEUP_EVENTS = 64
# llama_batch_ext (b11434): tokens' offset, a token's size, its pos[0] and its seq_ids
KNOWN_BATCH_EXT = (64, 96, 80, 24)
# std::unordered_set: the first node's pointer (_M_before_begin / __p1_) sits 16 bytes in, in
# libstdc++ and libc++ alike; a node holds its value after the next pointer (libstdc++), or
# after the next pointer and the hash (libc++)
SEQ_SET_FIRST_NODE = 16
SEQ_NODE_VALUE = {"libstdc++": 8, "libc++": 16}
MAX_BATCH = 1 << 20
_ZERO_U32 = bytes(4)
_U32_P = ctypes.POINTER(ctypes.c_uint32)
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


def _runs(ev: np.void) -> tuple[tuple[int, int, int], ...]:
    """A token event's batch runs (sequence, first position, tokens)."""
    return tuple((int(r["seq"]), int(r["pos0"]), int(r["n_tokens"]))
                 for r in ev["runs"][: int(ev["n_runs"])])


class Collector:
    def __init__(self, pid: int, levels: set[str], pack: Pack, lib_paths: list[tuple[str, str]],
                 root: str = "/", tensor_layout: str | None = None, ringbuf_pages: int = 1024,
                 buffer: str = "auto", counters: list[str] | None = None,
                 followed_map_fd: int | None = None, open_spans_fd: int | None = None,
                 graph_totals: bool = False, op_totals: bool = False):
        """With followed_map_fd (a Follower's map, or a daemon's set of watched processes),
        probes go on the library files for every process, and the programs run for the
        processes in the map only. With graph_totals, graph computes are counted in BPF per
        process and backend (take_graph_totals), not sent; with op_totals, ops are counted in
        BPF per op type (take_op_totals), not sent."""
        self.pid = pid
        self.graph_totals = graph_totals
        self.op_totals = op_totals
        self._op_totals_seen: dict[int, tuple[int, int]] = {}
        self.followed_map_fd = followed_map_fd
        self.open_spans_fd = open_spans_fd    # shared with a level under the engine (cuda)
        self.probed_files: set[tuple[int, int]] = set()
        self.levels = set(levels)
        self.pack = pack
        self.lib_paths = lib_paths   # (path to open, path inside the target)
        self.root = root
        self.forced_layout = tensor_layout
        self.ringbuf_pages = ringbuf_pages
        self.buffer = kernel.event_buffer_kind(buffer)
        self.obj: libbpf.BpfObject | None = None
        self.sched_obj: libbpf.BpfObject | None = None
        self.counter_request = list(counters or [])
        self.counters: perfcounters.OpenCounters | None = None
        self._stats_fd = -1                      # BPF run-time statistics on while open
        self.bpf_stats: dict[str, int] = {}
        self.counter_dropped: dict[str, int] = {}
        self.experts_truncated = 0   # MUL_MAT_ID reads with more rows or slots than BPF keeps
        self.warnings: list[str] = []
        self.attach_s = 0.0
        self._raw: list[bytes] = []      # records other than op batches, until parsed
        self._ops_buf = ctypes.create_string_buffer(1 << 20)   # op batches, until parsed
        self._ops_used = 0
        self._tokens: list[np.ndarray] = []
        self._graphs: list[np.ndarray] = []
        self._op_asm: assemble.OpAssembler | None = None   # made once op names are known
        self._entry_gaps: list[np.ndarray] = []   # (release, entry_gap_ns) of fused ops
        self._first_nodes: list[np.ndarray] = []   # node descriptions checked before a table layout is trusted
        self.n_events = 0
        self.n_decode_tokens = 0
        self.op_threads_left = 0       # op states still in BPF when collection ended
        self.nodes_by_generation = False   # descriptions trusted between graph changes
        self.thread_slots = 0          # size of the direct per-thread state array (0: unused)
        self.tallies: dict[str, int] = {}   # the op level's PI_TALLY_* counts
        self.slots_releasing = 0       # direct slots found half-released at the end
        self.thread_names: dict[int, str] = {}
        self._maps_raw: str = ""
        self._layout_trusted = True
        self._batch_trusted = True
        self._lost_at_end = 0         # lost records, as read before detaching
        self.consts, self.dt = layout.parse(header="events.h")
        self.kind_token, self.kind_graph, self.kind_ops = (
            self.consts["PI_EV_TOKEN"], self.consts["PI_EV_GRAPH"], self.consts["PI_EV_OPS"])
        self.kind_switch, self.kind_wakeup = self.consts["PI_EV_SWITCH"], self.consts["PI_EV_WAKEUP"]
        self.kind_experts = self.consts["PI_EV_EXPERTS"]
        self._batch_size = self.dt["pi_op_batch"].itemsize
        self.kind_node = self.consts["PI_EV_NODE"]
        self.kind_decoding = self.consts["PI_EV_DECODING"]
        self.decoding = False          # the target's first llama_decode has begun
        self._experts: dict[tuple[int, int], tuple[tuple[int, ...], ...]] = {}
        self._sched: list[np.ndarray] = []
        self._backend_names: dict[tuple[int, int], str] = {}   # (tgid, get_name address)
        self._process_maps: dict[int, str] = {}     # followed processes' mappings, last read

    # ---- attach ----

    def attach(self) -> None:
        t0 = time.monotonic()
        kernel.require_root()
        obj_path = bpfobj.object_path(self.pack.bpf, self.buffer)
        self.elfs = engine_libraries(self.pack, [h for h, _ in self.lib_paths], self.root,
                                     [n for _, n in self.lib_paths])
        if not self.elfs:
            raise ProfinferError(f"no {self.pack.engine} in process {self.pid} "
                                 f"(none of {', '.join(self.pack.libraries)} is mapped, "
                                 f"and the executable does not define {self.pack.marker})")
        levels = set(self.levels)
        if "op" in levels:
            levels.add("graph")   # graph ends bound each thread's last barrier wait
        self.probes, self.warnings = resolve(self.pack, self.elfs, levels)
        self.layout = ggml.KNOWN_LAYOUTS[0]
        self.op_names: list[str] = []
        if "op" in levels:
            self._decode_structures()
        self.walk: graphwalk.GraphWalk | None = None
        self.op_design = ""
        if "op" in self.levels:
            self._choose_op_design()
        self.probes = [p for p in self.probes if p.entry_fn or p.return_fn]
        if self.counter_request:
            if "op" not in self.levels:
                raise ProfinferError("--counters are read per op: add the op level")
            self.counters = perfcounters.open_counters(self.counter_request,
                                                       self.consts["PI_MAX_COUNTERS"])
            if self.counters.notice:
                self.warnings.append(self.counters.notice)
        if "sched" in self.levels:
            schedprobe.require_btf()
        self.n_cpus = perfcounters.possible_cpus()
        self.thread_slots = self._thread_slots()
        # Descriptions are trusted between graph changes only when every function that
        # announces one is probed (events.h), and ggml_init's by-value params are found on
        # the stack (x86-64); PROFINFER_NODE_CHECK=content reads every run instead.
        changers = {p.symbol.name for p in self.probes if p.entry_fn in GRAPHS_CHANGED_PROGRAMS}
        self.nodes_by_generation = (changers >= GRAPH_CHANGERS and platform.machine() == "x86_64"
                                    and os.environ.get("PROFINFER_NODE_CHECK") != "content")
        if not self.nodes_by_generation:
            self.probes = [p for p in self.probes if p.entry_fn not in GRAPHS_CHANGED_PROGRAMS]
        if os.environ.get("PROFINFER_OP_PROBES") == "bare":
            # the benchmark's floor: the op level's traps, each counted and nothing else
            for p in self.probes:
                if p.entry_fn in OP_PROGRAMS:
                    p.entry_fn = BARE_PROGRAM
        self.obj = libbpf.BpfObject(obj_path)
        try:
            if self.followed_map_fd is not None:
                self.obj.reuse_map("followed", self.followed_map_fd)
            if self.open_spans_fd is not None:
                self.obj.reuse_map("open_spans", self.open_spans_fd)
            cfg = self._config().tobytes()
            self.obj.set_rodata(cfg)
            if self.buffer == "ring":
                self.obj.set_max_entries("events", self.ringbuf_pages * 4096)
            self.obj.set_max_entries("counters", self.consts["PI_MAX_COUNTERS"] * self.n_cpus)
            # The per-thread op state (~78 KB) is preallocated, not the program's 4096 (320 MB
            # of kernel memory): direct slots for two computing threads per CPU (at least
            # 64; llamacpp.bpf.c) and a small hash map for threads whose slot another holds,
            # or, without slots, the hash map for four per CPU. A thread beyond them has its
            # ops counted as lost. (A preallocated hash map holds one more element per CPU.)
            # Without the op level, one (its programs are not loaded: 6 MB of kernel memory a
            # watched process saved, bench/daemon_footprint.py).
            if self.thread_slots:
                self.obj.set_max_entries("op_threads_direct", self.thread_slots)
                self.obj.set_max_entries("op_threads", max(16, self.n_cpus // 2))
            else:
                self.obj.set_max_entries("op_threads", max(64, 4 * self.n_cpus) if "op" in self.levels else 1)
            programs = {fn for p in self.probes for fn in (p.entry_fn, p.return_fn) if fn}
            if "op" in self.levels:
                programs.add(THREAD_EXIT_PROGRAM)
            self.obj.load(programs)
            if "op" in self.levels:
                # the template's owner marks a direct slot being zeroed as not yet free
                template = np.zeros(1, self.dt["pi_op_thread"])
                template["owner"] = self.consts["PI_SLOT_RELEASING"]
                libbpf.map_update(self.obj.map_fd("op_thread_zero"), _ZERO_U32, template.tobytes())
            if self.counters:
                self.counters.install(self.obj.map_fd("counters"), self.n_cpus)
            # what our programs cost, counted by the kernel from the first probe on
            self._stats_fd = libbpf.enable_run_time_stats()
            # Probes that announce graph changes go in first: a change made while the op
            # probes were being attached must not go unseen (attach to a running process)
            self._attach_probes(self.probes, {})
            if "op" in self.levels:
                try:
                    self.obj.attach(THREAD_EXIT_PROGRAM)
                except ProfinferError as e:
                    self.warnings.append(f"exited threads keep their op state ({e}): a process "
                                         "that starts threads for each graph fills it and loses ops")
            if "sched" in self.levels:
                self.sched_obj = schedprobe.attach(
                    self.obj, self.buffer, self.ringbuf_pages * 4096 // 4, self.pid,
                    follow=self.followed_map_fd is not None)
            # perf buffers: one wakeup per PERF_WAKEUP_EVENTS records; the timer drains the rest
            self._events = EventTransport(self.obj, self.buffer, self._on_record,
                                          PERF_PAGES_PER_CPU, PERF_WAKEUP_EVENTS)
        except ProfinferError as e:
            self.detach()
            raise attach_failed(self.pid, e) from None
        self.n_probes = sum(bool(p.entry_fn) + bool(p.return_fn) for p in self.probes) + (
            self.sched_obj.n_links if self.sched_obj else 0)
        self.attach_s = time.monotonic() - t0

    def _choose_op_design(self) -> None:
        """One probe per node and thread where graphwalk.py finds what it needs, else two;
        the op probes' programs are set for the design chosen (self.op_design says which)."""
        loop = next((p for p in self.probes if p.spec.walk_entry == LOOP_PROGRAM), None)
        barriers = [p for p in self.probes if p.entry_fn == BARRIER_PROGRAM]
        why = ""
        if self.counter_request:
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
            if p.spec.level != "op" or p.spec.walk_entry is None:
                continue
            p.entry_fn = p.spec.walk_entry or None
            if p.entry_fn == NODE_END_PROGRAM and not self.walk.is_loop_call(p.symbol, p.place.offset):
                p.entry_fn = None     # an op's own barrier, inlined into the loop

    def _attach_probes(self, probes, paths: dict[str, str]) -> None:
        """Attach `probes`, each to its ELF's file or to paths[that file] (another copy of it)."""
        pid = -1 if self.followed_map_fd is not None else self.pid
        for p in sorted(probes, key=lambda p: p.entry_fn not in GRAPHS_CHANGED_PROGRAMS):
            path, offset = paths.get(p.elf.path, p.elf.path), p.symbol.file_offset
            file_id = p.elf.file_id if path == p.elf.path else None     # a copy: as it was read
            if p.entry_fn:
                self.obj.attach_uprobe(p.entry_fn, path, offset + p.place.offset, pid, file_id=file_id)
            if p.return_fn:
                self.obj.attach_uprobe(p.return_fn, path, offset, pid, retprobe=True, file_id=file_id)
        self.probed_files.update(discovery.file_key(paths.get(e.path, e.path)) for e in self.elfs)

    def attach_files(self, lib_paths: list[tuple[str, str]]) -> list[str]:
        """Probe more copies of the engine's files (a followed process that maps other files
        than the first): copies of a probed build get its probes; returns what was not
        probed, and why."""
        copies, skipped = copies_of_probed(self.pack, lib_paths, self.elfs, self.probed_files, self.root)
        for elf, host in copies:
            probes = [p for p in self.probes if p.elf is elf]
            self._attach_probes(probes, {elf.path: host})
            self.n_probes += sum(bool(p.entry_fn) + bool(p.return_fn) for p in probes)
        return skipped

    def _config(self) -> np.ndarray:
        """The object's `cfg`: this target's struct offsets and the buffer's wakeup level."""
        graph_probes = [p for p in self.probes if p.spec.graph_backend is not None]
        if len(graph_probes) > self.consts["PI_MAX_GRAPH_PROBES"]:
            raise ProfinferError(f"{len(graph_probes)} graph probes resolved; the BPF object has "
                                 f"{self.consts['PI_MAX_GRAPH_PROBES']}")
        bext = self._batch_ext_layout()
        lay = self.layout
        # as node_window()/source_window() in the BPF object compute them
        window = max(lay.type + 4, lay.ne + 32, lay.op + 4, lay.src + 24, lay.view_src + 8,
                     lay.name_off + self.consts["PI_NAME_LEN"],
                     0 if self._layout_trusted else max(lay.nb + 32, lay.view_offs + 8, lay.data + 8))
        if window > self.consts["PI_TENSOR_WINDOW"]:
            raise ProfinferError(f"this ggml_tensor layout ({lay.name}) puts the fields profinfer "
                                 f"reads {window} bytes into a tensor; it reads the first "
                                 f"{self.consts['PI_TENSOR_WINDOW']}")
        cfg = np.zeros(1, self.dt["pi_config"])
        cfg["t_off_type"], cfg["t_off_ne"], cfg["t_off_op"], cfg["t_off_name"] = (
            lay.type, lay.ne, lay.op, lay.name_off)
        cfg["cg_off_n_nodes"] = 4
        cfg["token_sp_off"] = 8   # at entry sp points at the return address; the batch follows
        cfg["bext_off_tokens"], cfg["bext_token_size"], pos, seq_ids, node_value = bext
        if seq_ids is not None and kernel.release_at_least(5, 17):   # bpf_loop
            cfg["bext_tok_off_pos"], cfg["bext_tok_off_seq"] = pos, seq_ids + SEQ_SET_FIRST_NODE
            cfg["seq_node_value"] = node_value
            for p in self.probes:
                if p.entry_fn == "token_enter_ext":
                    p.entry_fn = "token_enter_ext_seqs"
        # wake the collector early once a quarter of the ring is in use
        cfg["transport"]["ring_wake_bytes"] = self.ringbuf_pages * 4096 // 4
        cfg["t_off_src"] = lay.src
        cfg["t_off_view_src"] = lay.view_src
        cfg["t_off_nb"] = lay.nb
        cfg["t_off_data"] = lay.data
        cfg["check_layout"] = int(not self._layout_trusted)   # a table layout: checked live
        cfg["op_mul_mat_id"] = (self.op_names.index("MUL_MAT_ID") if "MUL_MAT_ID" in self.op_names
                                else -1)
        cfg["n_counters"] = len(self.counters.counters) if self.counters else 0
        cfg["n_cpus"] = self.n_cpus
        cfg["nodes_by_generation"] = int(self.nodes_by_generation)
        cfg["thread_slots"] = self.thread_slots
        cfg["transport"]["follow"] = int(self.followed_map_fd is not None)
        cfg["graph_totals_only"] = int(self.graph_totals)
        cfg["op_totals_only"] = int(self.op_totals)
        cfg["init_params_sp_off"] = 8   # above the return address (probes never move sp)
        if self.walk:
            w = self.walk
            cfg["tp_off_cgraph"], cfg["cg_off_nodes"] = w.tp_off_cgraph, w.cg_off_nodes
            cfg["cg_off_n_nodes"], cfg["t_off_flags"] = w.cg_off_n_nodes, w.t_off_flags
            cfg["compute_flag"] = w.compute_flag
            for op in w.empty_ops:
                if op < 128:
                    cfg["empty_ops"][0][op >> 6] |= np.uint64(1 << (op & 63))
        cfg["graph_has_backend"] = sum(1 << i for i, p in enumerate(graph_probes) if p.spec.graph_backend)
        return cfg

    def _thread_slots(self) -> int:
        """Size of the direct per-thread state array (llamacpp.bpf.c): a power of two, two
        slots per CPU or more, at least 64; 0 in the perf-buffer build, which has no BPF
        compare-and-swap to claim a slot with. PROFINFER_THREAD_SLOTS overrides the size
        (tests use 1 to make threads share a slot, 0 to use the hash map alone)."""
        if "op" not in self.levels or self.buffer != "ring":
            return 0
        forced = os.environ.get("PROFINFER_THREAD_SLOTS")
        if forced is not None:
            if not forced.isdigit() or (int(forced) & (int(forced) - 1)):
                raise ProfinferError(f"PROFINFER_THREAD_SLOTS={forced}: give 0 or a power of two")
            return int(forced)
        return 1 << max(6, (2 * self.n_cpus - 1).bit_length())

    def _batch_ext_layout(self) -> tuple[int, int, int, int | None, int]:
        """For the ext decode probe: llama_batch_ext.tokens' offset, a token's size, and in a
        token pos[0]'s and seq_ids' offsets (None: sequences not read), and where a seq_ids
        node holds its value."""
        probe = next((p for p in self.probes if p.entry_fn in ("token_enter_ext", "token_enter_ext_seqs")), None)
        if probe is None:
            return 0, 1, 0, None, 0
        node_value = SEQ_NODE_VALUE["libc++" if probe.elf.needs("libc++.so") else "libstdc++"]
        found = dwarf.struct_layout(probe.elf.dwarf_path, "llama_batch_ext") \
            if probe.elf.dwarf_path else None
        if found and "tokens" in found["members"] and "token" in found["nested"]:
            token = found.get("nested_members", {}).get("token", {})
            return (found["members"]["tokens"], found["nested"]["token"], token.get("pos", 0),
                    token.get("seq_ids") if "pos" in token else None, node_value)
        self._batch_trusted = False
        self.warnings.append("no DWARF for llama_batch_ext: using the b11434 layout, "
                             "validated on the first batches")
        return (*KNOWN_BATCH_EXT, node_value)

    def _decode_structures(self) -> None:
        base = next((e for e in self.elfs if e.find("ggml_op_name")), None)
        if base is None:
            raise ProfinferError("ggml_op_name not found in the engine's libraries: "
                                 "cannot name ops in this build")
        self.op_names = ggml.op_names(base)
        if self.forced_layout:
            self.layout = ggml.layout_by_name(self.forced_layout)
            self._layout_trusted = False
            return
        for elf in [base] + [e for e in self.elfs if e is not base]:
            if elf.dwarf_path:
                found = ggml.tensor_layout_from_dwarf(elf.dwarf_path)
                if found:
                    self.layout = found
                    return
        self.layout = ggml.KNOWN_LAYOUTS[0]
        self._layout_trusted = False
        self.warnings.append(f"no DWARF for ggml_tensor: using the {self.layout.name} layout, "
                             "validated on the first ops")

    # ---- collect ----

    def _on_record(self, data, size):
        # op batches, most of the bytes, are copied once, into one buffer that numpy reads
        # without another copy; other records are few
        if ctypes.cast(data, _U32_P)[0] != self.kind_ops:
            self._raw.append(ctypes.string_at(data, size))
            return
        size = self._batch_size         # perf-buffer records may carry padding after it
        if self._ops_used + size > len(self._ops_buf):
            grown = ctypes.create_string_buffer(2 * len(self._ops_buf) + size)
            ctypes.memmove(grown, self._ops_buf, self._ops_used)
            self._ops_buf = grown
        ctypes.memmove(ctypes.addressof(self._ops_buf) + self._ops_used, data, size)
        self._ops_used += size

    def fileno(self) -> int:
        return self._events.fileno()

    def poll(self, timeout_ms: int = 100) -> None:
        self._events.poll(timeout_ms)
        self._parse_raw()

    def _parse_raw(self) -> None:
        raw, self._raw = self._raw, []
        batch_dt = self.dt["pi_op_batch"]
        node_size = self.dt["pi_node_event"].itemsize
        token_size = self.dt["pi_token_event"].itemsize
        graph_size = self.dt["pi_graph_event"].itemsize
        sched_size = self.dt["pi_sched_event"].itemsize
        nodes = []
        # records of one kind parsed together (one numpy call a kind and drain, not a record)
        tokens, graphs, sched = [], [], []
        for rec in raw:
            kind = int.from_bytes(rec[:4], "little")
            if kind == self.kind_token:
                tokens.append(rec[:token_size])
            elif kind == self.kind_graph:
                graphs.append(rec[:graph_size])
            elif kind == self.kind_node:
                nodes.append(rec if len(rec) == node_size else rec[:node_size])
            elif kind == self.kind_decoding:
                self.decoding = True
            elif kind == self.kind_experts:
                self._add_experts(rec)
            elif kind == self.kind_switch or kind == self.kind_wakeup:
                sched.append(rec[:sched_size])
        if tokens:
            self._add_tokens(np.frombuffer(b"".join(tokens), self.dt["pi_token_event"]))
        if graphs:
            self._graphs.append(np.frombuffer(b"".join(graphs), self.dt["pi_graph_event"]))
            self.n_events += len(graphs)
        if sched:
            self._sched.append(np.frombuffer(b"".join(sched), self.dt["pi_sched_event"]))
            self.n_events += len(sched)
        if nodes:      # before the ops: a node is described before its first op is sent
            evs = np.frombuffer(b"".join(nodes), self.dt["pi_node_event"])
            if not self._layout_trusted:
                self._validate(evs)
            self._assembler().add_nodes(evs)
        if self._ops_used:
            # all batches of this drain parsed at once: one array of batches, the filled
            # slots of each taken with one mask (the buffer is reused once the assembler
            # has copied out what it keeps)
            batches = np.frombuffer(self._ops_buf, batch_dt, count=self._ops_used // batch_dt.itemsize)
            self._ops_used = 0
            if (batches["count"] == batches["ev"].shape[1]).all():    # full: no copy
                ops = batches["ev"].reshape(-1)
            else:
                filled = np.arange(batches["ev"].shape[1]) < batches["count"][:, None]
                ops = batches["ev"][filled]
            self._add_ops(ops)
            self.n_events += len(ops)

    def _add_tokens(self, ev: np.ndarray) -> None:
        n_tokens = ev["n_tokens"]
        if not self._batch_trusted and ((n_tokens < 1) | (n_tokens > MAX_BATCH)).any():
            bad = int(n_tokens[(n_tokens < 1) | (n_tokens > MAX_BATCH)][0])
            raise ProfinferError("unknown llama_batch_ext layout: a batch decodes as "
                                 f"{bad} tokens; this build needs DWARF")
        self._tokens.append(ev)
        self.n_decode_tokens += decode_tokens(n_tokens, ev["n_runs"], ev["runs"]["pos0"],
                                              ev["runs"]["n_tokens"])
        self.n_events += len(ev)

    def take_tokens(self) -> list[TokenCall]:
        """The llama_decode calls collected since the last take, in start order, handed over
        and forgotten (a daemon that watches a server for days keeps none of them)."""
        return [t for _, t in self._take_token_rows()]

    def take_tokens_by_process(self) -> dict[int, list[TokenCall]]:
        """The same, by process (probes on files serve every process in the followed map)."""
        out: dict[int, list[TokenCall]] = {}
        for tgid, t in self._take_token_rows():
            out.setdefault(tgid, []).append(t)
        return out

    def _take_token_rows(self) -> list[tuple[int, TokenCall]]:
        parts, self._tokens = self._tokens, []
        if not parts:
            return []
        t = np.sort(np.concatenate(parts), order="start_ns")
        return [(int(r["tgid"]), TokenCall.of_batch(int(r["tid"]), int(r["start_ns"]), int(r["end_ns"]),
                                                    int(r["n_tokens"]), int(r["ret"]), _runs(r)))
                for r in t]

    def take_graph_totals(self) -> dict[int, dict[str, tuple[int, int, int, list[int]]]]:
        """With graph_totals: what BPF counted so far (cumulative), by process and backend
        ("sched" for the scheduler's graph calls): (calls, ns, nodes, histogram counts, bucket
        k under 2^(k+1) x 1024 ns)."""
        if self.obj is None or not self.graph_totals:
            return {}
        key_dt, val_dt = self.dt["pi_graph_key"], self.dt["pi_graph_total"]
        graph_probes = [p for p in self.probes if p.spec.graph_backend is not None]
        out: dict[int, dict[str, tuple[int, int, int, list[int]]]] = {}
        for k, v in self.obj.map_items("graph_totals"):
            key, val = np.frombuffer(k, key_dt)[0], np.frombuffer(v, val_dt)[0]
            tgid, probe, fn = int(key["tgid"]), int(key["probe"]), int(key["name_fn"])
            if probe < len(graph_probes) and graph_probes[probe].spec.graph_backend:
                backend = self._backend_names.get((tgid, fn))
                if backend is None:
                    backend = self._backend_names[(tgid, fn)] = self._backend_name(fn, tgid)
            else:
                backend = "sched"
            calls, ns, nodes, buckets = out.setdefault(tgid, {}).get(backend, (0, 0, 0, [0] * len(val["buckets"])))
            out[tgid][backend] = (calls + int(val["calls"]), ns + int(val["ns"]), nodes + int(val["nodes"]),
                                  [a + int(b) for a, b in zip(buckets, val["buckets"])])
        return out

    def note_process_maps(self, tgid: int) -> str:
        """Read a followed process's mappings while it lives (its backends' names are read
        from them, maybe after it has exited); the last ones read."""
        try:
            with open(f"/proc/{tgid}/maps") as f:
                text = f.read()
            if text:                        # a zombie's are empty
                self._process_maps[tgid] = text
        except OSError:
            pass
        return self._process_maps.get(tgid, "")

    def forget_process(self, tgid: int) -> None:
        """A followed process is gone: its graph totals and backend names go too."""
        if self.obj is None:
            return
        fd, key_size = self.obj.map_fd("graph_totals"), self.dt["pi_graph_key"].itemsize
        for k, _ in list(self.obj.map_items("graph_totals")):
            if int.from_bytes(k[:4], "little") == tgid:
                libbpf.map_delete(fd, k[:key_size])
        self._backend_names = {k: v for k, v in self._backend_names.items() if k[0] != tgid}
        self._process_maps.pop(tgid, None)

    def cost_counts(self) -> dict[str, int]:
        """What the probes cost so far, as the kernel counts it: BPF run time and the hits by
        kind (bpf_ns, hits_emulated, hits_stepped, hits_return; see _program_stats), while
        collecting (a daemon's governor reads it)."""
        if self._stats_fd < 0 or self.obj is None:
            return {}
        self.tallies = self._op_tallies()
        return self._program_stats()

    def take_op_totals(self) -> dict[str, tuple[int, int]]:
        """Per op type, (ops, ns) since the last take, forgotten after (see take_tokens)."""
        if not self.op_totals:
            return self._op_asm.take_totals() if self._op_asm is not None else {}
        if self.obj is None:
            return {}
        out: dict[str, tuple[int, int]] = {}
        total_dt = self.dt["pi_op_total"]
        for k, v in self.obj.map_items("op_totals"):
            key = int.from_bytes(k[:4], "little")
            total = np.frombuffer(v, total_dt)[0]
            calls, ns = int(total["calls"]), int(total["ns"])
            seen = self._op_totals_seen.get(key, (0, 0))
            if calls > seen[0]:
                self._op_totals_seen[key] = (calls, ns)
                name = assemble.op_name(self.op_names, key & 0xff, ((key >> 8) & 0xff) - 1)
                a, b = out.get(name, (0, 0))
                out[name] = (a + calls - seen[0], b + ns - seen[1])
        return out

    def _add_experts(self, rec: bytes) -> None:
        dt = self.dt["pi_experts_event"]
        ev = np.frombuffer(rec.ljust(dt.itemsize, b"\0"), dt, count=1)[0]
        slots = self.consts["PI_EXPERT_SLOTS"]
        n_used, n_tokens = int(ev["n_used"]), int(ev["n_tokens"])
        rows = min(n_tokens, self.consts["PI_MAX_EXPERT_ROWS"])
        if not 0 < n_used <= slots or rows <= 0:
            self.experts_truncated += 1
            return
        if rows < n_tokens:
            self.experts_truncated += 1
        ids = ev["ids"][: rows * slots].reshape(rows, slots)[:, :n_used]
        self._experts[(int(ev["tid"]), int(ev["start_ns"]))] = tuple(map(tuple, ids.tolist()))
        self.n_events += 1

    def _assembler(self) -> assemble.OpAssembler:
        if self._op_asm is None:
            self._op_asm = assemble.OpAssembler(
                self.op_names, len(self.counters.counters) if self.counters else 0, self.consts)
        return self._op_asm

    def _add_ops(self, ops: np.ndarray) -> None:
        self._assembler().add(ops)
        gap = ops["entry_gap_ns"]
        if gap.any():
            at = gap > 0
            gaps = gap[at].astype(np.int64)     # a fused op starts this long after its release
            self._entry_gaps.append(np.stack([ops["start_ns"][at].astype(np.int64) - gaps, gaps]))

    def _validate(self, nodes: np.ndarray) -> None:
        """Check a table layout on the first node descriptions BPF read with it: every field
        the op table, the DAG and the MoE reads use (ggml.layout_faults). A tenth of
        VALIDATE_NODES may fail (an op whose inputs profinfer has no rule for), even in a
        first drain that holds a few nodes; more refuses it."""
        self._first_nodes.append(nodes)
        seen = np.concatenate(self._first_nodes)[:VALIDATE_NODES]
        for what, bad, checked in ggml.layout_faults(seen, self.op_names):
            if bad > 0.1 * max(checked, VALIDATE_NODES):
                raise ProfinferError(
                    f"unknown ggml_tensor layout: with the {self.layout.name} layout, {what} "
                    f"in {bad} of {checked} nodes; this build needs DWARF (build with -g) or "
                    "a newer profinfer")
        if len(seen) >= VALIDATE_NODES:
            self._layout_trusted = True
            self._first_nodes = []

    def refresh_process_info(self) -> None:
        """Thread names and mappings change while the target runs; keep the latest."""
        names = discovery.thread_names(self.pid)
        if names:
            self.thread_names.update(names)
        try:
            with open(f"/proc/{self.pid}/maps") as f:
                maps = f.read()
        except OSError:
            return
        if maps:        # a process that exited (a zombie) has none: keep what it had
            self._maps_raw = maps

    def other_target_processes(self) -> list[int]:
        """Processes besides self.pid whose CPU time is the target's: none (one process)."""
        return []

    def lost(self) -> int:
        """Records lost (a lost perf record may be a batch of PI_OP_BATCH ops: records are
        counted, and said so)."""
        return self._events.lost() if self.obj else self._lost_at_end

    # ---- finish ----

    def finish(self) -> Profile:
        """Stop the op programs, drain everything still in flight, detach, and build the
        Profile."""
        # The op programs stop first (`collecting` = 0): with the target still running
        # (attach, --duration), the per-thread state read below would otherwise change while
        # it is read, and the ring fill up while the probes are detached (~10k ops a second
        # on the tiny model).
        if "op" in self.levels:
            stopped = np.zeros(1, self.dt["pi_control"]).tobytes()
            libbpf.map_update(self.obj.map_fd(".data.control"), _ZERO_U32, stopped)
        self._events.consume()
        self._parse_raw()
        self._drain_threads()
        lost = self._lost_at_end = self.lost()
        self.tallies = self._op_tallies()
        self.bpf_stats = self._program_stats()
        steps = steps_begun(self.obj)
        self.detach()
        profile = self._build_profile(lost)
        profile.meta["steps_begun"] = str(steps)
        return profile

    def _drain_threads(self) -> None:
        """Ops still batched or in progress in the per-thread BPF state at the end."""
        state_dt = self.dt["pi_op_thread"]
        states = [raw for _, raw in self.obj.map_items("op_threads")]
        if self.thread_slots:
            releasing = self.consts["PI_SLOT_RELEASING"]
            for _, raw in self.obj.map_items("op_threads_direct"):
                owner = np.frombuffer(raw, state_dt, count=1)[0]["owner"]
                if owner == releasing:      # an exit handler that did not finish: a bug
                    self.slots_releasing += 1
                elif owner:
                    states.append(raw)
        for raw in states:
            self.op_threads_left += 1
            st = np.frombuffer(raw[: state_dt.itemsize], state_dt, count=1)[0]
            batch = st["batch"]
            parts = [batch["ev"][: batch["count"]].copy()]
            if st["has_cur"]:
                cur = np.array([st["cur"]], self.dt["pi_op_event"])
                self._finish_counters(cur, st["ctr_start"], st["ctr_end"])
                parts.append(cur)
            for p in parts:
                if len(p):
                    self._add_ops(p)

    def _op_tallies(self) -> dict[str, int]:
        """The PI_TALLY_* counts summed over CPUs (per-CPU values are 8 bytes each)."""
        fd, out = self.obj.map_fd("op_tallies"), {}
        for name, key in (("node_reads", "PI_TALLY_NODE_READS"),
                          ("thread_states_in_slots", "PI_TALLY_SLOTS_CLAIMED"),
                          ("thread_states_hashed", "PI_TALLY_STATES_HASHED"),
                          ("other_process_hits", "PI_TALLY_OTHER_ENTRIES"),
                          ("other_process_returns", "PI_TALLY_OTHER_RETURNS"),
                          ("bare_hits", "PI_TALLY_BARE_HITS"),
                          ("walk_lost", "PI_TALLY_WALK_LOST"),
                          ("walk_mismatch", "PI_TALLY_WALK_MISMATCH")):
            raw = libbpf.map_lookup(fd, self.consts[key].to_bytes(4, "little"), 8 * self.n_cpus)
            out[name] = int(np.frombuffer(raw, np.uint64).sum()) if raw else 0
        return out

    def _program_stats(self) -> dict[str, int]:
        """The kernel's count of our BPF programs' runs and run time, and the probe hits
        behind them by what each costs (see probecost): a uprobe on an emulated or a
        single-stepped instruction, and what a uretprobe adds on return."""
        if self._stats_fd < 0:
            return {}
        stats = dict(self.obj.program_stats())
        if self.sched_obj is not None:
            stats.update(self.sched_obj.program_stats())
        out = selfcost.program_totals(stats)
        # the barrier handler's own time, which the in-target trap estimate leaves out
        ns, runs = stats.get(BARRIER_PROGRAM, (0, 0))
        if runs:
            out["barrier_ns_per_run"] = ns // runs
        # A program attached at several places is counted as costly as its costliest place.
        stepped = {p.entry_fn for p in self.probes if p.entry_fn and not p.place.emulated}
        entry_at_start = {p.return_fn for p in self.probes
                          if p.return_fn and p.entry_fn and p.place.offset == 0}
        for fn in {p.entry_fn for p in self.probes if p.entry_fn}:
            out["hits_stepped" if fn in stepped else "hits_emulated"] += stats.get(fn, (0, 0))[1]
        for fn in {p.return_fn for p in self.probes if p.return_fn}:
            runs = stats.get(fn, (0, 0))[1]
            out["hits_return"] += runs
            if fn not in entry_at_start:     # the uretprobe's own entry trap is a hit too
                out["hits_stepped"] += runs
        # Probes on library files (record) also trap in processes not followed: their hits are
        # theirs, not the target's (their BPF time, a map lookup each, stays in bpf_ns).
        other = self.tallies.get("other_process_hits", 0)
        out["hits_emulated"] -= min(other, out["hits_emulated"])
        out["hits_return"] -= min(self.tallies.get("other_process_returns", 0), out["hits_return"])
        out["other_process_hits"] = other + self.tallies.get("other_process_returns", 0)
        return out

    def _finish_counters(self, cur: np.ndarray, start: np.ndarray, end: np.ndarray) -> None:
        """Counter deltas of a node still open at the end (BPF computes them when the next
        node starts): from the start and latest-barrier reads kept in its thread's state."""
        if not self.counters:
            return
        op = cur[0]
        if op["n_barriers"] == 0:
            op["flags"] |= self.consts["PI_OP_UNFINISHED"]
            return
        op["ctr"][:] = end["counter"] - start["counter"]
        op["ctr_enabled"][:] = np.minimum(end["enabled"] - start["enabled"], 0xFFFFFFFF)
        op["ctr_running"][:] = np.minimum(end["running"] - start["running"], 0xFFFFFFFF)

    def detach(self) -> None:
        """Close every probe, then free buffers, maps and programs.

        Uprobes made through the perf uprobe PMU vanish when their fd closes, so nothing of
        ours survives even a SIGKILL; libbpf's legacy tracefs path is used only without it."""
        if self.sched_obj is not None:
            sched_obj, self.sched_obj = self.sched_obj, None
            sched_obj.close()
        if self.obj is not None:
            obj, self.obj = self.obj, None
            obj.close()
        if self.counters:
            self.counters.close()
        if self._stats_fd >= 0:
            os.close(self._stats_fd)
            self._stats_fd = -1

    def _build_profile(self, lost: int) -> Profile:
        prof = Profile(pid=self.pid, process_name=discovery.process_name(self.pid) or
                       self.thread_names.get(self.pid, ""), lost_events=lost)
        prof.thread_names = dict(self.thread_names)
        prof.meta = self._meta()
        prof.tokens = self.take_tokens()
        # Index = the probe number BPF put in each graph event (the pack's order of graph probes, as resolve() numbered them).
        graph_probes = [p for p in self.probes if p.spec.graph_backend is not None]
        backend_cache: dict[int, str] = {}
        if self._graphs:
            g = np.sort(np.concatenate(self._graphs), order="start_ns")
            for r in g:
                probe = int(r["probe"])
                if graph_probes[probe].spec.graph_backend:
                    fn = int(r["name_fn"])
                    if fn not in backend_cache:
                        backend_cache[fn] = self._backend_name(fn)
                    backend = backend_cache[fn]
                else:
                    backend = "sched"
                prof.graphs.append(GraphCall(int(r["tid"]), int(r["start_ns"]), int(r["end_ns"]),
                                             backend, int(r["n_nodes"]), graph_probes[probe].symbol.name))
        if self._op_asm is not None:
            prof.meta["node_descriptions"] = str(self._op_asm.n_described)
            prof.meta["node_descriptions_repeated"] = str(self._op_asm.redescribed)
            # "generation": a node's description read once per graph change, else every run
            prof.meta["node_check"] = "generation" if self.nodes_by_generation else "content"
            for name, n in self.tallies.items():
                prof.meta[name] = str(n)
            prof.meta["op_probes"] = self.op_design
            in_situ = (selfcost.trap_at_fused_entries(*np.concatenate(self._entry_gaps, axis=1))
                       if self._entry_gaps else None)
            if in_situ is not None:
                prof.meta["trap_in_situ_ns"] = str(in_situ)
            walk_faults = self.tallies.get("walk_lost", 0) + self.tallies.get("walk_mismatch", 0)
            if walk_faults:
                self.warnings.append(f"{walk_faults} graph-loop barriers could not be matched to "
                                     "the node the loop computed: some ops may be misattributed "
                                     "(PROFINFER_OP_DESIGN=two-probe measures them apart)")
            prof.meta["thread_slots"] = str(self.thread_slots)
            prof.meta["thread_slots_releasing"] = str(self.slots_releasing)
            # threads still alive when collection ended (an exiting one sends its ops itself)
            prof.meta["op_threads_left"] = str(self.op_threads_left)
            prof.ops = self._op_asm.finish(prof.graphs, self._experts)
            self.counter_dropped = self._op_asm.dropped
            self._op_asm = None
        if self.experts_truncated:
            prof.meta["experts_truncated"] = str(self.experts_truncated)
        if self.counters:
            prof.counter_names = [c.name for c in self.counters.counters]
            prof.counter_dropped = dict(self.counter_dropped)
        if "graph" not in self.levels:
            prof.graphs = []
        if self._sched:
            prof.switches, prof.wakeups = schedprobe.events(
                np.sort(np.concatenate(self._sched), order="ts_ns"), {self.pid})
        return prof

    def _backend_name(self, fn_addr: int, pid: int | None = None) -> str:
        """Name of the backend whose get_name function is at fn_addr in the target (or in
        process pid, its mappings read now)."""
        maps_raw = self._maps_raw if pid is None else self.note_process_maps(pid)
        root = self.root if pid is None else f"/proc/{pid}/root"
        pid = self.pid if pid is None else pid
        for line in maps_raw.splitlines():
            parts = line.split(None, 5)
            if len(parts) < 6:
                continue
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if not lo <= fn_addr < hi:
                continue
            path = parts[5].replace(" (deleted)", "")
            file_off = fn_addr - lo + int(parts[2], 16)
            try:
                dev = os.makedev(*(int(x, 16) for x in parts[3].split(":")))
                elf = load_elf(discovery.host_path(pid, path, int(parts[4]), parts[0],
                                                    parts[5].endswith("(deleted)"), dev), root)
                for s in elf.symbols.values():
                    if s.file_offset <= file_off < s.file_offset + max(s.size, 1):
                        m = re.match(r"ggml_backend_(\w+?)_(?:get_)?name$", s.name)
                        if m:
                            return m.group(1).upper()
            except ProfinferError:
                pass
            m = re.match(r"libggml-(\w+)", os.path.basename(path))
            return m.group(1).upper() if m else os.path.basename(path)
        return "unknown"

    def _meta(self) -> dict[str, str]:
        meta = {"engine": self.pack.engine, "levels": ",".join(sorted(self.levels)),
                # relates BPF's CLOCK_MONOTONIC to the BOOTTIME of ftrace events in a trace
                # (time spent suspended: never negative, whatever jitter between the two reads)
                "boottime_offset_ns": str(max(0, time.clock_gettime_ns(time.CLOCK_BOOTTIME)
                                              - time.clock_gettime_ns(time.CLOCK_MONOTONIC))),
                "event_buffer": self.buffer,
                "kernel": platform.release(), "tensor_layout": self.layout.name,
                "cpus_online": str(discovery.cpus_of(self.pid)),
                "attach_s": f"{self.attach_s:.3f}"}
        for e in self.elfs:
            name = os.path.basename(e.path) if "/map_files/" not in e.path else e.path
            meta[f"build_id:{name}"] = e.build_id
        for line in self._maps_raw.splitlines():
            if line.endswith(".gguf"):
                meta["model"] = line.split(None, 5)[5]
                break
        meta.update((f"cost:{k}", str(v)) for k, v in self.bpf_stats.items())
        for p in self.probes:
            meta[f"probe:{p.symbol.name}+{p.place.offset}"] = (p.place.instruction if p.place.emulated
                                                                else "single-stepped")
        return meta
