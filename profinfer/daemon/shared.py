"""Probes shared per library file: one engine object for every watched process that maps
the same engine files.

A uprobe belongs to a file (its inode), not to a process: attached without a pid, it fires
in every process that maps the file, and the programs run for the processes in the object's
`followed` map only. So N processes of one build cost one BPF object, one set of uprobes and
one ring, and a process found later costs a map update (bench/daemon_footprint.py measures
both ways). The object is keyed by the engine, the files' (device, inode) and its levels: a
container with its own copy of the libraries gets its own, and so do the processes the
governor took the graph level from. Its links close when its last process exits.

Shared: the engines' always-on levels (llama.cpp's token and graph, vLLM's step: a few
probe hits per forward call) and the cuda level (one object for every process with a
runtime, each runtime file probed once). The op level, which traps on every node, stays per
process (a pid-filtered attach puts its breakpoints in that process alone), so the governor
can take it from one process without touching the others.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from profinfer.core.target import process
from profinfer.core.ebpf import libbpf
from profinfer.core.plugin.packs import Pack
from profinfer.daemon.plugins import capabilities, plugin_name

# the token level's events of every process in the group share one ring (its graph level is
# counted in BPF): 256 KiB, room for the decode calls between drains (bench/results.md)
SHARED_RING_PAGES = 64
_FOLLOWED_MAX = 4096      # PI_MAX_FOLLOWED (transport.h)


def open_followed(pack: Pack, pid: int, files: list[tuple[str, str]], levels: set[str],
                  **options) -> tuple[object, int]:
    """The pack's collector attached to its files for the processes in a new `followed` map,
    pid first: (the collector, the map's fd)."""
    fd = libbpf.create_map(libbpf.BPF_MAP_TYPE_HASH, "followed", 4, 4, _FOLLOWED_MAX)
    coll = None
    try:
        libbpf.map_update(fd, pid.to_bytes(4, "little"), (1).to_bytes(4, "little"))
        coll = pack.collector_class()(pid, levels, pack, files, root=f"/proc/{pid}/root",
                                      ringbuf_pages=SHARED_RING_PAGES, followed_map_fd=fd, **options)
        coll.outside_account = False
        coll.attach()
    except BaseException:
        if coll is not None:
            try:
                coll.detach()
            except Exception:
                pass
        os.close(fd)
        raise
    return coll, fd


def group_key(pack: Pack, files: list[tuple[str, str]]) -> tuple:
    """The engine and its files' identities; OSError when a file has gone."""
    return (pack.engine, frozenset(process.file_key(host) for host, _ in files))


class Charges:
    """What shared probes cost, charged to the processes they serve: each process's share of
    the cost since the last charge is its share of the probe hits made since (counted by
    level, and charged by level)."""

    def __init__(self):
        self.by_pid: dict[int, dict[str, float]] = {}      # ns charged so far, by level
        self._mark: tuple[float, dict[int, dict[str, int]]] | None = None

    def charge(self, cost_ns: float, hits: dict[int, dict[str, int]]) -> None:
        """cost_ns: what the probes cost so far, in all; hits: each process's so far, by level."""
        if self._mark is not None and hits:
            spent = cost_ns - self._mark[0]
            before = self._mark[1]
            made = {pid: {lv: n - before.get(pid, {}).get(lv, 0) for lv, n in by.items()}
                    for pid, by in hits.items()}
            total = sum(sum(by.values()) for by in made.values())
            for pid, by in made.items():
                mine = self.by_pid.setdefault(pid, {})
                for lv, n in by.items():
                    share = n / total if total else 1 / (len(made) * len(by))
                    mine[lv] = mine.get(lv, 0.0) + spent * share
        self._mark = (cost_ns, hits)

    def of(self, pid: int) -> dict[str, float]:
        return dict(self.by_pid.get(pid, {}))

    def forget(self, pid: int) -> None:
        self.by_pid.pop(pid, None)


@dataclass
class SharedProbes:
    key: tuple
    collector: object
    followed_fd: int
    pids: set[int] = field(default_factory=set)
    # per process: decode calls and graph computes seen (each one probe hit at entry and
    # one at return): its share of what the shared probes cost
    token_calls: dict[int, int] = field(default_factory=dict)
    graph_calls: dict[int, int] = field(default_factory=dict)
    charges: Charges = field(default_factory=Charges)   # their cost, charged to each process
    # a process moved between objects at a moment (ns): its calls begun before it are the old
    # object's (count_until), those begun since the new one's (count_from)
    count_from: dict[int, int] = field(default_factory=dict)
    count_until: dict[int, int] = field(default_factory=dict)
    programs: dict[str, tuple[int, int]] = field(default_factory=dict)   # last kernel counts
    lost_seen: int = 0
    errors: int = 0
    capabilities: frozenset[str] = frozenset()    # its engine plugin's
    plugin: str = ""                              # that plugin's name

    @classmethod
    def open(cls, key: tuple, pack: Pack, pid: int, files: list[tuple[str, str]],
             levels: set[str]) -> "SharedProbes":
        """Attach the levels' probes to the files, for pid to begin with."""
        caps = capabilities(pack)
        extra = {"graph_totals": True} if "graph_totals" in caps else {}
        coll, fd = open_followed(pack, pid, files, levels, **extra)
        group = cls(key, coll, fd, {pid}, capabilities=caps, plugin=plugin_name(pack))
        group._note_maps(pid)
        return group

    def _note_maps(self, pid: int) -> None:
        note = getattr(self.collector, "note_process_maps", None)    # graph backends' names
        if note is not None:
            note(pid)

    def add(self, pid: int) -> None:
        libbpf.map_update(self.followed_fd, pid.to_bytes(4, "little"), (1).to_bytes(4, "little"))
        self.pids.add(pid)
        self._note_maps(pid)

    def remove(self, pid: int) -> None:
        """The process is gone (drained first): its entries go; the object stays for the rest."""
        libbpf.map_delete(self.followed_fd, pid.to_bytes(4, "little"))
        self.pids.discard(pid)
        for d in (self.token_calls, self.graph_calls, self.count_from, self.count_until):
            d.pop(pid, None)
        self.charges.forget(pid)
        forget = getattr(self.collector, "forget_process", None)
        if forget is not None:
            forget(pid)

    def charge(self, cost_ns: float) -> None:
        """Share out what the probes cost since the last charge (cost_ns: so far, in all)
        among the processes by the probe hits each made since: a decode call (or step) and a
        graph compute each are an entry and a return hit. Each process's charge is kept by
        level (the token or step level: the floor; the graph level)."""
        floor = "step" if "steps_by_process" in self.capabilities else "token"
        graph = "graph" in self.key[-1]         # the levels it was opened at (attach.py's _join_group)
        self.charges.charge(cost_ns, {pid: {floor: self.token_calls.get(pid, 0),
                                            **({"graph": self.graph_calls.get(pid, 0)} if graph else {})}
                                      for pid in self.pids})

    def close(self) -> None:
        try:
            self.collector.detach()
        finally:
            os.close(self.followed_fd)


@dataclass
class SharedRuntime:
    """The cuda level for every watched process that maps a CUDA runtime (or links one): one
    object, counted in BPF per process (no per-call event but allocations and registrations),
    each runtime file probed once, on the file, the processes in its `followed` map. A file's
    links close when the last process using it exits; the object with the last process."""
    collector: object
    followed_fd: int
    pids: set[int] = field(default_factory=set)
    programs: dict[str, tuple[int, int]] = field(default_factory=dict)
    lost_seen: int = 0
    errors: int = 0
    # per process: its calls BPF counted (cumulative) and sent (each sent call once), so far
    counted: dict[int, int] = field(default_factory=dict)
    sent: dict[int, int] = field(default_factory=dict)
    charges: Charges = field(default_factory=Charges)

    @classmethod
    def open(cls, pack: Pack, pid: int, files: list[tuple[str, str]]) -> "SharedRuntime":
        coll, fd = open_followed(pack, pid, files, {"cuda"}, timeline=False)
        return cls(coll, fd, {pid})

    def add(self, pid: int, files: list[tuple[str, str]]) -> None:
        """A process (or a runtime it loaded later: its detail flag kept): its files probed
        where not yet."""
        if pid not in self.pids:
            libbpf.map_update(self.followed_fd, pid.to_bytes(4, "little"), (1).to_bytes(4, "little"))
        try:
            self.collector.attach_files(files, pid, root=f"/proc/{pid}/root")
        except BaseException:
            if pid not in self.pids:
                libbpf.map_delete(self.followed_fd, pid.to_bytes(4, "little"))
            raise
        self.pids.add(pid)

    def remove(self, pid: int) -> None:
        libbpf.map_delete(self.followed_fd, pid.to_bytes(4, "little"))
        self.pids.discard(pid)
        for d in (self.counted, self.sent):
            d.pop(pid, None)
        self.charges.forget(pid)
        self.collector.forget_process(pid)

    def detail(self, pid: int, on: bool) -> None:
        """The process's per-call detail (each launch by kernel, grid, stream and engine op)
        on, or off: its launches counted by function alone (cuda.h PC_FOLLOW_COUNTS_ONLY)."""
        libbpf.map_update(self.followed_fd, pid.to_bytes(4, "little"), (1 if on else 3).to_bytes(4, "little"))

    def count_calls(self, pid: int, counted: int | None, sent: int) -> None:
        """A drain's calls of the process: BPF's cumulative count (None: not read this time)
        and the calls sent since the last drain."""
        if counted is not None:
            self.counted[pid] = counted
        self.sent[pid] = self.sent.get(pid, 0) + sent

    def charge(self, cost_ns: float) -> None:
        """Share out what the cuda level cost since the last charge by each process's calls
        (each a probe hit at entry; some at return too)."""
        self.charges.charge(cost_ns, {pid: {"cuda": self.counted.get(pid, 0) + self.sent.get(pid, 0)}
                                      for pid in self.pids})

    def files(self) -> list[str]:
        return sorted(os.path.basename(f.path) for f in self.collector.files)

    def close(self) -> None:
        try:
            self.collector.detach()
        finally:
            os.close(self.followed_fd)
