"""The cuda level's collector: probe the CUDA runtime and driver functions a process's
files define (its pack.toml), collect their calls (or, without a timeline, the counts
BPF kept), name their kernels, and make them the profile's cuda_calls.

It runs beside an engine's collector (sharing the per-thread open spans the engine's
programs keep, so each call carries the engine's step and op), or alone for a program that
is no known engine. It is a collector like the engines' (core/plugin/collector.py).
"""
from __future__ import annotations

import os
import platform
from collections import deque
from typing import Callable

import numpy as np

from profinfer.core.target import process
from profinfer.core.ebpf import libbpf
from profinfer.core.target.arch import placement
from profinfer.core.calibration.hits import Hit
from profinfer.core.plugin.collector import Collector, add_hits, program_costs
from profinfer.core.base.errors import ProfinferError
from profinfer.core.profile.model import Profile
from profinfer.levels.cuda.records import CudaCall
from profinfer.core.plugin.packs import Pack
from profinfer.core.ebpf.transport import RecordSlots
from profinfer.levels.cuda import runtime
from profinfer.levels.cuda.names import KernelNames

ENTRY_ONLY, ENTRY, RETURN = "cuda_enter_only", "cuda_enter", "cuda_return"
COPY_KINDS = {0: "H2H", 1: "H2D", 2: "D2H", 3: "D2D", 4: "Default"}
MEMORY_KINDS = {1: "device", 2: "host"}
TALLIES = ("nested", "agg_full", "unpaired", "pending_full")
DETAIL_OFF = "(per-call detail off)"     # the kernel of launches counted by function alone
# Registrations whose name BPF could not read (its page not in yet) are read from the
# process's memory at most this many per drain (each read opens /proc/PID/mem on the loop);
# the rest wait for the next drains (KernelNames.MAX_UNREAD a process)
MAX_NAME_READS = 64


class ProbeSites:
    """Where the probes are: the target's runtime files found at attach, each file probed by
    (device, inode) with its links and probe count, the runtime files each process uses, and
    each function's entry probe's place."""

    def __init__(self):
        self.found: list[runtime.RuntimeFile] = []
        self.probed: dict[tuple[int, int], tuple[runtime.RuntimeFile, list, int]] = {}
        self.process_files: dict[int, set[tuple[int, int]]] = {}
        self.placements: dict[str, placement.Placement] = {}   # function: its entry probe's place


class CudaCollector(Collector):
    HEADER = runtime.HEADER
    MULTI_PROGRAMS = (ENTRY_ONLY, ENTRY, RETURN)

    def __init__(self, pid: int, levels: set[str], pack: Pack, lib_paths: list[tuple[str, str]],
                 root: str = "/", tensor_layout: str | None = None, ringbuf_pages: int = 512,
                 buffer: str = "auto", counters: list[str] | None = None,
                 followed_map_fd: int | None = None, open_spans_fd: int | None = None,
                 timeline: bool = True):
        super().__init__(pid, levels, pack, lib_paths, root, tensor_layout, ringbuf_pages, buffer,
                         counters, followed_map_fd, open_spans_fd)
        self.timeline = timeline
        self.apis: list[runtime.Api] = []
        self.sites = ProbeSites()
        self.names: dict[int, KernelNames] = {}       # per process
        self.name_op: Callable[[int, int], str | None] | None = None   # (engine, op index) -> name
        # records end where what they hold ends (registrations alone carry a name): zeroed
        # past their end in their slot, as every field is read
        self._slots = RecordSlots(self.dt["pc_call"], zeroed=True)
        self._records: list[np.ndarray] = []
        self._kernel_names: dict[tuple[int, int, bool], str] = {}   # named once per kernel
        self._memory = KnownMemory()        # allocations seen: which way Default copies went
        self._call_sites: dict[tuple[int, int], str] = {}   # (tgid, address): its caller's name
        # while collecting (take): each function's calls BPF counted (cumulative, per
        # process) and sent so far: what the probes' hits were (cost_counts)
        self._taken: dict[str, dict] = {"counted": {}, "sent": {}}

    # ---- attach ----

    def _prepare(self) -> None:
        self.apis = runtime.apis(self.pack)
        self.sites.found, warnings = runtime.runtime_files(self.pack, self.lib_paths, self.root)
        self.warnings.extend(warnings)
        if not self.sites.found:
            raise ProfinferError(f"no CUDA runtime in process {self.pid} (none of "
                                 f"{', '.join(self.pack.libraries)} is mapped, and no executable "
                                 f"defines {self.pack.marker})")

    def _programs(self) -> set[str]:
        return {ENTRY_ONLY, ENTRY, RETURN}

    def _before_probes(self) -> None:
        specs = self.obj.map_fd("api_specs")
        for api in self.apis:
            libbpf.map_update(specs, api.index.to_bytes(4, "little"), self._spec(api).tobytes())

    def _attach_probes(self) -> None:
        self._attach_files(self.pid, self.sites.found)

    def _after_probes(self) -> None:
        if not self.n_probes:
            raise ProfinferError(f"{', '.join(f.path for f in self.sites.found)}: none of the CUDA "
                                 "functions the cuda pack lists is defined there")

    def _fill_config(self, cfg: np.ndarray) -> None:
        cfg["timeline"] = int(self.timeline)

    def _spec(self, api: runtime.Api) -> np.ndarray:
        spec = np.zeros(1, self.dt["pc_api_spec"])
        no = self.consts["PC_NO_SLOT"]
        spec["cls"] = runtime.class_number(api.cls)
        spec["stream_slot"] = no if api.stream_slot is None else api.stream_slot
        spec["handle_slot"] = no if api.handle_slot is None else api.handle_slot
        spec["memory"] = {"device": 1, "host": 2}.get(api.memory, 0)
        return spec

    def _attach_files(self, tgid: int, files: list[runtime.RuntimeFile]) -> None:
        pid, sites = self._probe_pid(), self.sites
        for rf in files:
            key = process.file_key(rf.host_path)
            sites.process_files.setdefault(tgid, set()).add(key)
            if key in sites.probed:
                continue
            links: list = []
            groups: dict[str, tuple[list[int], list[int], list[str]]] = {
                ENTRY_ONLY: ([], [], []), ENTRY: ([], [], []), RETURN: ([], [], [])}
            for api in self.apis:
                sym = rf.elf.find(api.name)
                if sym is None:
                    continue
                # the probe where no argument register nor the stack pointer has moved yet
                # (placement.choose): an emulated instruction where there is one. A function
                # probed at return too has its return probe there, with the entry probe: one
                # trap, and [rsp] is still the return address the kernel replaces
                entry = placement.choose(rf.elf.code_bytes(sym, 64), (1, 2, 3, 4, 5, 6))
                sites.placements[api.name] = entry
                for prog in ((ENTRY, RETURN) if api.returns else (ENTRY_ONLY,)):
                    for items, value in zip(groups[prog], (sym.file_offset + entry.offset, api.index, api.name)):
                        items.append(value)
            try:
                for prog, (offsets, cookies, names) in groups.items():
                    if offsets:
                        self._attach_uprobes(prog, rf.host_path, offsets, cookies, pid,
                                             retprobe=prog == RETURN, file_id=rf.elf.file_id,
                                             links=links, names=names)
            except BaseException:
                self.obj.detach_links(links)      # the file is probed whole or not at all
                raise
            n = sum(len(offsets) for offsets, _, _ in groups.values())
            self.n_probes += n
            sites.probed[key] = (rf, links, n)
        self._watch_process(tgid, files)

    def _watch_process(self, tgid: int, files: list[runtime.RuntimeFile]) -> None:
        """Name what the process already registered, and mark its runtime's code."""
        names = self.names.setdefault(tgid, KernelNames(tgid))
        names.refresh()
        exe = ""
        try:
            exe = os.readlink(f"/proc/{tgid}/exe").removesuffix(" (deleted)")
        except OSError:
            pass
        names.read_handle_statics(sorted({exe, *(f.path for f in files if f.static),
                                          *names.cuda_modules()} - {""}))
        ranges = runtime.runtime_ranges(tgid, self.files)
        if len(ranges) > self.consts["PC_RUNTIME_RANGES"]:
            self.warnings.append(f"PID {tgid} maps {len(ranges)} CUDA runtime code ranges; the nested-call "
                                 f"check holds {self.consts['PC_RUNTIME_RANGES']}: a driver launch made by "
                                 "a runtime beyond them is counted besides its runtime call")
            ranges = ranges[: self.consts["PC_RUNTIME_RANGES"]]
        value = np.zeros(1, self.dt["pc_runtime_ranges"])
        for i, (lo, hi) in enumerate(ranges):
            value["start"][0, i], value["end"][0, i] = lo, hi
        libbpf.map_update(self.obj.map_fd("runtime_ranges"), tgid.to_bytes(4, "little"), value.tobytes())

    @property
    def files(self) -> list[runtime.RuntimeFile]:
        """The runtime files probed, in the order they were."""
        return [rf for rf, _, _ in self.sites.probed.values()]

    def attach_files(self, lib_paths: list[tuple[str, str]], tgid: int | None = None,
                     root: str | None = None) -> list[str]:
        """More files a followed process maps (a runtime it dlopened, or another process's
        runtime: root is then its /proc/PID/root): probed before it runs on."""
        files, warnings = runtime.runtime_files(self.pack, lib_paths, root or self.root)
        self._attach_files(tgid or self.pid, files)
        return warnings

    def forget_process(self, tgid: int) -> None:
        """A followed process is gone (drained first): its counts, names and runtime ranges
        go, and the probes on runtime files that no followed process uses any more."""
        sites = self.sites
        sites.process_files.pop(tgid, None)
        self.names.pop(tgid, None)
        self._kernel_names = {k: v for k, v in self._kernel_names.items() if k[0] != tgid}
        self._call_sites = {k: v for k, v in self._call_sites.items() if k[0] != tgid}
        self._memory.blocks = {k: v for k, v in self._memory.blocks.items() if k[0] != tgid}
        if self.obj is None:
            return
        key_dt = self.dt["pc_agg_key"]
        fd = self.obj.map_fd("agg")
        for k, _ in list(self.obj.map_items("agg")):
            if int(np.frombuffer(k[:key_dt.itemsize], key_dt)[0]["tgid"]) == tgid:
                libbpf.map_delete(fd, k[:key_dt.itemsize])
        libbpf.map_delete(self.obj.map_fd("runtime_ranges"), tgid.to_bytes(4, "little"))
        used = set().union(*sites.process_files.values()) if sites.process_files else set()
        for key in [k for k in sites.probed if k not in used]:
            rf, links, n = sites.probed.pop(key)
            self.obj.detach_links(links)
            self.n_probes -= n
            self.attachment.placed.forget(rf.host_path)

    # ---- collect ----

    def _on_record(self, data, size):
        self._slots.add(data, size)

    def _parse(self) -> None:
        ev = self._slots.take()
        if ev is None:
            self._read_unread_names()       # names still to be read, in a quiet drain too
            return
        n = len(ev)
        ev = ev.copy()
        self._learn_names(ev)
        self._records.append(ev)
        self.n_events += n
        self.decoding = True

    def _learn_names(self, ev: np.ndarray) -> None:
        """Registrations seen: handles, driver functions, host stubs' device names."""
        cls_of = {a.index: a.cls for a in self.apis}
        registrations = [a.index for a in self.apis if a.what == "registration"]
        for e in ev[np.isin(ev["api"], registrations)]:
            cls = cls_of[int(e["api"])]
            names = self.names.setdefault(int(e["tgid"]), KernelNames(int(e["tgid"])))
            if cls == "get_kernel" and int(e["ret"]) == 0 and int(e["ptr"]):
                names.put(names.handles, int(e["ptr"]), int(e["ptr2"]))
            elif cls == "module_function" and int(e["ret"]) == 0:
                name = _text(e["name"])
                if name:
                    names.put(names.functions, int(e["ptr"]), name)
            elif cls == "register_function":
                name = _text(e["name"])
                if name:
                    names.put(names.registered, int(e["ptr2"]), name)
                else:                   # its page not in yet when BPF read it: from memory, later
                    names.unread_later(int(e["ptr"]), int(e["ptr2"]))
        self._read_unread_names()

    def _read_unread_names(self) -> None:
        """Names BPF could not read, from the processes' memory: at most MAX_NAME_READS a
        drain, the processes in turn (one that registers a flood waits its turn, the others'
        names are read)."""
        waiting = deque(n for n in self.names.values() if n.unread)
        for _ in range(MAX_NAME_READS):
            if not waiting:
                return
            names = waiting.popleft()
            names.read_one_unread()
            if names.unread:
                waiting.append(names)

    def refresh_process_info(self) -> None:
        for tgid, names in self.names.items():
            names.refresh()
            self.info.refresh(tgid, mappings=False)

    def other_target_processes(self) -> list[int]:
        return sorted(set(self.names) - {self.pid})

    # ---- finish ----

    def finish(self) -> Profile:
        self._drain()
        self.refresh_process_info()
        lost = self._stop_counting_lost()
        stats = self._program_stats()
        groups = [] if self.timeline else self._groups()
        tallies = self._tallies()
        self.detach()
        calls = self._calls() + groups
        calls.sort(key=lambda c: (c.start_ns, c.pid))
        prof = Profile(pid=self.pid, process_name=process.process_name(self.pid) or "",
                       thread_names=dict(self.thread_names), cuda_calls=calls, lost_events=lost)
        prof.meta.update(self._meta(tallies, stats, calls))
        return prof

    def take(self) -> tuple[list[CudaCall], list[CudaCall]]:
        """While collecting (a daemon): the calls BPF counted so far, as cumulative groups
        (without a timeline), and the calls sent since the last take (allocations, frees,
        graph and registration calls, Default copies; every call with a timeline), which are
        then forgotten."""
        self._drain()
        calls = self._calls()
        self._records = []
        groups = [] if self.timeline else self._groups()
        if groups:
            counted: dict[tuple[int, str], int] = {}
            for c in groups:
                counted[(c.pid, c.api)] = counted.get((c.pid, c.api), 0) + c.count
            self._taken["counted"].update(counted)     # a process gone keeps its last count
        sent = self._taken["sent"]
        for c in calls:
            sent[c.api] = sent.get(c.api, 0) + 1
        return groups, calls

    def cost_counts(self) -> dict[str, int]:
        """What the probes cost so far, while collecting (a daemon's governor): the kernel's
        counts of the programs, and the calls take() saw as hits by where each function's
        probe sits (bpf_ns, hits_emulated, hits_stepped, hits_return)."""
        stats = self._program_stats()
        if not stats:
            return {}
        by_api = dict(self._taken["sent"])
        for (_, api), n in self._taken["counted"].items():
            by_api[api] = by_api.get(api, 0) + n
        return self._hit_costs(stats, by_api, self._tallies().get("nested", 0))

    def _hit_costs(self, stats: dict, by_api: dict[str, int], nested: int) -> dict[str, int]:
        cost = program_costs(stats)
        returns = {a.name for a in self.apis if a.returns}
        for name, n in by_api.items():
            add_hits(cost, n, self.sites.placements[name].emulated, returns=name in returns)
        # driver launches the runtime made: trapped, then skipped in BPF (emulated or not,
        # as the driver's probes are placed: counted as single-stepped, the dearer)
        cost[Hit.STEPPED.count_key] += nested
        return cost

    def _groups(self) -> list[np.ndarray]:
        key_dt, val_dt = self.dt["pc_agg_key"], self.dt["pc_agg_value"]
        out = []
        for k, v in self.obj.map_items("agg"):
            out.append((np.frombuffer(k, key_dt)[0], np.frombuffer(v, val_dt)[0]))
        return [self._group_call(k, v) for k, v in out]

    def _tallies(self) -> dict[str, int]:
        return self._read_tallies((name, i) for i, name in enumerate(TALLIES))

    def _kernel(self, tgid: int, api: runtime.Api, handle: int) -> str:
        if api.what != "launch":
            return ""
        if not handle:          # counted by function alone (a daemon took the detail away)
            return DETAIL_OFF
        key = (tgid, handle, api.driver)
        name = self._kernel_names.get(key)
        if name is None:
            names = self.names.get(tgid) or self.names.setdefault(tgid, KernelNames(tgid))
            name = names.kernel(handle, api.driver)
            if not (names.unread and name.startswith(("kernel@", "CUfunction@"))):
                self._kernel_names[key] = name      # unnamed while names wait: asked again later
        return name

    def _site(self, tgid: int, addr: int) -> str:
        key = (tgid, addr)
        site = self._call_sites.get(key)
        if site is None:
            site = self._call_sites[key] = self.names.setdefault(tgid, KernelNames(tgid)).site(addr)
        return site

    def _op(self, engine: int, op: int, flags: int) -> str:
        if not flags & self.consts["PC_OP_OPEN"]:
            return ""
        return (self.name_op(engine, op) if self.name_op else None) or f"op#{op}"

    def _copy_kind(self, api: runtime.Api, kind: int) -> str:
        if api.what == "copy":
            return COPY_KINDS.get(kind, str(kind))
        if api.what == "memory":
            return MEMORY_KINDS.get(kind, "")
        return ""

    def _calls(self) -> list[CudaCall]:
        if not self._records:
            return []
        ev = np.concatenate(self._records)
        ev = ev[np.argsort(ev["start_ns"], kind="stable")]
        captured, step_open = self.consts["PC_CAPTURED"], self.consts["PC_STEP_OPEN"]
        memory = self._memory
        out = []
        for e in ev:
            api = self.apis[int(e["api"])]
            if api.what == "memory" and int(e["ret"]) == 0:
                memory.note(api, int(e["tgid"]), int(e["ptr"]), int(e["bytes"]), int(e["copy_kind"]))
            tgid, flags = int(e["tgid"]), int(e["flags"])
            start, end = int(e["start_ns"]), int(e["end_ns"])
            caller = self._site(tgid, int(e["caller"])) if api.what == "memory" else ""
            out.append(CudaCall(
                tgid, int(e["tid"]), api.name, api.what, start, end, 1, end - start if end else 0,
                self._kernel(tgid, api, int(e["handle"])), tuple(int(x) for x in e["grid"]),
                tuple(int(x) for x in e["block"]), int(e["shmem"]), int(e["stream"]), int(e["bytes"]),
                memory.resolve(int(e["tgid"]), int(e["ptr"]), int(e["ptr2"]), self._copy_kind(api, int(e["copy_kind"]))),
                int(e["ptr"]),
                int(e["handle"]) if api.what != "launch" else 0, int(e["ret"]), caller,
                bool(flags & captured), int(e["step"]) if flags & step_open else 0,
                self._op(int(e["engine"]), int(e["op"]), flags)))
        return out

    def _group_call(self, k, v) -> CudaCall:
        api = self.apis[int(k["api"])]
        tgid, flags = int(k["tgid"]), int(k["flags"])
        return CudaCall(
            tgid, 0, api.name, api.what, 0, 0, int(v["calls"]), int(v["total_ns"]),
            self._kernel(tgid, api, int(k["handle"])), tuple(int(x) for x in k["grid"]),
            tuple(int(x) for x in k["block"]), int(k["shmem"]), int(k["stream"]), int(v["bytes"]),
            self._copy_kind(api, int(k["copy_kind"])), 0,
            int(k["handle"]) if api.what != "launch" else 0, int(k["ret"]), "",
            bool(flags & self.consts["PC_CAPTURED"]), 0,
            self._op(int(k["engine"]), int(k["op"]), flags), max_ns=int(v["max_ns"]))

    def _meta(self, tallies: dict[str, int], stats: dict, calls: list[CudaCall]) -> dict[str, str]:
        meta = {"cuda_timeline": str(int(self.timeline)), "cuda_event_buffer": self.buffer,
                "kernel": platform.release(), "cuda_attach_s": f"{self.attach_s:.3f}",
                **self._placement_meta("cuda_")}
        for rf in self.files:
            meta[f"cuda_runtime:{os.path.basename(rf.path)}"] = (
                ("static in " if rf.static else "") + rf.path + (f" ({rf.elf.build_id})" if rf.elf.build_id else ""))
        meta.update((f"cuda_{k}", str(v)) for k, v in tallies.items())
        if stats:
            by_api: dict[str, int] = {}
            for c in calls:
                by_api[c.api] = by_api.get(c.api, 0) + c.count
            meta.update(self._cost_meta(self._hit_costs(stats, by_api, tallies.get("nested", 0)), "cuda_cost:"))
        return meta


class KnownMemory:
    """The allocations seen so far (device, pinned host), to tell which way a copy of kind
    Default went: resolved only when both its pointers lie in allocations seen (memory made
    another way, cuMem* or before attach, is not known)."""

    def __init__(self):
        self.blocks: dict[tuple[int, int], tuple[int, str]] = {}   # (tgid, base) -> (size, "D"/"H")

    def note(self, api: runtime.Api, tgid: int, ptr: int, size: int, kind: int) -> None:
        if not ptr:
            return
        if api.cls == "malloc":
            self.blocks[(tgid, ptr)] = (size, "D" if kind == 1 else "H")
        else:
            self.blocks.pop((tgid, ptr), None)

    def _side(self, tgid: int, addr: int) -> str | None:
        for (t, base), (size, side) in self.blocks.items():
            if t == tgid and base <= addr < base + size:
                return side
        return None

    def resolve(self, tgid: int, dst: int, src: int, kind: str) -> str:
        if kind != "Default":
            return kind
        s, d = self._side(tgid, src), self._side(tgid, dst)
        return f"Default:{s}2{d}" if s and d else kind


def _text(b) -> str:
    return bytes(b).split(b"\0", 1)[0].decode("utf-8", "replace")
