"""llama.cpp's collector: attach the probe pack to one process (or, with a followed map, to
the engine's files for every watched process), collect its events, detach, build the Profile.

What is probed and how is probes/probeplan.py's; the records are parsed by decode/records.py;
graph backends are named by decode/backends.py; what BPF counts in place of events (a daemon's;
the op level's, when no timeline is asked) is read by decode/totals.py.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from profinfer.core.calibration.hits import Hit
from profinfer.core.plugin import collector as core
from profinfer.core.target import process
from profinfer.core.ebpf import libbpf
from profinfer.core.base.errors import ProfinferError
from profinfer.core.profile.model import OpTotal, Profile, TokenCall
from profinfer.core.plugin.packs import Pack, copies_of_probed
from profinfer.core.ebpf.transport import steps_begun
from profinfer.engines.llamacpp.decode import backends, requests
from profinfer.engines.llamacpp.probes.probeplan import (BARRIER_PROGRAM, GRAPHS_CHANGED_PROGRAMS,
                                                         THREAD_EXIT_PROGRAM, ProbePlan)
from profinfer.engines.llamacpp.decode.records import LlamaRecords
from profinfer.engines.llamacpp.decode.totals import GraphTotals, OpTotals
from profinfer.levels.sched import probe as schedprobe

_ZERO_U32 = bytes(4)
# the op level's PI_TALLY_* counts (a per-CPU array), by the name they have in the meta
OP_TALLIES = (("node_reads", "PI_TALLY_NODE_READS"),
              ("thread_states_in_slots", "PI_TALLY_SLOTS_CLAIMED"),
              ("thread_states_hashed", "PI_TALLY_STATES_HASHED"),
              ("other_process_hits", "PI_TALLY_OTHER_ENTRIES"),
              ("other_process_returns", "PI_TALLY_OTHER_RETURNS"),
              ("bare_hits", "PI_TALLY_BARE_HITS"),
              ("walk_lost", "PI_TALLY_WALK_LOST"),
              ("walk_mismatch", "PI_TALLY_WALK_MISMATCH"))


@dataclass
class TotalsInBpf:
    """What BPF counts in place of sending events: graph computes per process and backend
    (graph, a daemon's), ops per op type and phase (ops), and the readers of those counts."""
    graph: bool
    ops: bool
    graph_counts: GraphTotals
    op_counts: OpTotals | None = None      # made at the first take
    # why ops asked to be counted are recorded one by one instead ("" when they are not)
    ops_recorded_because: str = ""


@dataclass
class OpStatesAtEnd:
    """The op level's per-thread states BPF still held when collection ended."""
    left: int = 0          # op states of threads still alive
    releasing: int = 0     # direct slots found half-released (an exit handler that did not finish)


class LlamaCppCollector(core.Collector):
    HEADER = "llamacpp.h"
    # perf buffers: one wakeup per PERF_WAKEUP_EVENTS records; the timer drains the rest
    PERF_PAGES_PER_CPU, PERF_WAKEUP_EVENTS = 256, 64

    def __init__(self, pid: int, levels: set[str], pack: Pack, lib_paths: list[tuple[str, str]],
                 root: str = "/", tensor_layout: str | None = None, ringbuf_pages: int = 1024,
                 buffer: str = "auto", counters: list[str] | None = None,
                 followed_map_fd: int | None = None, open_spans_fd: int | None = None,
                 graph_totals: bool = False, op_totals: bool = False):
        """With graph_totals, graph computes are counted in BPF per process and backend
        (take_graph_totals), not sent; with op_totals, ops are counted in BPF per op type and
        phase (take_op_totals; the Profile's op_totals), not sent, unless a view asked for
        needs every node (counters, sched: ops_recorded_because)."""
        super().__init__(pid, levels, pack, lib_paths, root, tensor_layout, ringbuf_pages, buffer,
                         counters, followed_map_fd, open_spans_fd)
        because = core.ops_recorded_because(levels, counters, "node") if op_totals and "op" in levels else ""
        self.totals = TotalsInBpf(graph_totals, op_totals and not because,
                                  GraphTotals(self.dt, self._backend_name), ops_recorded_because=because)
        self.elfs: list = []
        self.probed_files: set[tuple[int, int]] = set()
        self.plan: ProbePlan | None = None          # made at attach
        self.records: LlamaRecords | None = None    # made at attach
        self.n_decode_tokens = 0
        self.tallies: dict[str, int] = {}   # the op level's PI_TALLY_* counts
        self.bpf_stats: dict[str, int] = {}
        self.counter_dropped: dict[str, int] = {}
        self.states_at_end = OpStatesAtEnd()

    @property
    def graph_totals(self) -> bool:
        return self.totals.graph

    @property
    def op_totals(self) -> bool:
        return self.totals.ops

    # ---- attach ----

    def _prepare(self) -> None:
        self.elfs = self._mapped_engine_files()
        if not self.elfs:
            raise ProfinferError(f"no {self.pack.engine} in process {self.pid} "
                                 f"(none of {', '.join(self.pack.libraries)} is mapped, "
                                 f"and the executable does not define {self.pack.marker})")
        self.plan = ProbePlan(self.pack, self.elfs, self.levels, self.buffer, self.consts, self.warnings)
        self.plan.resolve(self.forced_layout, bool(self.counter_request), self.n_cpus)
        if self.totals.ops and not self.plan.layout_trusted:
            # op types counted through an unchecked layout could be anything
            self.totals.ops = False
            self.totals.ops_recorded_because = "a table layout is checked on the nodes it reads"
        if self.counter_request:
            if "op" not in self.levels:
                raise ProfinferError("--counters are read per op: add the op level")
            self._open_counters()
        if "sched" in self.levels:
            schedprobe.require_btf()

    def _fill_config(self, cfg: np.ndarray) -> None:
        """This target's struct offsets, counters and what BPF keeps totals of."""
        self.plan.fill_config(cfg)
        cfg["n_counters"] = len(self.counters.counters) if self.counters else 0
        cfg["n_cpus"] = self.n_cpus
        cfg["graph_totals_only"] = int(self.graph_totals)
        cfg["op_totals_only"] = int(self.op_totals)

    def _size_maps(self) -> None:
        self.obj.set_max_entries("counters", self.consts["PI_MAX_COUNTERS"] * self.n_cpus)
        # The per-thread op state is preallocated for the threads expected, not for the
        # program's 4096: direct slots for two computing threads per CPU (at least 64;
        # llamacpp.bpf.c) and a small hash map for threads whose slot another holds, or,
        # without slots, the hash map for four per CPU. A thread beyond them has its ops
        # counted as lost. (A preallocated hash map holds one more element per CPU.) Without
        # the op level, one: its programs are not loaded (bench/results.md: the footprint).
        slots = self.plan.thread_slots
        if slots:
            self.obj.set_max_entries("op_threads_direct", slots)
            self.obj.set_max_entries("op_threads", max(16, self.n_cpus // 2))
        else:
            self.obj.set_max_entries("op_threads", max(64, 4 * self.n_cpus) if "op" in self.levels else 1)

    def _programs(self) -> set[str]:
        return self.plan.programs()

    def _before_probes(self) -> None:
        if "op" in self.levels:
            # the template's owner marks a direct slot being zeroed as not yet free
            template = np.zeros(1, self.dt["pi_op_thread"])
            template["owner"] = self.consts["PI_SLOT_RELEASING"]
            libbpf.map_update(self.obj.map_fd("op_thread_zero"), _ZERO_U32, template.tobytes())
        if self.counters:
            self.counters.install(self.obj.map_fd("counters"), self.n_cpus)
        plan = self.plan
        self.records = LlamaRecords(self.consts, self.dt, plan.op_names,
                                    len(self.counters.counters) if self.counters else 0,
                                    plan.layout, plan.layout_trusted, plan.batch_trusted)
        self.records.task_types = plan.task_types

    def _attach_probes(self) -> None:
        # Probes that announce graph changes go in first: a change made while the op
        # probes were being attached must not go unseen (attach to a running process)
        self._attach_probe_list(self.plan.probes, {})
        self.n_probes += self.plan.n_probes()

    def _after_probes(self) -> None:
        if "op" in self.levels:
            try:
                self.obj.attach(THREAD_EXIT_PROGRAM)
            except ProfinferError as e:
                self.warnings.append(f"exited threads keep their op state ({e}): a process "
                                     "that starts threads for each graph fills it and loses ops")
        if "sched" in self.levels:
            self._add_companion(schedprobe.attach(self.obj, self.buffer, self.wake_bytes,
                                                  self.pid, follow=self.followed_map_fd is not None))

    def _attach_probe_list(self, probes, paths: dict[str, str]) -> None:
        """Attach `probes`, each to its ELF's file or to paths[that file] (another copy of it)."""
        pid = self._probe_pid()
        for p in sorted(probes, key=lambda p: p.entry_fn not in GRAPHS_CHANGED_PROGRAMS):
            path, offset = paths.get(p.elf.path, p.elf.path), p.symbol.file_offset
            file_id = p.elf.file_id if path == p.elf.path else None     # a copy: as it was read
            # the return probe where the entry probe is: rsp has not moved there
            # (placement.choose), so [rsp] is still the return address the kernel replaces
            for fn, ret in ((p.entry_fn, False), (p.return_fn, True)):
                if fn:
                    self._attach_uprobe(fn, path, offset + p.place.offset, pid, retprobe=ret,
                                        file_id=file_id, name=p.symbol.name)
        self.probed_files.update(process.file_key(paths.get(e.path, e.path)) for e in self.elfs)

    def attach_files(self, lib_paths: list[tuple[str, str]]) -> list[str]:
        """Probe more copies of the engine's files (a followed process that maps other files
        than the first): copies of a probed build get its probes; returns what was not
        probed, and why."""
        copies, skipped = copies_of_probed(self.pack, lib_paths, self.elfs, self.probed_files, self.root)
        for elf, host in copies:
            probes = [p for p in self.plan.probes if p.elf is elf]
            self._attach_probe_list(probes, {elf.path: host})
            self.n_probes += self.plan.n_probes(probes)
        return skipped

    # ---- collect ----

    def _on_record(self, data, size):
        self.records.on_record(data, size)

    def _parse(self) -> None:
        r = self.records
        r.parse()
        self.n_events, self.n_decode_tokens, self.decoding = r.n_events, r.n_decode_tokens, r.decoding

    def take_tokens(self) -> list[TokenCall]:
        """The llama_decode calls collected since the last take, in start order, handed over
        and forgotten (a daemon that watches a server for days keeps none of them)."""
        return [t for _, t in self.records.take_token_rows()] if self.records else []

    def take_tokens_by_process(self) -> dict[int, list[TokenCall]]:
        """The same, by process (probes on files serve every process in the followed map)."""
        out: dict[int, list[TokenCall]] = {}
        for tgid, t in self.records.take_token_rows() if self.records else []:
            out.setdefault(tgid, []).append(t)
        return out

    def take_records_by_process(self) -> dict[int, list]:
        """llama-server's request marks since the last take, by process, handed over and
        forgotten (the daemon's metrics.py follows them with bounded state)."""
        marks, self.records.request_marks = (self.records.request_marks, []) if self.records else ([], [])
        out: dict[int, list] = {}
        for m in marks:
            out.setdefault(m.pid, []).append(m)
        return out

    def take_graph_totals(self) -> dict[int, dict[str, tuple[int, int, int, list[int]]]]:
        """With graph_totals: what BPF counted so far (cumulative), by process and backend
        (totals.GraphTotals.read)."""
        if self.obj is None or not self.graph_totals:
            return {}
        return self.totals.graph_counts.read(self.obj, self.plan.graph_probes)

    def take_op_totals(self) -> dict[str, tuple[int, int]]:
        """Per op type, (ops, ns) since the last take, forgotten after (see take_tokens)."""
        if not self.op_totals:
            ops = self.records.ops if self.records else None
            return ops.take_totals() if ops is not None else {}
        if self.obj is None:
            return {}
        return self._op_counts().take(self.obj)

    def _op_counts(self) -> OpTotals:
        if self.totals.op_counts is None:
            self.totals.op_counts = OpTotals(self.dt, self.consts, self.plan.op_names, self.n_cpus)
        return self.totals.op_counts

    def note_process_maps(self, tgid: int):
        """Read a followed process's mappings while it lives (its backends' names are read
        from them, maybe after it has exited); the last ones read."""
        return self.info.note_mappings(tgid)

    def forget_process(self, tgid: int) -> None:
        """A followed process is gone: its graph totals and backend names go too."""
        if self.obj is None:
            return
        self.totals.graph_counts.forget(self.obj, tgid)
        self.info.forget(tgid)

    def cost_counts(self) -> dict[str, int]:
        """What the probes cost so far, as the kernel counts it: BPF run time and the hits by
        kind (bpf_ns, hits_emulated, hits_stepped, hits_return; see _hit_costs), while
        collecting (a daemon's governor reads it)."""
        if not self._counting_costs():
            return {}
        self.tallies = self._op_tallies()
        out = self._hit_costs()
        if self.totals.op_counts is not None:        # counted: the trap as BPF's gaps show it
            trap = self.totals.op_counts.trap_in_situ_ns(self.obj, self.dt["pi_gap_sample"],
                                                        self.consts["PI_GAP_SAMPLES"])
            if trap is not None:
                out["trap_in_situ_ns"] = trap
        return out

    def _backend_name(self, fn_addr: int, pid: int | None = None) -> str:
        """Name of the backend whose get_name function is at fn_addr in the target (or in
        process pid, its mappings read now)."""
        if pid is None:
            return backends.backend_name(fn_addr, self.info.mappings.get(self.pid, []), self.pid, self.root)
        return backends.backend_name(fn_addr, self.note_process_maps(pid), pid, f"/proc/{pid}/root")

    # ---- finish ----

    def finish(self) -> Profile:
        """Stop the op programs, drain everything still in flight, detach, and build the
        Profile."""
        # The op programs stop first (`collecting` = 0): with the target still running
        # (attach, --duration), the per-thread state read below would otherwise change while
        # it is read, and the ring fill up while the probes are detached.
        if "op" in self.levels:
            stopped = np.zeros(1, self.dt["pi_control"]).tobytes()
            libbpf.map_update(self.obj.map_fd(".data.control"), _ZERO_U32, stopped)
        self._drain()
        self._drain_threads()
        counted = self._op_counts().take_by_phase(self.obj) if self.op_totals and "op" in self.levels else None
        trap_in_situ = (self._op_counts().trap_in_situ_ns(self.obj, self.dt["pi_gap_sample"],
                                                          self.consts["PI_GAP_SAMPLES"])
                        if counted is not None else None)
        lost = self._stop_counting_lost()
        self.tallies = self._op_tallies()
        self.bpf_stats = self._hit_costs()
        steps = steps_begun(self.obj)
        self.detach()
        profile = self._build_profile(lost)
        profile.meta["steps_begun"] = str(steps)
        if counted is not None:
            profile.op_totals = [OpTotal(op, phase, calls, ns)
                                 for (op, phase), (calls, ns) in sorted(counted.items())]
            self._op_meta(profile, trap_in_situ)
            profile.meta["op_level"] = "counted"
        elif self.totals.ops_recorded_because:
            profile.meta["op_level"] = f"nodes ({self.totals.ops_recorded_because})"
        return profile

    def _drain_threads(self) -> None:
        """Ops still batched or in progress in the per-thread BPF state at the end."""
        state_dt = self.dt["pi_op_thread"]
        states = [raw for _, raw in self.obj.map_items("op_threads")]
        if self.plan.thread_slots:
            releasing = self.consts["PI_SLOT_RELEASING"]
            for _, raw in self.obj.map_items("op_threads_direct"):
                owner = np.frombuffer(raw, state_dt, count=1)[0]["owner"]
                if owner == releasing:      # an exit handler that did not finish: a bug
                    self.states_at_end.releasing += 1
                elif owner:
                    states.append(raw)
        for raw in states:
            self.states_at_end.left += 1
            st = np.frombuffer(raw[: state_dt.itemsize], state_dt, count=1)[0]
            if self.op_totals:          # counted: only the op it was computing is not yet
                cur = st["cur"]
                if st["has_cur"]:
                    self._op_counts().add_open(int(cur["node"]), int(cur["end_ns"]) - int(cur["start_ns"])
                                               if cur["end_ns"] else 0)
                continue
            batch = st["batch"]
            parts = [batch["ev"][: batch["count"]].copy()]
            if st["has_cur"]:
                cur = np.array([st["cur"]], self.dt["pi_op_event"])
                self._finish_counters(cur, st["ctr_start"], st["ctr_end"])
                parts.append(cur)
            for p in parts:
                if len(p):
                    self.records.add_ops(p)

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

    def _op_tallies(self) -> dict[str, int]:
        """The PI_TALLY_* counts summed over CPUs."""
        return self._read_tallies(((name, self.consts[key]) for name, key in OP_TALLIES),
                                  "op_tallies", per_cpu=True)

    def _hit_costs(self) -> dict[str, int]:
        """The kernel's count of our BPF programs' runs and run time, and the probe hits
        behind them by what each costs (see probecost): a uprobe on an emulated or a
        single-stepped instruction, and what a uretprobe adds on return."""
        stats = self._program_stats()
        if not stats:
            return {}
        out = core.program_costs(stats)
        # the barrier handler's own time, which the in-target trap estimate leaves out
        ns, runs = stats.get(BARRIER_PROGRAM, (0, 0))
        if runs:
            out["barrier_ns_per_run"] = ns // runs
        # A program attached at several places is counted as costly as its costliest place.
        probes = self.plan.probes
        stepped = {fn for p in probes if not p.place.emulated for fn in (p.entry_fn, p.return_fn) if fn}
        with_entry = {p.return_fn for p in probes if p.return_fn and p.entry_fn}
        for fn in {p.entry_fn for p in probes if p.entry_fn}:
            core.add_hits(out, stats.get(fn, (0, 0))[1], entry_emulated=fn not in stepped)
        for fn in {p.return_fn for p in probes if p.return_fn}:
            # the uretprobe's own entry trap is a hit too, where no entry probe shares its place
            core.add_hits(out, stats.get(fn, (0, 0))[1], returns=True,
                          return_trap_emulated=None if fn in with_entry else fn not in stepped)
        # Probes on library files (record) also trap in processes not followed: their hits are
        # theirs, not the target's (their BPF time, a map lookup each, stays in bpf_ns).
        other = self.tallies.get("other_process_hits", 0)
        emulated, returns = Hit.EMULATED.count_key, Hit.RETURN.count_key
        out[emulated] -= min(other, out[emulated])
        out[returns] -= min(self.tallies.get("other_process_returns", 0), out[returns])
        out["other_process_hits"] = other + self.tallies.get("other_process_returns", 0)
        return out

    def _build_profile(self, lost: int) -> Profile:
        prof = Profile(pid=self.pid, process_name=process.process_name(self.pid) or
                       self.thread_names.get(self.pid, ""), lost_events=lost)
        prof.thread_names = dict(self.thread_names)
        prof.meta = self._meta()
        prof.tokens = self.take_tokens()
        prof.graphs = backends.graph_calls(self.records.graphs, self.plan.graph_probes, self._backend_name)
        if self.records.ops is not None:
            self._add_ops(prof)
        if self.records.experts_truncated:
            prof.meta["experts_truncated"] = str(self.records.experts_truncated)
        if self.counters:
            prof.counter_names = [c.name for c in self.counters.counters]
            prof.counter_dropped = dict(self.counter_dropped)
        if "graph" not in self.levels:
            prof.graphs = []
        if self.records.request_marks:
            prof.records[requests.MARKS] = list(self.records.request_marks)
        if len(self.records.sched):
            prof.switches, prof.wakeups = self.records.sched.events({self.pid})
        return prof

    def _add_ops(self, prof: Profile) -> None:
        """The ops assembled, and what the op level's probes saw and cost."""
        assembler, self.records.ops = self.records.ops, None
        prof.meta["node_descriptions"] = str(assembler.n_described)
        prof.meta["node_descriptions_repeated"] = str(assembler.redescribed)
        self._op_meta(prof, self.records.trap_in_situ_ns())
        prof.ops = assembler.finish(prof.graphs, self.records.experts)
        self.counter_dropped = assembler.dropped

    def _op_meta(self, prof: Profile, trap_in_situ_ns: int | None = None) -> None:
        """What the op level's probes saw and cost, recorded or counted."""
        # "generation": a node's description read once per graph change, else every run
        prof.meta["node_check"] = "generation" if self.plan.nodes_by_generation else "content"
        for name, n in self.tallies.items():
            prof.meta[name] = str(n)
        prof.meta["op_probes"] = self.plan.op_design
        if trap_in_situ_ns is not None:
            prof.meta["trap_in_situ_ns"] = str(trap_in_situ_ns)
        walk_faults = self.tallies.get("walk_lost", 0) + self.tallies.get("walk_mismatch", 0)
        if walk_faults:
            self.warnings.append(f"{walk_faults} graph-loop barriers could not be matched to "
                                 "the node the loop computed: some ops may be misattributed "
                                 "(PROFINFER_OP_DESIGN=two-probe measures them apart)")
        prof.meta["thread_slots"] = str(self.plan.thread_slots)
        prof.meta["thread_slots_releasing"] = str(self.states_at_end.releasing)
        # threads still alive when collection ended (an exiting one sends its ops itself)
        prof.meta["op_threads_left"] = str(self.states_at_end.left)

    def _meta(self) -> dict[str, str]:
        meta = self._shared_meta()
        # relates BPF's CLOCK_MONOTONIC to the BOOTTIME of ftrace events in a trace (time
        # spent suspended: never negative, whatever jitter between the two reads)
        meta["boottime_offset_ns"] = str(max(0, time.clock_gettime_ns(time.CLOCK_BOOTTIME)
                                             - time.clock_gettime_ns(time.CLOCK_MONOTONIC)))
        meta["tensor_layout"] = self.plan.layout.name
        meta.update(self._build_id_meta(self.elfs))
        model = next((m.path for m in self.info.mappings.get(self.pid, [])
                      if not m.deleted and m.path.endswith(".gguf")), None)
        if model:
            meta["model"] = model
        meta.update(self._cost_meta(self.bpf_stats))
        for p in self.plan.probes:
            meta[f"probe:{p.symbol.name}+{p.place.offset}"] = (p.place.instruction if p.place.emulated
                                                                else "single-stepped")
        return meta
