"""What vLLM's probes count in place of sending each call (no timeline asked; bpf/vllm.h):
calls by op, argument signature, thread, phase and nesting (call_totals; those that found it
full in call_totals_unkept, without their signature), each signature's tensors as its first
call had them (call_sigs), and each op's calls, time and durations (op_hists, a core.loghist
histogram). Read while collecting (a daemon's take, per op) and at the end."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from profinfer.core.ebpf import libbpf
from profinfer.core.profile import loghist
from profinfer.core.base.errors import ProfinferError
from profinfer.core.profile.model import CallTotal, TensorArg
from profinfer.core.profile.stats import PHASES


class CallTotals:
    """`decode_args(op index, tensors read)`: a signature's TensorArgs (calls.CallRecords')."""

    def __init__(self, dt: dict[str, np.dtype], consts: dict[str, int], op_names: list[str],
                 decode_args: Callable[[int, np.ndarray], tuple[TensorArg, ...]]):
        if (consts["PV_HIST_SUB"], consts["PV_HIST_MAX_LOG2"]) != (loghist.SUB, loghist.MAX_LOG2):
            raise ProfinferError("bpf/vllm.h's histogram is not core.loghist's")
        self.key_dt, self.total_dt = dt["pv_total_key"], dt["pv_call_total"]
        self.sig_key_dt, self.tensor_dt = dt["pv_sig_key"], dt["pv_tensor"]
        self.hist_dt = dt["pv_op_hist"]
        self.max_tensors = consts["PV_MAX_TENSORS"]
        self.phases = {consts[f"PV_PHASE_{p.upper()}"]: p for p in PHASES}
        self.op_names = op_names
        self.decode_args = decode_args
        self._signatures: dict[tuple[int, int], tuple[TensorArg, ...]] = {}
        self._taken = np.zeros((len(op_names), 2), np.int64)     # per op: (calls, ns) taken

    def _items(self, obj: libbpf.BpfObject) -> list[tuple[np.void, int, int]]:
        """(key, calls, ns) of every call_totals and call_totals_unkept entry, cumulative."""
        out = []
        for name in ("call_totals", "call_totals_unkept"):
            fd = obj.map_fd(name)
            for k, v in libbpf.map_items(fd, self.key_dt.itemsize, self.total_dt.itemsize):
                key, val = np.frombuffer(k, self.key_dt)[0], np.frombuffer(v, self.total_dt)[0]
                out.append((key, int(val["calls"]), int(val["ns"])))
        return out

    def _read_signatures(self, obj: libbpf.BpfObject) -> None:
        """The signatures BPF kept that are not decoded yet."""
        fd, size = obj.map_fd("call_sigs"), self.tensor_dt.itemsize * self.max_tensors
        for k, v in libbpf.map_items(fd, self.sig_key_dt.itemsize, size):
            key = np.frombuffer(k, self.sig_key_dt)[0]
            op, sig = int(key["op"]), int(key["sig"])
            if (op, sig) not in self._signatures and op < len(self.op_names):
                n = min(int(key["n_tensors"]), self.max_tensors)
                self._signatures[(op, sig)] = self.decode_args(op, np.frombuffer(v, self.tensor_dt)[:n])

    def totals(self, obj: libbpf.BpfObject) -> list[CallTotal]:
        """Everything counted so far (a signature BPF did not keep: args None)."""
        items = [(key, calls, ns) for key, calls, ns in self._items(obj)
                 if int(key["op"]) < len(self.op_names) and calls]
        if any(int(k["sig"]) and (int(k["op"]), int(k["sig"])) not in self._signatures for k, _, _ in items):
            self._read_signatures(obj)
        return [CallTotal(int(key["tgid"]), int(key["tid"]), self.op_names[int(key["op"])],
                          self._signatures.get((int(key["op"]), int(key["sig"]))),
                          self.phases.get(int(key["phase"]), "other"), bool(key["nested"]), calls, ns)
                for key, calls, ns in items]

    def calls_by_process(self, obj: libbpf.BpfObject) -> dict[int, int]:
        """Calls counted so far, by process."""
        out: dict[int, int] = {}
        for key, calls, _ in self._items(obj):
            out[int(key["tgid"])] = out.get(int(key["tgid"]), 0) + calls
        return out

    def hists(self, obj: libbpf.BpfObject) -> dict[int, tuple[int, int, np.ndarray]]:
        """Each op's counted calls, their ns and their durations (loghist counts), by op
        index; ops never counted left out."""
        fd, out = obj.map_fd("op_hists"), {}
        for i in range(len(self.op_names)):
            raw = libbpf.map_lookup(fd, i.to_bytes(4, "little"), self.hist_dt.itemsize)
            if raw is not None:
                h = np.frombuffer(raw, self.hist_dt)[0]
                if h["calls"]:
                    out[i] = (int(h["calls"]), int(h["ns"]), h["buckets"].astype(np.int64))
        return out

    def calls_by_op(self, obj: libbpf.BpfObject) -> np.ndarray:
        """Calls counted so far, by op index."""
        out = np.zeros(len(self.op_names), np.int64)
        for i, (calls, _, _) in self.hists(obj).items():
            out[i] = calls
        return out

    def take(self, obj: libbpf.BpfObject) -> dict[str, tuple[int, int]]:
        """Per op name, (calls, ns) counted since the last take (an array's read per op,
        whatever the shapes)."""
        out: dict[str, tuple[int, int]] = {}
        for i, (calls, ns, _) in self.hists(obj).items():
            new, new_ns = calls - self._taken[i, 0], ns - self._taken[i, 1]
            if new > 0:
                self._taken[i] = (calls, ns)
                a, b = out.get(self.op_names[i], (0, 0))
                out[self.op_names[i]] = (a + int(new), b + int(new_ns))
        return out


@dataclass
class CountedCalls:
    """A collector's op level counted in BPF: whether it is (on), why not where it was asked
    (recorded_because), the counts' reader, the ops whose calls are sampled for now (the
    trap's measure) and when the counts are next looked at for it."""
    on: bool
    recorded_because: str = ""
    reader: CallTotals | None = None
    sending: set[int] = field(default_factory=set)
    look_at: float = 0.0
