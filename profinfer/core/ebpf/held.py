"""The node's processes that a daemon's discovery holds (stopped at exec or at their loader's
hook until its probes are on), in a BPF map pinned in bpffs (pinned.PIN_DIR/held) that every
daemon on the node shares: tgid -> since when, which process, which daemon holds it
(transport.h's pi_held). BPF enters a process before it stops it; its daemon deletes it
before it continues it. A daemon killed while holding one (SIGKILL, the kernel's OOM kill)
leaves the entry: any other daemon on the node, the one restarted in its place first, sees
its holder gone and continues the process, when it is the same one and still stopped.

Another version's map (another shape), where it can be read, is replaced by this version's
(made by its first daemon, or `make_pins`) and stays pinned as held_replaced_ID: the daemons
continue its orphans too, reading each entry by pi_held's fields, which every version from
this one on keeps first. It is unpinned once empty and KEPT_S old: an old daemon still
running then and killed later while it holds a process leaves that process stopped.
"""
from __future__ import annotations

import os
import time
from typing import Callable, Iterator

from profinfer.core.ebpf import layout, libbpf, pinned
from profinfer.core.ebpf.pinned import PIN_DIR

MAP_NAME = "held"               # discover.bpf.c's map, pinned by that name
KEPT_S = 600                    # another version's map is kept this long at least (see above)


def _shape() -> tuple[int, int, int, int]:
    consts, dt = layout.parse(header="transport.h")
    return libbpf.BPF_MAP_TYPE_HASH, 4, dt["pi_held"].itemsize, consts["PI_MAX_RECORDED"]


def open_shared(warn: Callable[[str], None], pin_dir: str = PIN_DIR) -> int | None:
    """A descriptor of the node's map, made and pinned if none is (another version's kept
    pinned: replaced_maps); None where it cannot be shared (pinned.open_shared). pin_dir: the
    tests' own."""
    return pinned.open_shared(MAP_NAME, _shape(), warn,
                              "a process held by a daemon that dies stays stopped", pin_dir,
                              keep=lambda fd: entry_size(fd) is not None)


def replaced_maps(pin_dir: str = PIN_DIR) -> Iterator[tuple[str, int, int]]:
    """Other versions' maps of held processes that this one replaced and kept: (pin,
    descriptor, the size of an entry); each descriptor is closed once the next is asked for.
    One unpinned meanwhile, or not readable, is passed over."""
    for pin in pinned.replaced_pins(MAP_NAME, pin_dir):
        try:
            fd = libbpf.pinned(pin)
        except OSError:
            continue
        try:
            size = entry_size(fd)
            if size is not None:
                yield pin, fd, size
        finally:
            os.close(fd)


def unpin_if_spent(pin: str, fd: int, size: int, kept_s: float = KEPT_S) -> bool:
    """Unpin a kept map (replaced_maps) that is empty and was kept at least `kept_s`, where
    bpffs may be written here (under systemd, make_pins does it); whether it was."""
    try:
        if time.time() - os.lstat(pin).st_ctime < kept_s or next(iter(libbpf.map_items(fd, 4, size)), None):
            return False
        os.unlink(pin)
        return True
    except OSError:             # gone meanwhile, or bpffs read-only here
        return False


def unpin_spent(pin_dir: str = PIN_DIR, kept_s: float = KEPT_S) -> list[str]:
    """Unpin the kept maps that are spent (unpin_if_spent); the pins unpinned."""
    return [pin for pin, fd, size in replaced_maps(pin_dir) if unpin_if_spent(pin, fd, size, kept_s)]


def entry_size(fd: int) -> int | None:
    """The size of an entry of a map of held processes, this version's or another's, where its
    entries can be read (keyed by tgid, each beginning with pi_held); else None."""
    found = libbpf.map_shape(fd)
    if found is None:
        return None
    kind, key, value, _ = found
    return value if kind == libbpf.BPF_MAP_TYPE_HASH and key == 4 and value >= _shape()[2] else None
