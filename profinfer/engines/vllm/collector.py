"""vLLM's decoder: probe every native op of the `_C` libraries a process maps, collect each
call with its tensor arguments' shapes, and make the engine's steps from them.

The interface is the one the session drives for every collector (core/plugin/collector.py).
What is probed and where is probes/probeplan.py's, what the probes cost probes/probecost.py's;
the calls are parsed by decode/calls.py, the steps made by decode/steps.py, the calls counted
in BPF read by decode/totals.py; the server's own /metrics is scraped by server_metrics.py.
"""
from __future__ import annotations

import ctypes
import os

import numpy as np
import psutil

from profinfer.core.target import process, procfs
from profinfer.core.calibration import engineprice, insitu
from profinfer.core.ebpf import libbpf
from profinfer.core.plugin.collector import Collector, ops_recorded_because
from profinfer.core.base.errors import ProfinferError
from profinfer.core.profile.model import Profile, Step
from profinfer.core.plugin.packs import Pack, copies_of_probed
from profinfer.core.ebpf.transport import RecordSlots, steps_begun
from profinfer.engines.vllm.probes import ops as native, probecost, tensors
from profinfer.engines.vllm.probes.probeplan import END_PROGRAM, ENTRY_PROGRAM, RETURN_PROGRAM, OpPlan
from profinfer.engines.vllm.decode import steps as stepmaker
from profinfer.engines.vllm.decode.calls import CallRecords, TensorLayoutCheck
from profinfer.engines.vllm import server_metrics
from profinfer.engines.vllm.server_metrics import MetricsWindow
from profinfer.engines.vllm.decode.totals import CallTotals, CountedCalls
from profinfer.levels.sched import probe as schedprobe

# the programs' tallies, by their index (bpf/vllm.bpf.c PV_TALLY_*)
TALLIES = ("too_deep", "other_processes", "unsent", "typed", "unsent_returned")
_U32_P = ctypes.POINTER(ctypes.c_uint32)


class Inbox:
    """Records copied out of the event buffer until parsed: the op programs' (in slots of one
    layout) and the sched level's, told apart by their kind."""

    def __init__(self, dt: dict, kind_op: int):
        self.kind_op = kind_op
        # what lies past a record's end in its slot is never read: n_tensors and n_values
        # bound it
        self.ops = RecordSlots(dt["pv_op_event"])
        self.sched = schedprobe.SchedRecords()

    def add(self, data, size) -> None:
        if ctypes.cast(data, _U32_P)[0] != self.kind_op:         # the sched level's
            self.sched.add(ctypes.string_at(data, self.sched.dt.itemsize))
            return
        self.ops.add(data, size)


class VllmCollector(Collector):
    HEADER = "vllm.h"
    MULTI_PROGRAMS = (ENTRY_PROGRAM, RETURN_PROGRAM, END_PROGRAM)
    PRICED_LEVEL, FLOOR_LEVEL = "op", "step"

    def __init__(self, pid: int, levels: set[str], pack: Pack, lib_paths: list[tuple[str, str]],
                 root: str = "/", tensor_layout: str | None = None, ringbuf_pages: int = 1024,
                 buffer: str = "auto", counters: list[str] | None = None,
                 followed_map_fd: int | None = None, open_spans_fd: int | None = None,
                 op_totals: bool = False):
        """With op_totals, the op level's calls are counted in BPF (totals.py; the Profile's
        call_totals), not sent, except those a step or a cost model reads values of, unless
        a view asked for needs every call (counters, sched: ops_recorded_because)."""
        super().__init__(pid, levels, pack, lib_paths, root, tensor_layout, ringbuf_pages, buffer,
                         counters, followed_map_fd, open_spans_fd)
        because = ops_recorded_because(levels, counters, "call") if op_totals and "op" in levels else ""
        self.counted = CountedCalls(op_totals and "op" in levels and not because, because)
        self.plan = OpPlan()
        self.elfs = []
        self.probed_files: set[tuple[int, int]] = set()
        self.records: CallRecords | None = None      # the calls parsed, made at attach
        self._inbox = Inbox(self.dt, self.consts["PV_EV_OP"])
        self.bpf_stats: dict[str, int] = {}
        self.compiled_kernels = 0
        self.counter_names: list[str] = []
        self._server_metrics: MetricsWindow | None = None    # found before the probes, begun after
        self.processes: set[int] = set()    # attach: the tree's processes followed
        self._tree_fd = -1

    @property
    def ops(self) -> list[native.NativeOp]:
        return self.plan.ops

    @property
    def step_rules(self) -> dict:
        return self.plan.step_rules

    @property
    def tensor_check(self) -> TensorLayoutCheck | None:
        return self.plan.tensor_check

    @property
    def sched(self) -> schedprobe.SchedRecords:
        return self._inbox.sched

    @property
    def layout(self) -> tensors.TensorLayout:
        return self.tensor_check.layout

    @property
    def torch_version(self) -> str:
        return self.tensor_check.torch_version

    # ---- attach ----

    def attach(self) -> None:
        super().attach()
        # the server's own account of the same stretch, where it serves /metrics
        if self._server_metrics is not None:
            self._server_metrics.begin()

    def _prepare(self) -> None:
        self.elfs = self._mapped_engine_files()
        if not self.elfs:
            raise ProfinferError(f"no {self.pack.engine} in process {self.pid} (none of "
                                 f"{', '.join(self.pack.libraries)} is mapped)")
        self._find_ops()
        self.plan.find_wrappers(self.elfs)
        if self.outside_account:      # before any probe: records wait on it
            self._server_metrics = MetricsWindow(server_metrics.find(self.pid))
        mapped = [m.path for m in process.mapped_files(self.pid)]
        version = tensors.torch_version(mapped, self.root)
        if version is None and not any(op.kinds for op in self.ops):
            version = tensors.ANY_RELEASE      # no tensor is read: any layout does
        plan = self.plan
        plan.tensor_check = TensorLayoutCheck(tensors.layout_for(version, self.forced_layout),
                                              version or "")
        plan.step_rules = stepmaker.rules(self.pack, self.ops)
        plan.find_cost_values(self.pack.cost_rules())
        plan.engine_price = engineprice.cached(self.priced_builds()) if "op" in self.levels else None
        if "sched" in self.levels:
            schedprobe.require_btf()
        if self.counter_request:
            self._open_counters()
            self.counter_names = [c.name for c in self.counters.counters]
        self.records = CallRecords(self.ops, plan.op_library, self.consts, len(self.counter_names))
        if self.counted.on:
            self.counted.reader = CallTotals(self.dt, self.consts, [op.name for op in self.ops],
                                             self.records.decode_args)

    def _find_ops(self) -> None:
        """The native ops of the engine's libraries to probe (probeplan.py); the step ops
        alone without the op level."""
        self.plan.find_ops(self.elfs, self.pack.raw.get("op"), self.warnings)
        if "op" not in self.levels:
            # the step level alone (a daemon's): only the op that begins each step is probed
            step_ops = set(stepmaker.rules(self.pack, self.ops))
            if not step_ops:
                raise ProfinferError(f"{', '.join(e.path for e in self.elfs)}: none of the pack's "
                                     "step ops is probed: no step level without the op level")
            self.plan.keep_ops(step_ops)
        if len(self.ops) > self.consts["PV_MAX_OPS"]:
            raise ProfinferError(f"{len(self.ops)} native ops; profinfer probes at most "
                                 f"{self.consts['PV_MAX_OPS']}")

    def _size_maps(self) -> None:
        self.obj.set_max_entries("threads", 256)
        self.obj.set_max_entries("counters", self.consts["PI_MAX_COUNTERS"] * self.n_cpus)
        self.obj.set_max_entries("op_hists", max(1, len(self.ops)))

    def _programs(self) -> set[str]:
        return {ENTRY_PROGRAM, RETURN_PROGRAM, END_PROGRAM}

    def _before_probes(self) -> None:
        if "sched" in self.levels:       # the whole tree's threads, as the op programs
            self._add_companion(schedprobe.attach(self.obj, self.buffer, self.wake_bytes,
                                                  self.pid, follow=True))
        if self.followed_map_fd is None:
            # attach: the process and its descendants (vLLM runs the model in a child of
            # the API server, one per rank), kept in the object's own `followed` map
            self._tree_fd = self.obj.map_fd("followed")
            self._follow_tree()
        if self.counters:
            self.counters.install(self.obj.map_fd("counters"), self.n_cpus)
        for i in range(len(self.ops)):
            self._write_specs(i)
        by_fn = self.obj.map_fd("op_by_fn")
        for lib, elf in enumerate(self.elfs):     # the ops the wrappers call, by their functions
            found = self.plan.wrappers.get(elf.path)
            for i, op in enumerate(self.ops):
                sym = elf.find(op.symbol) if found and op.name in found.covered else None
                if sym is not None and self.plan.op_library[i] == os.path.basename(elf.path):
                    key = np.zeros(1, self.dt["pv_fn_key"])
                    key["lib"], key["vaddr"] = lib, sym.vaddr
                    libbpf.map_update(by_fn, key.tobytes(), i.to_bytes(4, "little"))

    def _attach_probes(self) -> None:
        self._attach_ops(self.elfs, {})

    def _follow_tree(self) -> None:
        """Add the process's descendants started since (a restarted worker) to `followed`."""
        try:
            tree = [self.pid] + [c.pid for c in psutil.Process(self.pid).children(recursive=True)]
        except psutil.Error:
            return
        for tgid in tree:
            if tgid not in self.processes:
                libbpf.map_update(self._tree_fd, tgid.to_bytes(4, "little"), (1).to_bytes(4, "little"))
                self.processes.add(tgid)

    def _follows(self) -> bool:
        return True         # a process tree: record's follower's, or attach's own

    def _fill_config(self, cfg: np.ndarray) -> None:
        lay = self.layout
        cfg["ti_off_storage"], cfg["st_off_data"] = lay.storage, lay.storage_data
        cfg["ti_off_sizes"], cfg["ti_off_storage_offset"] = lay.sizes, lay.storage_offset
        cfg["ti_off_numel"], cfg["ti_off_dtype"] = lay.numel, lay.dtype
        cfg["n_counters"] = len(self.counters.counters) if self.counters else 0
        cfg["n_cpus"] = self.n_cpus
        cfg["op_totals_only"] = int(self.counted.on)

    def _write_specs(self, i: int) -> None:
        """Op i's specs: its own function's, and a typed wrapper's (its index plus PV_MAX_OPS)."""
        op, fd, sending = self.ops[i], self.obj.map_fd("op_specs"), self.counted.sending
        libbpf.map_update(fd, i.to_bytes(4, "little"), self.plan.spec(self.dt, op, i, sending).tobytes())
        shifted = native.describe(op.schema, op.symbol, leading=2)
        if shifted is not None:
            libbpf.map_update(fd, (i + self.consts["PV_MAX_OPS"]).to_bytes(4, "little"),
                              self.plan.spec(self.dt, shifted, i, sending).tobytes())

    def _attach_ops(self, elfs, paths: dict[str, str]) -> None:
        for program, path, file_id, offsets, cookies, retprobe in self.plan.sites(elfs, paths, self.elfs):
            if retprobe:
                self._attach_uprobes(program, path, offsets, cookies, -1, retprobe=True, file_id=file_id)
                self.plan.return_probes += len(offsets)
            else:
                self._attach_uprobes(program, path, offsets, cookies, -1, file_id=file_id)
            if program == ENTRY_PROGRAM:
                self.n_probes += 2 * len(cookies)
                self.probed_files.add(process.file_key(path))

    def pricing_sites(self) -> list[tuple[str, tuple[int, int] | None, list[int]]]:
        """Every place the op level traps (enginetrap.py): its entry, end and return probes'
        (a return probe's trap is priced at its entry's place: the same instruction), by
        file, less the step level's (a probe beside one of those shares its trap) and those
        the kernel single-steps (the price is an emulated hit's)."""
        self._prepare()
        floor = VllmCollector(self.pid, {self.FLOOR_LEVEL}, self.pack, self.lib_paths, root=self.root)
        floor._prepare()
        taken = {(path, o) for _, path, _, offsets, _, _ in floor.plan.sites(floor.elfs, {}, floor.elfs)
                 for o in offsets}
        found = self.plan.sites(self.elfs, {}, self.elfs)
        taken |= self.plan.stepped_sites
        by_file: dict[tuple, set[int]] = {}
        for _, path, file_id, offsets, _, _ in found:
            by_file.setdefault((path, file_id), set()).update(o for o in offsets if (path, o) not in taken)
        return [(path, file_id, sorted(offsets)) for (path, file_id), offsets in by_file.items() if offsets]

    def priced_builds(self) -> list[str]:
        return [e.build_id for e in self.elfs if e.build_id]

    def attach_files(self, lib_paths: list[tuple[str, str]]) -> list[str]:
        """More copies of the probed libraries (a followed process mapping other files);
        another build's are not probed (returned, with why)."""
        copies, skipped = copies_of_probed(self.pack, lib_paths, self.elfs, self.probed_files, self.root)
        for elf, host in copies:
            self._attach_ops([elf], {elf.path: host})
        return skipped

    # ---- collect ----

    def _on_record(self, data, size):
        self._inbox.add(data, size)

    def _parse(self) -> None:
        ev = self._inbox.ops.take()
        if ev is not None:
            if not self.tensor_check.trusted:
                self.tensor_check.check(ev, self.ops)
            self.records.add(ev)
            self.n_events += len(ev)
            self.decoding = True
        if ev is not None or self.counted.on:
            self._sample_traps(ev)

    def _sample_traps(self, ev: np.ndarray | None) -> None:
        """Measure a trap in the target (insitu.py) from once the op level's calls come, in
        the process that makes them; a failure to is said, and the calibration's cost used.
        Where calls are counted, those of the ops it is measured on are sent meanwhile."""
        plan = self.plan
        if self.plan.engine_price is not None:      # priced in the engine's steps: no trap beside
            return
        if plan.traps is not None:
            plan.traps.tick()
            if self.counted.sending and (plan.traps.done or plan.traps.error):
                self._send_for_now(set())
            return
        if "op" not in self.levels or not plan.trap_sites or self.obj is None:
            return
        found = probecost.calls_so_far(self.counted, self.obj, ev)
        if found is None:
            return
        calls, pid = found
        plan.trap_ops = probecost.trap_ops(calls, plan.trap_sites)
        if not plan.trap_ops:       # none of these calls' ops has a site: the next records'
            return
        try:
            sites = probecost.trap_sites_by_file(plan.trap_ops, plan.trap_sites)
            plan.traps = insitu.TrapSampler(sites, pid, self.buffer)
        except ProfinferError as e:
            plan.trap_sites = {}
            self.warnings.append(f"the trap's cost in the target not measured: {e}")
            return
        self._add_companion(plan.traps.obj)
        if self.counted.on:
            self._send_for_now(set(plan.trap_ops))

    def _send_for_now(self, ops: set[int]) -> None:
        """A sample of the counted calls of these ops is sent (none: all counted again)."""
        changed, self.counted.sending = self.counted.sending ^ ops, ops
        for i in changed:
            self._write_specs(i)

    def refresh_process_info(self) -> None:
        if self._tree_fd >= 0 and self.obj is not None:
            self._follow_tree()
        paths: set[str] = set()
        for pid in self.processes or {self.pid}:
            self.info.refresh(pid, mappings=False)
            paths.update(m.path for m in procfs.file_mappings(pid) if not m.deleted)
        # torch.compile's inductor loads the kernels it generates as shared libraries
        self.compiled_kernels = max(self.compiled_kernels,
                                    sum(1 for p in paths if "inductor" in p and p.endswith(".so")))

    def other_target_processes(self) -> list[int]:
        """The rest of the profiled tree (the worker that runs the model, the engine core):
        the probes' cost is a share of all their CPU time."""
        return sorted(self.processes - {self.pid})

    def take_steps_by_process(self) -> dict[int, list[Step]]:
        """While collecting (a daemon, at the step level): the steps begun since the last
        take, by process, each one its step op's call (its end is that call's), handed over
        and forgotten with the calls behind them."""
        return self.records.take_steps(self.step_rules)

    def cost_counts(self) -> dict[str, int]:
        """What the probes cost so far (probecost.probe_costs), while collecting (a daemon's governor)."""
        if not self._counting_costs():
            return {}
        out = probecost.probe_costs(self.plan, self.obj.program_stats(), self._calls_by_op(),
                                    self._read_tallies((name, TALLIES.index(name))
                                                       for name in ("unsent", "unsent_returned")))
        if out and self.plan.engine_price is not None:       # the governor prices the hits as the engine pays them
            out["trap_in_situ_ns"] = round(self.plan.engine_price.trap_ns)
        return out

    def _calls_by_op(self) -> dict[str, int]:
        """Calls so far by op name: sent and counted."""
        out = self.records.calls_by_op()
        if self.counted.on and self.obj is not None:
            for op, n in zip(self.ops, self.counted.reader.calls_by_op(self.obj).tolist()):
                if n:
                    out[op.name] = out.get(op.name, 0) + n
        return out

    def take_op_totals(self) -> dict[str, tuple[int, int]]:
        """Calls since the last take, (calls, ns) by op (a daemon's): those counted, and
        those sent (a step op's, ...), which are then forgotten."""
        if not self.counted.on or self.obj is None:
            return {}
        out = self.counted.reader.take(self.obj)
        for op, (calls, ns) in self.records.take_by_op().items():
            a, b = out.get(op, (0, 0))
            out[op] = (a + calls, b + ns)
        self.records.step_ends.clear()
        return out

    def _step_ends_now(self) -> dict[tuple[int, int], tuple[int, int]]:
        """Each thread's current step as BPF saw its calls end: (tid, step): (end_ns, calls)."""
        dt, out = self.dt["pv_thread"], {}
        for k, v in libbpf.map_items(self.obj.map_fd("threads"), 4, dt.itemsize):
            th = np.frombuffer(v, dt)[0]
            if int(th["step"]):
                out[(int.from_bytes(k, "little"), int(th["step"]))] = (int(th["step_end_ns"]),
                                                                       int(th["step_calls"]))
        return out

    def op_name(self, index: int) -> str:
        """The op a thread's open span names (a level under the engine reads it)."""
        return self.ops[index].name if 0 <= index < len(self.ops) else f"op#{index}"

    # ---- finish ----

    def finish(self) -> Profile:
        server = self._server_metrics.delta() if self._server_metrics else {}
        self._drain()
        lost = self._stop_counting_lost()
        stats = self._program_stats()
        tallies = self._read_tallies((name, i) for i, name in enumerate(TALLIES))
        steps = steps_begun(self.obj)
        calls_by_op = self._calls_by_op()
        counted, hists, step_ends = [], {}, None
        if self.counted.on:
            counted, hists = self.counted.reader.totals(self.obj), self.counted.reader.hists(self.obj)
            step_ends = {**self.records.step_ends, **self._step_ends_now()}
        self.detach()
        calls = self.records.calls()
        self.bpf_stats = probecost.probe_costs(self.plan, stats, calls_by_op, tallies)
        trap_meta = probecost.trap_in_situ(self.plan, self.records, stats)
        prof = Profile(pid=self.pid, process_name=process.process_name(self.pid) or "",
                       thread_names=dict(self.thread_names), calls=calls, lost_events=lost)
        if len(self.sched):
            prof.switches, prof.wakeups = self.sched.events(self.processes or {self.pid})
        if self.counter_names:
            prof.counter_names = list(self.counter_names)
            prof.counter_dropped = dict(self.records.counter_dropped)
        prof.steps = stepmaker.steps(calls, self.step_rules, step_ends)
        prof.call_totals = counted
        for i, (_, _, counts) in hists.items():
            name = self.ops[i].name        # an op in two libraries: one histogram
            prof.call_hists[name] = prof.call_hists[name] + counts if name in prof.call_hists else counts
        prof.meta.update(self._meta(tallies))
        if self.counted.on:
            prof.meta["op_level"] = "counted"
        elif self.counted.recorded_because:
            prof.meta["op_level"] = f"calls ({self.counted.recorded_because})"

        prof.meta["steps_begun"] = str(steps)
        prof.meta.update(trap_meta)
        if server:
            prof.meta["server_metrics_url"] = self._server_metrics.url
            prof.meta.update((f"server:{k}", f"{v:g}") for k, v in sorted(server.items()))
        # the processes whose ops were recorded (a worker child, not the API server)
        prof.meta["op_processes"] = ",".join(str(p) for p in sorted({c.pid for c in calls}
                                                                  | {t.pid for t in counted}))
        warning = self.tensor_check.warning(self.n_events)
        if warning:
            self.warnings.append(warning)
        return prof

    def _meta(self, tallies: dict[str, int]) -> dict[str, str]:
        meta = self._shared_meta()
        meta.update({"pack": self.pack.name, "tensor_layout": self.layout.name,
                     "torch": self.torch_version, "native_ops_probed": str(len(self.ops)),
                     "ops_too_deep": str(tallies.get("too_deep", 0)),
                     # what the wrappers saw (the probes, stepped or not: the base's meta)
                     "probes_at_wrappers": str(sum(2 * len(w.wrappers) for w in self.plan.wrappers.values())),
                     "wrapper_hits_unsent": str(tallies.get("unsent", 0)),
                     # places whose calls end at a return probe: where an op there throws,
                     # the unwinder meets the kernel's return address and the target aborts
                     # (wrappers.py)
                     "return_probes": str(self.plan.return_probes),
                     "ops_typed_calls": str(tallies.get("typed", 0)),
                     # ops a typed C++ caller would reach through a wrapper left unprobed
                     # (no emulated place where its arguments are intact): such calls are
                     # not seen (Python's calls are)
                     "ops_typed_unprobed": str(sum(len(w.typed_unprobed) for w in self.plan.wrappers.values()))})
        meta.update(self._build_id_meta(self.elfs))
        meta.update(self._cost_meta(self.bpf_stats))
        if self.step_rules:
            meta["step_ops"] = ",".join(sorted(self.step_rules))
        if self.compiled_kernels:
            meta["mode"] = f"compiled (torch.compile: {self.compiled_kernels} generated kernel libraries)"
            meta["unobserved"] = (
                "vLLM runs this model compiled: norms, activations and rotary embeddings are "
                "generated kernels there, not native ops, and are not seen; the native ops "
                "between the compiled pieces are (attention, KV-cache writes, packed linear "
                "layers). enforce_eager=True runs every op natively.")
        else:
            meta["mode"] = "eager"
        return meta
