"""What BPF counts in place of sending events: graph computes per process and backend
(graph_totals, a daemon's), ops per op type and phase (op_totals: a daemon's, and record's or
attach's without a timeline); read while collecting."""
from __future__ import annotations

import numpy as np

from profinfer.core.ebpf import libbpf
from profinfer.core.profile.stats import PHASES
from profinfer.engines.llamacpp.decode import assemble
from profinfer.engines.llamacpp.probes import barrier
from profinfer.engines.llamacpp.probes.probeplan import graph_backend

GraphTotal = tuple[int, int, int, list[int]]     # calls, ns, nodes, histogram counts


class GraphTotals:
    """The graph_totals map, read by process and backend; a backend named once per process
    and get_name address (name_of(address, tgid))."""

    def __init__(self, dt: dict[str, np.dtype], name_of):
        self.key_dt, self.val_dt = dt["pi_graph_key"], dt["pi_graph_total"]
        self.name_of = name_of
        self._names: dict[tuple[int, int], str] = {}   # (tgid, get_name address)

    def read(self, obj: libbpf.BpfObject, graph_probes: list) -> dict[int, dict[str, GraphTotal]]:
        """What BPF counted so far (cumulative), by process and backend ("sched" for the
        scheduler's graph calls): (calls, ns, nodes, histogram counts, bucket k under
        2^(k+1) x 1024 ns)."""
        out: dict[int, dict[str, GraphTotal]] = {}
        for k, v in obj.map_items("graph_totals"):
            key, val = np.frombuffer(k, self.key_dt)[0], np.frombuffer(v, self.val_dt)[0]
            tgid, probe, fn = int(key["tgid"]), int(key["probe"]), int(key["name_fn"])
            if probe < len(graph_probes) and graph_backend(graph_probes[probe].spec):
                backend = self._names.get((tgid, fn))
                if backend is None:
                    backend = self._names[(tgid, fn)] = self.name_of(fn, tgid)
            else:
                backend = "sched"
            calls, ns, nodes, buckets = out.setdefault(tgid, {}).get(backend, (0, 0, 0, [0] * len(val["buckets"])))
            out[tgid][backend] = (calls + int(val["calls"]), ns + int(val["ns"]), nodes + int(val["nodes"]),
                                  [a + int(b) for a, b in zip(buckets, val["buckets"])])
        return out

    def forget(self, obj: libbpf.BpfObject, tgid: int) -> None:
        """A followed process is gone: its totals and backend names go too."""
        fd, key_size = obj.map_fd("graph_totals"), self.key_dt.itemsize
        for k, _ in list(obj.map_items("graph_totals")):
            if int.from_bytes(k[:4], "little") == tgid:
                libbpf.map_delete(fd, k[:key_size])
        self._names = {k: v for k, v in self._names.items() if k[0] != tgid}


class OpTotals:
    """The op_totals map, per op type (and fused pair) and phase of the decode call under way
    (llamacpp.h: PI_OP_KEY, PI_OP_PHASE): what was added since the last take."""

    def __init__(self, dt: dict[str, np.dtype], consts: dict[str, int], op_names: list[str], n_cpus: int):
        self.total_dt = dt["pi_op_total"]
        self.n_cpus = n_cpus             # the map is per CPU: a value a CPU, summed
        self.op_names = op_names
        self.phases = {consts[f"PI_PHASE_{p.upper()}"]: p for p in PHASES}
        self._seen: dict[int, tuple[int, int]] = {}
        self._open: dict[int, tuple[int, int]] = {}     # ops BPF still held at the end

    def name(self, key: int) -> tuple[str, str]:
        """(op name, phase) of an op_totals key."""
        op = assemble.op_name(self.op_names, key & 0xff, ((key >> 8) & 0xff) - 1)
        return op, self.phases.get((key >> 16) & 0xff, "other")

    def add_open(self, key: int, ns: int) -> None:
        """An op its thread was still computing when collection ended (BPF counts an op when
        its thread's next one starts): counted, with its time so far (ns, 0 when unknown)."""
        calls, total = self._open.get(key, (0, 0))
        self._open[key] = (calls + 1, total + max(ns, 0))

    def take_by_phase(self, obj: libbpf.BpfObject) -> dict[tuple[str, str], tuple[int, int]]:
        """Per (op type, phase), (ops, ns) since the last take."""
        out: dict[tuple[str, str], tuple[int, int]] = {}
        # a per-CPU map's lookup fills one value per possible CPU
        values = libbpf.map_items(obj.map_fd("op_totals"), 4, self.total_dt.itemsize * self.n_cpus)
        for k, raw in values:
            key = int.from_bytes(k[:4], "little")
            per_cpu = np.frombuffer(raw, self.total_dt)
            calls, ns = int(per_cpu["calls"].sum()), int(per_cpu["ns"].sum())
            seen = self._seen.get(key, (0, 0))
            if calls > seen[0]:
                self._seen[key] = (calls, ns)
                self._add(out, key, calls - seen[0], ns - seen[1])
        opened, self._open = self._open, {}
        for key, (calls, ns) in opened.items():
            self._add(out, key, calls, ns)
        return out

    def _add(self, out: dict, key: int, calls: int, ns: int) -> None:
        name = self.name(key)
        a, b = out.get(name, (0, 0))
        out[name] = (a + calls, b + ns)

    def take(self, obj: libbpf.BpfObject) -> dict[str, tuple[int, int]]:
        """Per op type, (ops, ns) since the last take, whatever the phase."""
        out: dict[str, tuple[int, int]] = {}
        for (op, _), (calls, ns) in self.take_by_phase(obj).items():
            a, b = out.get(op, (0, 0))
            out[op] = (a + calls, b + ns)
        return out

    def trap_in_situ_ns(self, obj: libbpf.BpfObject, gap_dt: np.dtype, samples: int) -> int | None:
        """The trap's cost as the fused ops' entry gaps BPF kept show it (barrier.py), if any
        were kept: the latest `samples` fused ops of each CPU."""
        fd = obj.map_fd("gap_samples")
        parts = []
        for i in range(samples):
            raw = libbpf.map_lookup(fd, i.to_bytes(4, "little"), gap_dt.itemsize * self.n_cpus)
            if raw is not None:
                parts.append(np.frombuffer(raw, gap_dt))
        kept = np.concatenate(parts) if parts else np.zeros(0, gap_dt)
        kept = kept[kept["gap_ns"] > 0]
        if not len(kept):
            return None
        return barrier.trap_at_fused_entries(kept["release_ns"].astype(np.int64),
                                              kept["gap_ns"].astype(np.int64))

