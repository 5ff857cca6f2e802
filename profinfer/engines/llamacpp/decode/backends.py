"""The ggml backend a graph compute ran on, named from the address of the backend's get_name
function that BPF read (its symbol in the library mapped there, or the library's name)."""
from __future__ import annotations

import os
import re

import numpy as np

from profinfer.core.target import process
from profinfer.core.base.errors import ProfinferError
from profinfer.core.profile.model import GraphCall
from profinfer.core.target.procfs import FileMapping
from profinfer.core.target.symbols import load_elf
from profinfer.engines.llamacpp.probes.probeplan import graph_backend


def backend_name(fn_addr: int, mappings: list[FileMapping], pid: int, root: str) -> str:
    """Name of the backend whose get_name function is at fn_addr in process pid, as its
    mappings (read while it lived) show it; root: where its files are opened from."""
    for m in mappings:
        if not m.start <= fn_addr < m.end:
            continue
        file_off = fn_addr - m.start + m.offset
        try:
            elf = load_elf(process.host_path(pid, m.path, m.inode, m.span, m.deleted, m.dev), root)
            for s in elf.symbols.values():
                if s.file_offset <= file_off < s.file_offset + max(s.size, 1):
                    found = re.match(r"ggml_backend_(\w+?)_(?:get_)?name$", s.name)
                    if found:
                        return found.group(1).upper()
        except ProfinferError:
            pass
        found = re.match(r"libggml-(\w+)", os.path.basename(m.path))
        return found.group(1).upper() if found else os.path.basename(m.path)
    return "unknown"


def graph_calls(graphs: list[np.ndarray], graph_probes: list, name_of) -> list[GraphCall]:
    """pi_graph_event records as GraphCalls in start order: a graph probe's number (the
    index in graph_probes) tells its function; a backend's compute names the backend
    (name_of(get_name address)), the scheduler's is "sched"."""
    if not graphs:
        return []
    backend_cache: dict[int, str] = {}
    out = []
    for r in np.sort(np.concatenate(graphs), order="start_ns"):
        probe = graph_probes[int(r["probe"])]
        if graph_backend(probe.spec):
            fn = int(r["name_fn"])
            if fn not in backend_cache:
                backend_cache[fn] = name_of(fn)
            backend = backend_cache[fn]
        else:
            backend = "sched"
        out.append(GraphCall(int(r["tid"]), int(r["start_ns"]), int(r["end_ns"]), backend,
                             int(r["n_nodes"]), probe.symbol.name))
    return out
