"""What a collector's attach opens and places: its settings, the objects and descriptors
detach closes, and the uprobes it placed, by file, with whether the kernel emulates each."""
from __future__ import annotations

import os
from dataclasses import dataclass

from profinfer.core.base.errors import ProfinferError
from profinfer.core.ebpf import libbpf, perfevents
from profinfer.core.ebpf.transport import EventTransport
from profinfer.core.target import procfs
from profinfer.core.target.arch import placement
from profinfer.core.target.symbols import load_elf


@dataclass(frozen=True)
class Settings:
    """How a collector was asked to collect: its constructor's keywords (the event buffer
    resolved to the kind used, the shared maps' fds by map name)."""
    lib_paths: list[tuple[str, str]]    # (path to open, path inside the target)
    root: str
    forced_layout: str | None           # a tensor layout named by the user (else found)
    ringbuf_pages: int
    buffer: str                         # the event buffer: "ring" or "perf"
    shared_maps: dict[str, int]         # a session's or daemon's maps used instead of the object's own
    counter_request: list[str]          # the perf counters asked for (--counters)


class Attachment:
    """What attach opens and detach closes (the BPF object, the objects sharing its buffer,
    perf counters, the kernel's run-time statistics, the event transport), and how long
    attaching took."""

    def __init__(self):
        self.obj: libbpf.BpfObject | None = None
        self.companions: list[libbpf.BpfObject] = []   # objects sharing obj's buffer (sched)
        self.multi = False                  # probes attached as uprobe-multi links
        self.counters: perfevents.OpenCounters | None = None
        self.stats_fd = -1                  # BPF run-time statistics on while open
        self.events: EventTransport | None = None
        self.attach_s = 0.0
        self.placed = PlacedProbes()


class PlacedProbes:
    """The uprobes a collector attached, by the file they are on: for each, its offset,
    whether the kernel emulates the instruction there (placement.emulated_at, read from the
    file itself, not from where the collector meant to put it) and the function it is in."""

    def __init__(self):
        self.by_file: dict[str, list[tuple[int, bool, str]]] = {}

    def add(self, path: str, offsets: list[int], names: list[str] | None = None) -> None:
        codes = [b""] * len(offsets)          # unreadable now: counted as the dearer kind
        try:
            with procfs.open_binary(path) as f:
                for i, off in enumerate(offsets):
                    f.seek(off)
                    codes[i] = f.read(16)
        except OSError:
            pass
        probes = self.by_file.setdefault(path, [])
        for i, (off, code) in enumerate(zip(offsets, codes)):
            emulated = placement.emulated_at(code)[0]
            # a stepped probe's function, named now (the file may be gone when it is told)
            probes.append((off, emulated, (names[i] if names else "") or
                           ("" if emulated else _function_at(path, off))))

    def forget(self, path: str) -> None:
        self.by_file.pop(path, None)

    @property
    def total(self) -> int:
        return sum(map(len, self.by_file.values()))

    def stepped(self) -> list[str]:
        """The single-stepped probes, each as its function (or file+offset), sorted."""
        return sorted(name for probes in self.by_file.values() for _, emulated, name in probes
                      if not emulated)


def _function_at(path: str, offset: int) -> str:
    """The symbol whose code holds a file offset (symbols are read once per file), else
    the file's name and the offset."""
    try:
        syms = load_elf(path).symbols.values()
    except ProfinferError:
        syms = ()
    return next((s.name for s in syms if s.file_offset <= offset < s.file_offset + max(s.size, 1)),
                f"{os.path.basename(path)}+{offset:#x}")
