"""vLLM's decoder: probe every native op of the `_C` libraries a process maps, collect each
call with its tensor arguments' shapes, and make the engine's steps from them.

The interface is the one the session drives for every engine (profinfer/session.py):
attach, poll, fileno, refresh_process_info, attach_files, lost, finish, detach.
"""
from __future__ import annotations

import ctypes
import os
import platform
import time

import numpy as np
import psutil

from profinfer.core import bpfobj, discovery, kernel, layout, libbpf, selfcost
from profinfer.levels.sched import probe as schedprobe
from profinfer.core import perfevents as perfcounters
from profinfer.core.arch import placement
from profinfer.core.errors import ProfinferError
from profinfer.core.model import OpCall, Profile, Step, TensorArg
from profinfer.core.packs import Pack, copies_of_probed, engine_libraries
from profinfer.core.transport import EventTransport, RecordSlots, attach_failed, steps_begun
from profinfer.engines.vllm import ops as native, steps as stepmaker, tensors
from profinfer.engines.vllm.server_metrics import MetricsWindow

HEADER = "vllm.h"
ENTRY_PROGRAM, RETURN_PROGRAM = "vop_enter", "vop_return"
CALL_COLUMNS = ("op", "tid", "tgid", "start_ns", "end_ns", "depth", "step")
PERF_PAGES_PER_CPU, PERF_WAKEUP_EVENTS = 64, 16   # perf buffers (kernels before 5.12)
VALIDATE_CALLS = 16      # calls whose tensors are checked before a table layout is trusted
_U32_P = ctypes.POINTER(ctypes.c_uint32)


class VllmCollector:
    def __init__(self, pid: int, levels: set[str], pack: Pack, lib_paths: list[tuple[str, str]],
                 root: str = "/", tensor_layout: str | None = None, ringbuf_pages: int = 1024,
                 buffer: str = "auto", counters: list[str] | None = None,
                 followed_map_fd: int | None = None, open_spans_fd: int | None = None):
        self.pid = pid
        self.levels = set(levels)
        self.pack = pack
        self.lib_paths = lib_paths
        self.root = root
        self.forced_layout = tensor_layout
        self.ringbuf_pages = ringbuf_pages
        self.buffer = kernel.event_buffer_kind(buffer)
        self.followed_map_fd = followed_map_fd
        self.open_spans_fd = open_spans_fd    # shared with a level under the engine (cuda)
        self.consts, self.dt = layout.parse(header=HEADER)
        self.ev_dt = self.dt["pv_op_event"]
        self.obj: libbpf.BpfObject | None = None
        self.ops: list[native.NativeOp] = []
        self.op_library: list[str] = []
        self.elfs = []
        self.warnings: list[str] = []
        self.attach_s = 0.0
        self.n_probes = 0
        self.n_events = 0
        self.n_decode_tokens = 0
        self.decoding = False
        self.thread_names: dict[int, str] = {}
        self.probed_files: set[tuple[int, int]] = set()
        self._slots = RecordSlots(self.ev_dt)      # records, until parsed
        self._columns: list[dict[str, np.ndarray]] = []   # per call: CALL_COLUMNS
        self._sig_ids: list[np.ndarray] = []      # per call: its argument signature's index
        self._signatures: list[tuple[TensorArg, ...]] = []
        self._sig_index: dict[tuple[int, bytes], int] = {}
        self._values: dict[int, tuple[int, ...]] = {}   # call number -> values read (step ops)
        self._layout_checked = 0
        self._layout_trusted = False
        self._stats_fd = -1
        self.bpf_stats: dict[str, int] = {}
        self._lost_at_end = 0
        self.compiled_kernels = 0
        self.sched_obj: libbpf.BpfObject | None = None
        self._sched_raw: list[bytes] = []
        self._sched_dt = schedprobe.record_dtype()
        self._kind_op = self.consts["PV_EV_OP"]
        self.counter_request = list(counters or [])
        self.counters: perfcounters.OpenCounters | None = None
        self.counter_names: list[str] = []
        self.n_cpus = perfcounters.possible_cpus()
        self._counter_values: list[np.ndarray] = []   # per call: scaled deltas, NaN when dropped
        self.counter_dropped = {"migrated": 0, "unreadable": 0, "not running": 0}
        self._server_metrics: MetricsWindow | None = None
        self.processes: set[int] = set()    # attach: the tree's processes followed
        self.placements: dict[str, tuple] = {}   # op: (entry probe's place, the first emulated one)
        self._tree_fd = -1
        self._calls_per_op = np.zeros(0, np.int64)   # calls parsed so far, by op index (attach)
        self._taken = 0                  # calls handed over by take_steps_by_process

    # ---- attach ----

    def attach(self) -> None:
        t0 = time.monotonic()
        kernel.require_root()
        hosts, names = [h for h, _ in self.lib_paths], [n for _, n in self.lib_paths]
        self.elfs = engine_libraries(self.pack, hosts, self.root, names)
        if not self.elfs:
            raise ProfinferError(f"no {self.pack.engine} in process {self.pid} (none of "
                                 f"{', '.join(self.pack.libraries)} is mapped)")
        for elf in self.elfs:
            placement.require_supported(elf.path)
            declared = self.pack.raw.get("op")
            found, skipped = native.declared_ops(elf, declared) if declared else native.native_ops(elf)
            self.ops.extend(found)
            self.op_library.extend([os.path.basename(elf.path)] * len(found))
            if skipped:
                self.warnings.append(f"{os.path.basename(elf.path)}: not probed: {', '.join(skipped)}")
        if not self.ops:
            raise ProfinferError(f"{', '.join(e.path for e in self.elfs)}: no op schema matches a "
                                 "C++ function: not a torch custom-op library profinfer can read")
        if "op" not in self.levels:
            # the step level alone (a daemon's): only the op that begins each step is probed
            step_ops = set(stepmaker.rules(self.pack, self.ops))
            if not step_ops:
                raise ProfinferError(f"{', '.join(e.path for e in self.elfs)}: none of the pack's "
                                     "step ops is probed: no step level without the op level")
            keep = [i for i, op in enumerate(self.ops) if op.name in step_ops]
            self.ops = [self.ops[i] for i in keep]
            self.op_library = [self.op_library[i] for i in keep]
        if len(self.ops) > self.consts["PV_MAX_OPS"]:
            raise ProfinferError(f"{len(self.ops)} native ops; profinfer probes at most "
                                 f"{self.consts['PV_MAX_OPS']}")
        mapped = [m.path for m in discovery.mapped_files(self.pid)]
        version = tensors.torch_version(mapped, self.root)
        if version is None and not any(op.kinds for op in self.ops):
            version = tensors.ANY_RELEASE      # no tensor is read: any layout does
        self.layout = tensors.layout_for(version, self.forced_layout)
        self.torch_version = version or ""
        self.step_rules = stepmaker.rules(self.pack, self.ops)
        self._calls_per_op = np.zeros(len(self.ops), np.int64)
        # the argument whose values a cost model needs (attention: each sequence's length)
        self.cost_values = {}
        for name, rule in self.pack.cost_rules().items():
            op = next((o for o in self.ops if o.name == name), None)
            arg = rule.get("attention", {}).get("seq_lens")
            names = [a.name for a in op.schema.args] if op else []
            if arg in names and op.kinds[names.index(arg)] != native.SKIP:
                self.cost_values[name] = names.index(arg)
        if "sched" in self.levels:
            schedprobe.require_btf()
        if self.counter_request:
            self.counters = perfcounters.open_counters(self.counter_request, self.consts["PI_MAX_COUNTERS"])
            if self.counters.notice:
                self.warnings.append(self.counters.notice)
            self.counter_names = [c.name for c in self.counters.counters]
        self.obj = libbpf.BpfObject(bpfobj.object_path(self.pack.bpf, self.buffer))
        try:
            if self.followed_map_fd is not None:
                self.obj.reuse_map("followed", self.followed_map_fd)
            if self.open_spans_fd is not None:
                self.obj.reuse_map("open_spans", self.open_spans_fd)
            self.obj.set_rodata(self._config().tobytes())
            if self.buffer == "ring":
                self.obj.set_max_entries("events", self.ringbuf_pages * 4096)
            self.obj.set_max_entries("threads", 256)
            self.obj.set_max_entries("counters", self.consts["PI_MAX_COUNTERS"] * self.n_cpus)
            # one link per library for all its ops where the kernel has uprobe-multi links
            self.multi = libbpf.uprobe_multi_ok()
            if self.multi:
                for prog in (ENTRY_PROGRAM, RETURN_PROGRAM):
                    self.obj.set_uprobe_multi(prog)
            self.obj.load({ENTRY_PROGRAM, RETURN_PROGRAM})
            if "sched" in self.levels:       # the whole tree's threads, as the op programs
                self.sched_obj = schedprobe.attach(self.obj, self.buffer, self.ringbuf_pages * 4096 // 4,
                                                   self.pid, follow=True)
                self.n_probes += self.sched_obj.n_links
            if self.followed_map_fd is None:
                # attach: the process and its descendants (vLLM runs the model in a child of
                # the API server, one per rank), kept in the object's own `followed` map
                self._tree_fd = self.obj.map_fd("followed")
                self._follow_tree()
            if self.counters:
                self.counters.install(self.obj.map_fd("counters"), self.n_cpus)
            specs = self.obj.map_fd("op_specs")
            for i, op in enumerate(self.ops):
                libbpf.map_update(specs, i.to_bytes(4, "little"), self._spec(op).tobytes())
            self._stats_fd = libbpf.enable_run_time_stats()
            self._attach_ops(self.elfs, {})
            self._events = EventTransport(self.obj, self.buffer, self._on_record,
                                          PERF_PAGES_PER_CPU, PERF_WAKEUP_EVENTS)
        except ProfinferError as e:
            self.detach()
            raise attach_failed(self.pid, e) from None
        self.attach_s = time.monotonic() - t0
        # the server's own account of the same stretch, where it serves /metrics
        self._server_metrics = MetricsWindow(sorted(self.processes or {self.pid}))

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

    def _config(self) -> np.ndarray:
        cfg = np.zeros(1, self.dt["pi_config"])
        cfg["transport"]["ring_wake_bytes"] = self.ringbuf_pages * 4096 // 4
        cfg["transport"]["follow"] = 1      # a process tree: record's follower's, or attach's own
        lay = self.layout
        cfg["ti_off_storage"], cfg["st_off_data"] = lay.storage, lay.storage_data
        cfg["ti_off_sizes"], cfg["ti_off_storage_offset"] = lay.sizes, lay.storage_offset
        cfg["ti_off_numel"], cfg["ti_off_dtype"] = lay.numel, lay.dtype
        cfg["n_counters"] = len(self.counters.counters) if self.counters else 0
        cfg["n_cpus"] = self.n_cpus
        return cfg

    def _spec(self, op: native.NativeOp) -> np.ndarray:
        spec = np.zeros(1, self.dt["pv_op_spec"])
        spec["n_args"] = len(op.kinds)
        spec["kind"][0, :len(op.kinds)] = op.kinds
        spec["slot"][0, :len(op.slots)] = op.slots
        rule = self.step_rules.get(op.name)
        spec["values_of"] = rule.values_arg if rule else self.cost_values.get(op.name, 0xff)
        spec["starts_step"] = int(rule is not None)
        return spec

    def _attach_ops(self, elfs, paths: dict[str, str]) -> None:
        pid = -1                            # on the files; BPF runs for the followed tgids only
        for elf in elfs:
            path = paths.get(elf.path, elf.path)
            entries, returns, cookies = [], [], []
            for i, op in enumerate(self.ops):
                sym = elf.find(op.symbol) if self.op_library[i] == os.path.basename(elf.path) else None
                if sym is None:
                    continue
                # the entry probe reads every argument register and the stack: placed where
                # none has moved (placement.choose), else on the first instruction
                code = elf.code_bytes(sym, 64)
                place = placement.choose(code, (1, 2, 3, 4, 5, 6))
                self.placements[op.name] = (place, placement.choose(code))
                entries.append(sym.file_offset + place.offset)
                returns.append(sym.file_offset)
                cookies.append(i)
            if not cookies:
                continue
            file_id = elf.file_id if path == elf.path else None     # a copy: as it was read
            if self.multi:
                self.obj.attach_uprobe_multi(ENTRY_PROGRAM, path, entries, cookies, pid, file_id=file_id)
                self.obj.attach_uprobe_multi(RETURN_PROGRAM, path, returns, cookies, pid, retprobe=True,
                                             file_id=file_id)
            else:
                for entry, ret, i in zip(entries, returns, cookies):
                    self.obj.attach_uprobe(ENTRY_PROGRAM, path, entry, pid, cookie=i, file_id=file_id)
                    self.obj.attach_uprobe(RETURN_PROGRAM, path, ret, pid, retprobe=True, cookie=i,
                                           file_id=file_id)
            self.n_probes += 2 * len(cookies)
            self.probed_files.add(discovery.file_key(path))

    def attach_files(self, lib_paths: list[tuple[str, str]]) -> list[str]:
        """More copies of the probed libraries (a followed process mapping other files);
        another build's are not probed (returned, with why)."""
        copies, skipped = copies_of_probed(self.pack, lib_paths, self.elfs, self.probed_files, self.root)
        for elf, host in copies:
            self._attach_ops([elf], {elf.path: host})
        return skipped

    # ---- collect ----

    def _on_record(self, data, size):
        if ctypes.cast(data, _U32_P)[0] != self._kind_op:         # the sched level's
            self._sched_raw.append(ctypes.string_at(data, self._sched_dt.itemsize))
            return
        # what lies past a record's end in its slot is never read: n_tensors and n_values
        # bound it
        self._slots.add(data, size)

    def fileno(self) -> int:
        return self._events.fileno()

    def poll(self, timeout_ms: int = 100) -> None:
        self._events.poll(timeout_ms)
        self._parse()

    def _parse(self) -> None:
        ev = self._slots.take()
        if ev is None:
            return
        n = len(ev)
        if not self._layout_trusted:
            self._check_layout(ev)
        # per call: its columns and the id of its argument signature (op and tensors, as
        # BPF read them: few distinct, so each is decoded once)
        self._columns.append({c: ev[c].copy() for c in CALL_COLUMNS})
        self._calls_per_op += np.bincount(ev["op"], minlength=len(self.ops))
        ops, counts, t = ev["op"], ev["n_tensors"], ev["t"]
        ids = np.empty(n, np.int32)
        index = self._sig_index
        for i in range(n):
            k = int(counts[i])
            key = (int(ops[i]), t[i, :k].tobytes())
            sid = index.get(key)
            if sid is None:
                sid = index[key] = len(self._signatures)
                self._signatures.append(self._decode_args(int(ops[i]), t[i, :k]))
            ids[i] = sid
        self._sig_ids.append(ids)
        if self.counters:
            self._counter_values.append(self._scaled_counters(ev))
        for i in np.flatnonzero(ev["n_values"]):
            self._values[self.n_events + int(i)] = stepmaker.values_of(
                ev["values"][i], int(ev["n_values"][i]), int(ev["value_bytes"][i]))
        self.n_events += n
        self.decoding = True

    def _scaled_counters(self, ev: np.ndarray) -> np.ndarray:
        """Per call, each counter's delta scaled for multiplexing (enabled / running); NaN
        where dropped: the thread changed CPU, a read failed, or the counter never ran."""
        k = len(self.counters.counters)
        ctr = ev["ctr"][:, :k]
        running, enabled = ctr["running"].astype(float), ctr["enabled"].astype(float)
        with np.errstate(divide="ignore", invalid="ignore"):
            values = ctr["counter"] * (enabled / running)
        migrated = (ev["flags"] & self.consts["PV_CTR_MIGRATED"]) != 0
        failed = (ev["flags"] & self.consts["PV_CTR_FAILED"]) != 0
        idle = (running == 0).any(axis=1) & ~migrated & ~failed
        values[migrated | failed | idle] = np.nan
        self.counter_dropped["migrated"] += int(migrated.sum())
        self.counter_dropped["unreadable"] += int((failed & ~migrated).sum())
        self.counter_dropped["not running"] += int(idle.sum())
        return values

    def _decode_args(self, op_index: int, tensors_read: np.ndarray) -> tuple[TensorArg, ...]:
        schema_args = self.ops[op_index].schema.args
        args = []
        for t in tensors_read:
            name, ndim = schema_args[int(t["arg"])].name, int(t["ndim"])
            if ndim == 0xff:
                args.append(TensorArg(name, "", None))
            else:
                dtype = tensors.DTYPES.get(int(t["dtype"]), str(int(t["dtype"])))
                args.append(TensorArg(name, dtype, tuple(int(x) for x in t["sizes"][:ndim])))
        return tuple(args)

    def _check_layout(self, ev: np.ndarray) -> None:
        for e in ev[: max(0, VALIDATE_CALLS - self._layout_checked)]:
            for t in e["t"][: int(e["n_tensors"])]:
                if not tensors.consistent(int(t["ndim"]), int(t["numel"]), t["sizes"], int(t["dtype"])):
                    raise ProfinferError(
                        f"the TensorImpl layout for torch {self.torch_version or '?'} "
                        f"({self.layout.name}) does not fit this process's tensors "
                        f"({self.ops[int(e['op'])].name}: ndim {int(t['ndim'])}, numel "
                        f"{int(t['numel'])}, dtype {int(t['dtype'])}): refusing to report shapes")
            self._layout_checked += 1
        self._layout_trusted = self._layout_checked >= VALIDATE_CALLS

    def refresh_process_info(self) -> None:
        if self._tree_fd >= 0 and self.obj is not None:
            self._follow_tree()
        paths: set[str] = set()
        for pid in self.processes or {self.pid}:
            names = discovery.thread_names(pid)
            if names:
                self.thread_names.update(names)
            try:
                with open(f"/proc/{pid}/maps") as f:
                    paths.update(line.split(None, 5)[5].strip() for line in f
                                 if line.count(" ") >= 5 and "/" in line)
            except (OSError, IndexError):
                continue
        # torch.compile's inductor loads the kernels it generates as shared libraries
        self.compiled_kernels = max(self.compiled_kernels,
                                    sum(1 for p in paths if "inductor" in p and p.endswith(".so")))

    def other_target_processes(self) -> list[int]:
        """The rest of the profiled tree (the worker that runs the model, the engine core):
        the probes' cost is a share of all their CPU time."""
        return sorted(self.processes - {self.pid})

    def lost(self) -> int:
        return self._events.lost() if self.obj else self._lost_at_end

    def take_steps_by_process(self) -> dict[int, list[Step]]:
        """While collecting (a daemon, at the step level): the steps begun since the last
        take, by process, each one its step op's call (its end is that call's), handed over
        and forgotten with the calls behind them."""
        cols, self._columns, self._sig_ids = self._columns, [], []
        values, self._values = self._values, {}
        out: dict[int, list[Step]] = {}
        i = self._taken
        for c in cols:
            for k in range(len(c["op"])):
                if c["step"][k] and c["depth"][k] == 0 and self.ops[int(c["op"][k])].name in self.step_rules:
                    qsl = values.get(i, ())
                    tgid = int(c["tgid"][k])
                    out.setdefault(tgid, []).append(Step(
                        tgid, int(c["tid"][k]), int(c["start_ns"][k]), int(c["end_ns"][k]),
                        qsl[-1] if qsl else 0, tuple(b - a for a, b in zip(qsl, qsl[1:])), 1))
                i += 1
        self._taken = i
        return out

    def cost_counts(self) -> dict[str, int]:
        """What the probes cost so far (see _cost), while collecting (a daemon's governor)."""
        if self._stats_fd < 0 or self.obj is None:
            return {}
        return self._cost(self.obj.program_stats(), self._calls_by_op())

    def _calls_by_op(self) -> dict[str, int]:
        """Calls parsed so far, by op name (an op in two libraries: both counted)."""
        out: dict[str, int] = {}
        for op, n in zip(self.ops, self._calls_per_op.tolist()):
            if n:
                out[op.name] = out.get(op.name, 0) + n
        return out

    def op_name(self, index: int) -> str:
        """The op a thread's open span names (a level under the engine reads it)."""
        return self.ops[index].name if 0 <= index < len(self.ops) else f"op#{index}"

    # ---- finish ----

    def finish(self) -> Profile:
        server = self._server_metrics.delta() if self._server_metrics else {}
        self._events.consume()
        self._parse()
        lost = self._lost_at_end = self.lost()
        stats = self.obj.program_stats() if self._stats_fd >= 0 else {}
        if self.sched_obj is not None and stats:
            stats.update(self.sched_obj.program_stats())
        tallies = self._tallies()
        steps = steps_begun(self.obj)
        self.detach()
        calls = self._calls()
        self.bpf_stats = self._cost(stats, self._calls_by_op())
        prof = Profile(pid=self.pid, process_name=discovery.process_name(self.pid) or "",
                       thread_names=dict(self.thread_names), calls=calls, lost_events=lost)
        if self._sched_raw:
            evs = np.sort(np.frombuffer(b"".join(self._sched_raw), self._sched_dt), order="ts_ns")
            prof.switches, prof.wakeups = schedprobe.events(evs, self.processes or {self.pid})
        if self.counter_names:
            prof.counter_names = list(self.counter_names)
            prof.counter_dropped = dict(self.counter_dropped)
        prof.steps = stepmaker.steps(calls, self.step_rules)
        prof.meta.update(self._meta(tallies))
        prof.meta["steps_begun"] = str(steps)
        if server:
            prof.meta["server_metrics_url"] = self._server_metrics.url
            prof.meta.update((f"server:{k}", f"{v:g}") for k, v in sorted(server.items()))
        # the processes whose ops were recorded (a worker child, not the API server)
        prof.meta["op_processes"] = ",".join(str(p) for p in sorted({c.pid for c in calls}))
        if self.n_events and not self._layout_trusted and self._layout_checked < VALIDATE_CALLS:
            self.warnings.append(f"only {self._layout_checked} calls checked the TensorImpl layout")
        return prof

    def _cost(self, stats: dict[str, tuple[int, int]], per_op: dict[str, int]) -> dict[str, int]:
        """The kernel's count of our programs' runs and run time, and the probe hits behind
        the calls by what each costs (selfcost): the entry's trap, emulated or single-stepped
        where the probe sits; the return's; and the return probe's own trap at the function's
        first instruction when the entry probe sits further in."""
        if not stats:
            return {}
        out = selfcost.program_totals(stats)
        for name, n in per_op.items():
            entry, first = self.placements[name]
            out["hits_emulated" if entry.emulated else "hits_stepped"] += n
            out["hits_return"] += n
            if entry.offset:
                out["hits_emulated" if first.emulated and first.offset == 0 else "hits_stepped"] += n
        return out

    def _tallies(self) -> dict[str, int]:
        out = {}
        for i, name in enumerate(("too_deep", "other_processes")):
            raw = libbpf.map_lookup(self.obj.map_fd("tallies"), i.to_bytes(4, "little"), 8)
            out[name] = int.from_bytes(raw, "little") if raw else 0
        return out

    def _calls(self) -> list[OpCall]:
        if not self._columns:
            return []
        cols = {c: np.concatenate([part[c] for part in self._columns]) for c in CALL_COLUMNS}
        sig_ids = np.concatenate(self._sig_ids)
        order = np.argsort(cols["start_ns"], kind="stable")
        op_, tid, tgid, start, end, depth, step = (cols[c].tolist() for c in CALL_COLUMNS)
        names, libraries, sigs, values = ([o.name for o in self.ops], self.op_library,
                                          self._signatures, self._values)
        calls = []
        sig_ids = sig_ids.tolist()
        ctrs = np.concatenate(self._counter_values) if self._counter_values else None
        for i in order.tolist():
            op = op_[i]
            counted = None
            if ctrs is not None and not np.isnan(ctrs[i]).any():
                counted = tuple(float(v) for v in ctrs[i])
            calls.append(OpCall(tgid[i], tid[i], start[i], end[i], names[op], sigs[sig_ids[i]],
                                depth[i], libraries[op], values.get(i, ()), step[i], counted))
        return calls

    def _meta(self, tallies: dict[str, int]) -> dict[str, str]:
        meta = {"engine": self.pack.engine, "pack": self.pack.name, "levels": ",".join(sorted(self.levels)),
                "event_buffer": self.buffer, "kernel": platform.release(),
                "tensor_layout": self.layout.name, "torch": self.torch_version,
                "attach_s": f"{self.attach_s:.3f}", "native_ops_probed": str(len(self.ops)),
                "cpus_online": str(discovery.cpus_of(self.pid)),
                "ops_too_deep": str(tallies.get("too_deep", 0))}
        for e in self.elfs:
            meta[f"build_id:{os.path.basename(e.path)}"] = e.build_id
        meta.update((f"cost:{k}", str(v)) for k, v in self.bpf_stats.items())
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

    def detach(self) -> None:
        if self.sched_obj is not None:
            sched_obj, self.sched_obj = self.sched_obj, None
            sched_obj.close()
        if self.obj is not None:
            obj, self.obj = self.obj, None
            obj.close()
        if self.counters:
            self.counters.close()
            self.counters = None
        if self._stats_fd >= 0:
            os.close(self._stats_fd)
            self._stats_fd = -1
