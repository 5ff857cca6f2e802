"""The native-op calls a vLLM collector has parsed: kept as columns, each call's argument
signature (its op and its tensors, as BPF read them: few distinct) decoded once, with the
values a step op's call read and its counter deltas; handed over as OpCalls or as steps."""
from __future__ import annotations

import numpy as np

from profinfer.core.base.errors import ProfinferError
from profinfer.core.profile.model import OpCall, Step, TensorArg
from profinfer.engines.vllm.probes import ops as native, tensors
from profinfer.engines.vllm.decode import steps as stepmaker

CALL_COLUMNS = ("op", "tid", "tgid", "start_ns", "end_ns", "depth", "step")
VALIDATE_CALLS = 16      # calls whose tensors are checked before a table layout is trusted


class CallRecords:
    def __init__(self, ops: list[native.NativeOp], op_library: list[str], consts: dict[str, int],
                 n_counters: int):
        self.ops = ops
        self.op_library = op_library
        self.consts = consts
        self.n_counters = n_counters
        self.n_calls = 0
        self.columns: list[dict[str, np.ndarray]] = []   # per call: CALL_COLUMNS
        self.sig_ids: list[np.ndarray] = []      # per call: its argument signature's index
        self.signatures: list[tuple[TensorArg, ...]] = []
        self._sig_index: dict[tuple[int, bytes], int] = {}
        self.values: dict[int, tuple[int, ...]] = {}   # call number -> values read (step ops)
        self.counter_values: list[np.ndarray] = []   # per call: scaled deltas, NaN when dropped
        self.counter_dropped = {"migrated": 0, "unreadable": 0, "not running": 0}
        self.calls_per_op = np.zeros(len(ops), np.int64)   # calls parsed so far, by op index
        self._taken = 0                  # calls handed over by take_steps
        # (tid, step): (end_ns, calls) of a step as BPF saw its calls end, carried by the
        # next step op's call (a recording whose other calls were counted, not sent)
        self.step_ends: dict[tuple[int, int], tuple[int, int]] = {}

    def add(self, ev: np.ndarray) -> None:
        """Records of one drain (a view: what is kept is copied)."""
        n = len(ev)
        self.columns.append({c: ev[c].copy() for c in CALL_COLUMNS})
        self.calls_per_op += np.bincount(ev["op"], minlength=len(self.ops))
        ops, counts, t = ev["op"], ev["n_tensors"], ev["t"]
        ids = np.empty(n, np.int32)
        index = self._sig_index
        for i in range(n):
            k = int(counts[i])
            key = (int(ops[i]), t[i, :k].tobytes())
            sid = index.get(key)
            if sid is None:
                sid = index[key] = len(self.signatures)
                self.signatures.append(self.decode_args(int(ops[i]), t[i, :k]))
            ids[i] = sid
        self.sig_ids.append(ids)
        if self.n_counters:
            self.counter_values.append(self._scaled_counters(ev))
        for i in np.flatnonzero(ev["prev_step"]):
            self.step_ends[(int(ev["tid"][i]), int(ev["prev_step"][i]))] = (
                int(ev["prev_step_end_ns"][i]), int(ev["prev_step_calls"][i]))
        follow, tensor_size = self.consts["PV_VALUES_FOLLOW"], ev.dtype["t"].base.itemsize
        for i in np.flatnonzero(ev["n_values"]):
            k = int(ev["n_tensors"][i])
            # sent right after the call's tensors where there are few (bpf/vllm.h)
            raw = ev["t"][i].tobytes()[k * tensor_size:] if k <= follow else ev["values"][i].tobytes()
            self.values[self.n_calls + int(i)] = stepmaker.values_of(
                raw, int(ev["n_values"][i]), int(ev["value_bytes"][i]))
        self.n_calls += n

    def _scaled_counters(self, ev: np.ndarray) -> np.ndarray:
        """Per call, each counter's delta scaled for multiplexing (enabled / running); NaN
        where dropped: the thread changed CPU, a read failed, or the counter never ran."""
        ctr = ev["ctr"][:, :self.n_counters]
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

    def decode_args(self, op_index: int, tensors_read: np.ndarray) -> tuple[TensorArg, ...]:
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

    def timed(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every call kept: (start_ns, end_ns, its kind: op and argument signature)."""
        if not self.columns:
            z = np.zeros(0, np.int64)
            return z, z, z
        start = np.concatenate([c["start_ns"] for c in self.columns]).astype(np.int64)
        end = np.concatenate([c["end_ns"] for c in self.columns]).astype(np.int64)
        op = np.concatenate([c["op"] for c in self.columns]).astype(np.int64)
        return start, end, op << 32 | np.concatenate(self.sig_ids).astype(np.int64)

    def calls_by_op(self) -> dict[str, int]:
        """Calls parsed so far, by op name (an op in two libraries: both counted)."""
        out: dict[str, int] = {}
        for op, n in zip(self.ops, self.calls_per_op.tolist()):
            if n:
                out[op.name] = out.get(op.name, 0) + n
        return out

    def take_by_op(self) -> dict[str, tuple[int, int]]:
        """(calls, ns) by op name of the calls kept, which are forgotten (their argument
        signatures too)."""
        cols, self.columns, self.sig_ids, self.values = self.columns, [], [], {}
        self.signatures, self._sig_index = [], {}
        self._taken += sum(len(c["op"]) for c in cols)
        out: dict[str, tuple[int, int]] = {}
        for c in cols:
            ns = (c["end_ns"].astype(np.int64) - c["start_ns"].astype(np.int64))
            for i in np.unique(c["op"]).tolist():
                mine = c["op"] == i
                a, b = out.get(self.ops[i].name, (0, 0))
                out[self.ops[i].name] = (a + int(mine.sum()), b + int(ns[mine].sum()))
        return out

    def take_steps(self, step_rules: dict) -> dict[int, list[Step]]:
        """The steps begun since the last take, by process, each one its step op's call (its
        end is that call's), handed over and forgotten with the calls behind them."""
        cols, self.columns, self.sig_ids = self.columns, [], []
        values, self.values = self.values, {}
        out: dict[int, list[Step]] = {}
        i = self._taken
        begun = set()       # (tgid, tid, step): its first step-op call begins it, at any depth
        for c in cols:
            for k in range(len(c["op"])):
                if c["step"][k] and self.ops[int(c["op"][k])].name in step_rules and (
                        key := (int(c["tgid"][k]), int(c["tid"][k]), int(c["step"][k]))) not in begun:
                    begun.add(key)
                    qsl = values.get(i, ())
                    tgid = int(c["tgid"][k])
                    out.setdefault(tgid, []).append(Step(
                        tgid, int(c["tid"][k]), int(c["start_ns"][k]), int(c["end_ns"][k]),
                        qsl[-1] if qsl else 0, tuple(b - a for a, b in zip(qsl, qsl[1:])), 1))
                i += 1
        self._taken = i
        return out

    def calls(self) -> list[OpCall]:
        """Every call kept, in start order."""
        if not self.columns:
            return []
        cols = {c: np.concatenate([part[c] for part in self.columns]) for c in CALL_COLUMNS}
        sig_ids = np.concatenate(self.sig_ids)
        order = np.argsort(cols["start_ns"], kind="stable")
        op_, tid, tgid, start, end, depth, step = (cols[c].tolist() for c in CALL_COLUMNS)
        names, libraries, sigs, values = ([o.name for o in self.ops], self.op_library,
                                          self.signatures, self.values)
        calls = []
        sig_ids = sig_ids.tolist()
        ctrs = np.concatenate(self.counter_values) if self.counter_values else None
        for i in order.tolist():
            op = op_[i]
            counted = None
            if ctrs is not None and not np.isnan(ctrs[i]).any():
                counted = tuple(float(v) for v in ctrs[i])
            calls.append(OpCall(tgid[i], tid[i], start[i], end[i], names[op], sigs[sig_ids[i]],
                                depth[i], libraries[op], values.get(i, ()), step[i], counted))
        return calls


class TensorLayoutCheck:
    """A table layout of TensorImpl is trusted once the tensors of the first VALIDATE_CALLS
    calls read with it are consistent (tensors.consistent); one that is not is refused."""

    def __init__(self, layout: tensors.TensorLayout, torch_version: str, trusted: bool = False):
        self.layout = layout
        self.torch_version = torch_version
        self.checked = 0
        self.trusted = trusted

    def check(self, ev: np.ndarray, ops: list[native.NativeOp]) -> None:
        for e in ev[: max(0, VALIDATE_CALLS - self.checked)]:
            for t in e["t"][: int(e["n_tensors"])]:
                if not tensors.consistent(int(t["ndim"]), int(t["numel"]), t["sizes"], int(t["dtype"])):
                    raise ProfinferError(
                        f"the TensorImpl layout for torch {self.torch_version or '?'} "
                        f"({self.layout.name}) does not fit this process's tensors "
                        f"({ops[int(e['op'])].name}: ndim {int(t['ndim'])}, numel "
                        f"{int(t['numel'])}, dtype {int(t['dtype'])}): refusing to report shapes")
            self.checked += 1
        self.trusted = self.checked >= VALIDATE_CALLS

    def warning(self, n_events: int) -> str | None:
        if n_events and not self.trusted and self.checked < VALIDATE_CALLS:
            return f"only {self.checked} calls checked the TensorImpl layout"
        return None
