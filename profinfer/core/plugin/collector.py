"""The collector contract: what the session and the daemon drive for every engine and level,
and the machinery every collector shares.

A collector attaches one BPF object's programs to the files a target process maps, collects
the records its programs send, and builds a Profile. `Collector` holds what is the same for
all of them, once:

- the constructor's settings (`settings`: a Settings) and what attach opens and detach
  closes (`attachment`: an Attachment), their fields read through read-only properties of
  the collector (obj, buffer, root, counters, attach_s, ...);
- the attach sequence (`attach`): root check, the object built for the event buffer, the
  followed and open-spans maps of a session or a daemon reused, rodata, the ring's size,
  uprobe-multi links where the kernel has them, load, the kernel's run-time statistics, the
  event transport, and everything detached again when a step fails;
- `fileno`, `poll`, `lost`, `detach`;
- where each uprobe sits and whether the kernel emulates the instruction there or
  single-steps it (`_attach_uprobes` and `_attach_uprobe` count them: `placed`, a
  PlacedProbes, and `_placement_meta`);
- the tallies a BPF object counts (`_read_tallies`), the program statistics and the probe
  hits behind them (`_program_stats`, `program_costs`, `add_hits`), the metadata keys every
  recording has (`_shared_meta`, `_build_id_meta`, `_cost_meta`), the processes' thread names
  and mappings (`info`: a ProcessInfo), perf counters (`_open_counters`), and BPF objects
  loaded beside the collector's own that share its buffer (`_add_companion`: the sched
  level's), closed with it and counted in its probes and program statistics.

A record buffer of one layout is a transport.RecordSlots; finish() reads the lost count once
more before detaching with `_stop_counting_lost()`, after `_drain()`.

A subclass (an engine's collector, a level's) implements what differs, as hooks the attach
sequence calls in this order:

    HEADER                    the layout header its records and config are described in
    MULTI_PROGRAMS            programs attached as uprobe-multi links where the kernel has
                              them (empty: every probe is a single uprobe)
    _prepare()                find what to probe in the target (files, symbols, layouts);
                              raise ProfinferError when there is nothing: no BPF object yet
    _fill_config(cfg)         its part of the object's rodata (`cfg`; the base fills the transport's)
    _follows() -> bool        the programs run for the followed map's processes only (optional)
    _size_maps()              max_entries of its own maps (optional)
    _programs() -> set[str]   the programs to load
    _before_probes()          after load: fill its maps, install counters, a level sharing
                              the buffer (optional)
    _attach_probes()          attach its uprobes, counting them in self.n_probes
    _after_probes()           what is attached after the probes (optional)
    _on_record(data, size)    copy one record out of the event buffer (parse later)
    _parse()                  parse what was copied since the last poll
    attach_files(lib_paths)   probe more copies of its files a followed process maps
    finish() -> Profile       drain, read what BPF kept, detach, build the Profile

and, where they differ, refresh_process_info and other_target_processes (the base: the
target's thread names and mappings; no other process). The constructor's keywords are the
same for all (a subclass adds its own after them). Optional abilities
(take_tokens_by_process, take_steps_by_process, take_op_totals, take_graph_totals, op_name,
cost_counts, forget_process) are defined by the subclasses that have them, never here: the
daemon and the session ask for them by name.
"""
from __future__ import annotations

import os
import platform
import time
from functools import lru_cache
from typing import Iterable

import numpy as np

from profinfer.core.base.errors import ProfinferError
from profinfer.core.calibration import selfcost
from profinfer.core.calibration.hits import Hit
from profinfer.core.ebpf import bpfobj, kernel, layout, libbpf, perfevents
from profinfer.core.ebpf.transport import EventTransport, attach_failed
from profinfer.core.plugin.attach import Attachment, Settings
from profinfer.core.plugin.packs import Pack, engine_libraries
from profinfer.core.target import process
from profinfer.core.target.process import ProcessInfo
from profinfer.core.target.symbols import ElfInfo


class Collector:
    HEADER = ""
    MULTI_PROGRAMS: tuple[str, ...] = ()
    PERF_PAGES_PER_CPU, PERF_WAKEUP_EVENTS = 64, 16     # perf buffers (kernels before 5.12)
    n_decode_tokens = 0          # tokens decoded so far, for a collector that sees them
    elfs: tuple = ()             # the files its probes are on (an engine's sets its own list)
    # `profinfer calibrate --pid` (enginetrap.py): the level whose hits are priced in the
    # engine, and the floor level whose steps time it meanwhile (None: not this engine's)
    PRICED_LEVEL: str | None = None
    FLOOR_LEVEL: str | None = None

    def __init__(self, pid: int, levels: set[str], pack: Pack, lib_paths: list[tuple[str, str]],
                 root: str = "/", tensor_layout: str | None = None, ringbuf_pages: int = 1024,
                 buffer: str = "auto", counters: list[str] | None = None,
                 followed_map_fd: int | None = None, open_spans_fd: int | None = None):
        """With followed_map_fd (a Follower's map, or a daemon's set of watched processes),
        probes go on the library files for every process, and the programs run for the
        processes in the map only; open_spans_fd is the per-thread open spans an engine's
        programs keep and a level under it reads (cuda)."""
        self.pid = pid
        self.levels = set(levels)
        self.pack = pack
        self.settings = Settings(
            lib_paths, root, tensor_layout, ringbuf_pages, kernel.event_buffer_kind(buffer),
            {name: fd for name, fd in (("followed", followed_map_fd), ("open_spans", open_spans_fd))
             if fd is not None},
            list(counters or []))
        self.consts, self.dt = layout.parse(header=self.HEADER)
        self.attachment = Attachment()
        self.warnings: list[str] = []
        self.n_probes = 0
        self.n_events = 0
        self.decoding = False               # the target's work has begun (costs count from here)
        self.info = ProcessInfo()
        # the engine's own account of the recording (a server's metrics), asked for the report
        # beside ours; a daemon, which makes no report, asks nothing of the target
        self.outside_account = True

    # ---- the settings and the attachment, by their names ----

    @property
    def lib_paths(self) -> list[tuple[str, str]]:
        return self.settings.lib_paths

    @property
    def root(self) -> str:
        return self.settings.root

    @property
    def forced_layout(self) -> str | None:
        return self.settings.forced_layout

    @property
    def ringbuf_pages(self) -> int:
        return self.settings.ringbuf_pages

    @property
    def buffer(self) -> str:
        return self.settings.buffer

    @property
    def counter_request(self) -> list[str]:
        return self.settings.counter_request

    @property
    def obj(self) -> libbpf.BpfObject | None:
        return self.attachment.obj

    @property
    def counters(self) -> perfevents.OpenCounters | None:
        return self.attachment.counters

    @property
    def attach_s(self) -> float:
        return self.attachment.attach_s

    # ---- attach ----

    def attach(self) -> None:
        """Attach the probes, or raise ProfinferError with nothing left attached."""
        t0 = time.monotonic()
        kernel.require_root()
        self._prepare()
        att = self.attachment
        try:
            att.obj = obj = libbpf.BpfObject(bpfobj.object_path(self.pack.bpf, self.buffer))
            for name, fd in self.settings.shared_maps.items():
                obj.reuse_map(name, fd)
            obj.set_rodata(self._config().tobytes())
            if self.buffer == "ring":
                obj.set_max_entries("events", self.ringbuf_pages * 4096)
            self._size_maps()
            # one link per file for all its probes where the kernel has uprobe-multi links
            att.multi = bool(self.MULTI_PROGRAMS) and libbpf.uprobe_multi_ok()
            if att.multi:
                for prog in self.MULTI_PROGRAMS:
                    obj.set_uprobe_multi(prog)
            obj.load(self._programs())
            self._before_probes()
            # what our programs cost, counted by the kernel from the first probe on
            att.stats_fd = libbpf.enable_run_time_stats()
            self._attach_probes()
            self._after_probes()
            att.events = EventTransport(obj, self.buffer, self._on_record,
                                        self.PERF_PAGES_PER_CPU, self.PERF_WAKEUP_EVENTS)
        except ProfinferError as e:
            self.detach()
            raise attach_failed(self.pid, e) from None
        att.attach_s = time.monotonic() - t0

    def _prepare(self) -> None:
        raise NotImplementedError

    def _config(self) -> np.ndarray:
        """The object's `cfg`: the transport's part here, the subclass's by _fill_config."""
        cfg = np.zeros(1, self.dt["pi_config"])
        cfg["transport"]["ring_wake_bytes"] = self.wake_bytes
        cfg["transport"]["follow"] = int(self._follows())
        self._fill_config(cfg)
        return cfg

    def _fill_config(self, cfg: np.ndarray) -> None:
        pass

    def _follows(self) -> bool:
        return self.followed_map_fd is not None

    @property
    def wake_bytes(self) -> int:
        """The event buffer's wakeup level: the collector wakes once a quarter of the ring is used."""
        return self.ringbuf_pages * 4096 // 4

    def _mapped_engine_files(self) -> list[ElfInfo]:
        """The pack's files among those the target maps (lib_paths)."""
        return engine_libraries(self.pack, [h for h, _ in self.lib_paths], self.root,
                                [n for _, n in self.lib_paths])

    def _size_maps(self) -> None:
        pass

    def _programs(self) -> set[str]:
        raise NotImplementedError

    def _before_probes(self) -> None:
        pass

    def _attach_probes(self) -> None:
        raise NotImplementedError

    def _after_probes(self) -> None:
        pass

    def attach_files(self, lib_paths: list[tuple[str, str]]) -> list[str]:
        raise NotImplementedError

    @property
    def followed_map_fd(self) -> int | None:
        return self.settings.shared_maps.get("followed")

    @property
    def open_spans_fd(self) -> int | None:
        return self.settings.shared_maps.get("open_spans")

    @property
    def n_cpus(self) -> int:
        """CPU ids run from 0 to this minus one (per-CPU maps are indexed by them)."""
        return _possible_cpus()

    def _probe_pid(self) -> int:
        """The pid a uprobe is attached for: -1 (every process that maps the file; BPF keeps
        the followed ones) with a followed map, else the target."""
        return -1 if self.followed_map_fd is not None else self.pid

    def _attach_uprobes(self, program: str, path: str, offsets: list[int], cookies: list[int],
                        pid: int, retprobe: bool = False, file_id: tuple[int, int] | None = None,
                        links: list | None = None, names: list[str] | None = None) -> list:
        """`program` at `offsets` of one file, each with its cookie: one uprobe-multi link
        where the kernel has them, else a uprobe each. Each link is added to `links` as it is
        made (a failure part way leaves the caller those to detach); returns them. Each probe
        is counted in `placed` (names: the function each offset is in)."""
        links = [] if links is None else links
        if self.attachment.multi:
            links.append(self.obj.attach_uprobe_multi(program, path, offsets, cookies, pid,
                                                      retprobe=retprobe, file_id=file_id))
        else:
            for off, cookie in zip(offsets, cookies):
                links.append(self.obj.attach_uprobe(program, path, off, pid, retprobe=retprobe,
                                                    cookie=cookie, file_id=file_id))
        self.attachment.placed.add(path, offsets, names)
        return links

    def _attach_uprobe(self, program: str, path: str, offset: int, pid: int, retprobe: bool = False,
                       file_id: tuple[int, int] | None = None, name: str = ""):
        """`program` at one offset of one file (a uprobe, or a uprobe-multi link of one);
        returns the link."""
        link = self.obj.attach_uprobe(program, path, offset, pid, retprobe=retprobe, file_id=file_id)
        self.attachment.placed.add(path, [offset], [name])
        return link

    @property
    def probes_stepped(self) -> int:
        """How many of its uprobes the kernel single-steps (PlacedProbes)."""
        return len(self.attachment.placed.stepped())

    def _placement_meta(self, prefix: str = "") -> dict[str, str]:
        """How many uprobes are attached (entry and return), how many of them the kernel
        single-steps, and in which functions (only when some are)."""
        placed = self.attachment.placed
        stepped = placed.stepped()
        meta = {f"{prefix}probes": str(placed.total), f"{prefix}probes_stepped": str(len(stepped))}
        if stepped:
            meta[f"{prefix}probes_stepped_at"] = ",".join(sorted(set(stepped)))
        return meta

    def _open_counters(self) -> None:
        """The perf counters asked for, read per op by the programs (--counters)."""
        counters = perfevents.open_counters(self.counter_request, self.consts["PI_MAX_COUNTERS"])
        self.attachment.counters = counters
        if counters.notice:
            self.warnings.append(counters.notice)

    def _add_companion(self, obj: libbpf.BpfObject) -> None:
        """A BPF object loaded beside ours that shares its buffer (the sched level's): closed
        with it, its links counted in n_probes, its programs in the program statistics."""
        self.attachment.companions.append(obj)
        self.n_probes += obj.n_links

    # ---- collect ----

    def _on_record(self, data, size) -> None:
        raise NotImplementedError

    def _parse(self) -> None:
        raise NotImplementedError

    def fileno(self) -> int:
        """Polls readable when the event buffer has records."""
        return self.attachment.events.fileno()

    def poll(self, timeout_ms: int = 100) -> None:
        """Wait up to timeout_ms, drain the event buffer and parse what came."""
        self.attachment.events.poll(timeout_ms)
        self._parse()

    def _drain(self) -> None:
        """Everything still in the event buffer, parsed (at the end, or a daemon's take)."""
        self.attachment.events.consume()
        self._parse()

    def refresh_process_info(self) -> None:
        """Thread names (and mappings) change while the target runs; keep the latest."""
        self.info.refresh(self.pid)

    @property
    def thread_names(self) -> dict[int, str]:
        return self.info.thread_names

    def other_target_processes(self) -> list[int]:
        """Processes besides self.pid whose CPU time is the target's: none (one process)."""
        return []

    def lost(self) -> int:
        """Records BPF could not submit (or the perf buffers dropped) so far; after detaching,
        as last read (_stop_counting_lost)."""
        events = self.attachment.events
        return events.lost() if events is not None else 0

    def _stop_counting_lost(self) -> int:
        """The lost records, read one last time: lost() gives this count from now on."""
        events = self.attachment.events
        return events.freeze_lost() if events is not None else 0

    # ---- what BPF kept ----

    def _read_tallies(self, slots: Iterable[tuple[str, int]], map_name: str = "tallies",
                      per_cpu: bool = False) -> dict[str, int]:
        """The u64 counts at each (name, key) of an array map (summed over CPUs: per_cpu)."""
        fd, size, out = self.obj.map_fd(map_name), 8 * (self.n_cpus if per_cpu else 1), {}
        for name, key in slots:
            raw = libbpf.map_lookup(fd, key.to_bytes(4, "little"), size)
            out[name] = int(np.frombuffer(raw, np.uint64).sum()) if raw else 0
        return out

    def _program_stats(self) -> dict[str, tuple[int, int]]:
        """The kernel's count of our programs' (and our companions') run time and runs,
        {program: (ns, runs)}; {} where the kernel would not count them."""
        if not self._counting_costs():
            return {}
        stats = dict(self.obj.program_stats())
        for c in self.attachment.companions:
            stats.update(c.program_stats())
        return stats

    def _counting_costs(self) -> bool:
        """Attached, with the kernel counting our programs' run time."""
        return self.attachment.stats_fd >= 0 and self.attachment.obj is not None

    def _shared_meta(self) -> dict[str, str]:
        """The metadata every engine's recording has."""
        return {"engine": self.pack.engine, "levels": ",".join(sorted(self.levels)),
                "event_buffer": self.buffer, "kernel": platform.release(),
                "cpus_online": str(process.cpus_of(self.pid)),
                "attach_s": f"{self.attach_s:.3f}", **self._placement_meta()}

    @staticmethod
    def _build_id_meta(elfs) -> dict[str, str]:
        """build_id:<file> of each probed file (a file reached through map_files: its path)."""
        return {f"build_id:{os.path.basename(e.path) if '/map_files/' not in e.path else e.path}":
                e.build_id for e in elfs}

    @staticmethod
    def _cost_meta(cost: dict[str, int], prefix: str = "cost:") -> dict[str, str]:
        """The programs' cost (program_costs, with the hits) as metadata."""
        return {f"{prefix}{k}": str(v) for k, v in cost.items()}

    def pricing_sites(self) -> list[tuple[str, tuple[int, int] | None, list[int]]]:
        """Where PRICED_LEVEL's probes trap, by file: (path, file id, file offsets), less
        the floor level's own; made with both levels, never attached (enginetrap.py). A
        collector that names a PRICED_LEVEL has it."""
        raise NotImplementedError(f"{type(self).__name__} names a PRICED_LEVEL but lists no sites to price")

    def priced_builds(self) -> list[str]:
        """The build ids of the files pricing_sites() are in."""
        return []

    # ---- detach ----

    def op_name(self, index: int) -> str | None:
        """The name of this engine's op numbered `index` in a thread's open span, by which a
        level's calls made inside it are named; None where the engine does not number ops."""
        return None

    def detach(self) -> None:
        """Close every probe, then free buffers, maps and programs (idempotent).

        Uprobes made through the perf uprobe PMU vanish when their fd closes, so nothing of
        ours survives even a SIGKILL; libbpf's legacy tracefs path is used only without it."""
        att = self.attachment
        if att.obj is not None:
            self._stop_counting_lost()
        companions, att.companions = att.companions, []
        for c in companions:
            c.close()
        if att.obj is not None:
            obj, att.obj = att.obj, None
            obj.close()
        if att.counters:
            att.counters.close()
        if att.stats_fd >= 0:
            os.close(att.stats_fd)
            att.stats_fd = -1


def ops_recorded_because(levels: set[str], counters: list[str] | None, unit: str) -> str:
    """Why an op level asked to count its ops in BPF sends each one (each `unit`: a node, a
    call) instead: what a view asked for needs every one ("" when nothing does)."""
    if counters:
        return f"--counters are read per {unit}"
    if "sched" in levels:
        return f"the sched level's time per op needs every {unit}"
    return ""


@lru_cache(maxsize=1)
def _possible_cpus() -> int:
    return perfevents.possible_cpus()


def add_hits(cost: dict[str, int], n: int, entry_emulated: bool | None = None,
             returns: bool = False, return_trap_emulated: bool | None = None) -> None:
    """Count n probe hits by what each costs (selfcost): the entry probe's trap, emulated or
    single-stepped where it sits (None: no entry probe); the return probe's (returns); and a
    return probe's own entry trap where no entry probe shares its place (return_trap_emulated:
    None where one does)."""
    if entry_emulated is not None:
        cost[(Hit.EMULATED if entry_emulated else Hit.STEPPED).count_key] += n
    if returns:
        cost[Hit.RETURN.count_key] += n
    if return_trap_emulated is not None:
        cost[(Hit.EMULATED if return_trap_emulated else Hit.STEPPED).count_key] += n


def program_costs(stats: dict[str, tuple[int, int]]) -> dict[str, int]:
    """The programs' totals, as the recording's cost:* meta, with hits to be added."""
    return selfcost.program_totals(stats)
