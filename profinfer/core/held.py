"""The node's processes that a daemon's discovery holds (stopped at exec or at their loader's
hook until its probes are on), in a BPF map pinned in bpffs (pinned.PIN_DIR/held) that every
daemon on the node shares: tgid -> since when, which process, which daemon holds it
(transport.h's pi_held). BPF enters a process before it stops it; its daemon deletes it
before it continues it. A daemon killed while holding one (SIGKILL, the kernel's OOM kill)
leaves the entry: any other daemon on the node, the one restarted in its place first, sees
its holder gone and continues the process, when it is the same one and still stopped.

Another version's map (another shape) is replaced by the first daemon of this version, which
keeps reading it: pi_held's fields begin every version's entry, so its orphans are continued
too.
"""
from __future__ import annotations

import os
from typing import Callable

from profinfer.core import layout, libbpf, pinned
from profinfer.core.pinned import PIN_DIR

MAP_NAME = "held"               # discover.bpf.c's map, pinned by that name


def _shape() -> tuple[int, int, int, int]:
    consts, dt = layout.parse(header="transport.h")
    return libbpf.BPF_MAP_TYPE_HASH, 4, dt["pi_held"].itemsize, consts["PI_MAX_RECORDED"]


def open_shared(warn: Callable[[str], None], pin_dir: str = PIN_DIR,
                replaced: list[int] | None = None) -> int | None:
    """A descriptor of the node's map, made and pinned if none is; None where it cannot be
    shared (pinned.open_shared). replaced: where a descriptor of another version's map that
    this one replaces is put, when its entries can be read (readable). pin_dir: the tests'
    own."""
    def keep(fd: int) -> None:
        if replaced is not None and readable(fd) is not None:
            replaced.append(os.dup(fd))
    return pinned.open_shared(MAP_NAME, _shape(), warn,
                              "a process held by a daemon that dies stays stopped", pin_dir, keep)


def readable(fd: int) -> int | None:
    """The value size of a map of held processes, this version's or another's, when its
    entries can be read (keyed by tgid, each beginning with pi_held); else None."""
    found = libbpf.map_shape(fd)
    if found is None:
        return None
    kind, key, value, _ = found
    ok = kind == libbpf.BPF_MAP_TYPE_HASH and key == 4 and value >= _shape()[2]
    return value if ok else None
