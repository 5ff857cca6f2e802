"""The event transport every engine's BPF object has (common.bpf.h): a ring buffer that user
space drains on a timer (BPF wakes it only when the ring fills), or per-CPU perf buffers on
kernels before 5.12; and the counter of records BPF could not submit."""
from __future__ import annotations

import ctypes

import numpy as np

from profinfer.core.target import process
from profinfer.core.ebpf import layout, libbpf
from profinfer.core.base.errors import ProfinferError

_ZERO_U32 = bytes(4)
_ZERO_U64 = bytes(8)


class EventTransport:
    def __init__(self, obj: libbpf.BpfObject, kind: str, on_record,
                 perf_pages_per_cpu: int, perf_wakeup_events: int):
        self.kind = kind
        self.perf_lost = 0          # perf-buffer records the kernel dropped
        self._final_lost: int | None = None     # as read before the object closed
        if kind == "perf":
            self._buf = obj.perf_buffer("events", perf_pages_per_cpu, perf_wakeup_events,
                                        on_record, self._on_perf_lost)
        else:
            self._buf = obj.ring_buffer("events", on_record)
            self._unread_fd = obj.map_fd("unread_bytes")
        self._lost_fd = obj.map_fd("lost")

    def _on_perf_lost(self, count):
        self.perf_lost += count

    def fileno(self) -> int:
        """Polls readable when the buffer has records (see libbpf.RingBuffer.fileno)."""
        return self._buf.fileno()

    def poll(self, timeout_ms: int) -> None:
        """Wait up to timeout_ms (less when BPF forces a wakeup), then drain: records are
        submitted without wakeups, so the drain must not depend on one."""
        self._buf.poll(timeout_ms)
        if self.kind == "ring":
            libbpf.map_update(self._unread_fd, _ZERO_U32, _ZERO_U64)
        self._buf.consume()

    def consume(self) -> None:
        self._buf.consume()

    def lost(self) -> int:
        """Records BPF could not submit, plus those the perf buffers dropped."""
        if self._final_lost is not None:
            return self._final_lost
        raw = libbpf.map_lookup(self._lost_fd, _ZERO_U32, 8)
        return (int.from_bytes(raw, "little") if raw else 0) + self.perf_lost

    def freeze_lost(self) -> int:
        """Read the lost count one last time (before the object closes); lost() keeps it."""
        if self._final_lost is None:
            self._final_lost = self.lost()
        return self._final_lost


class RecordSlots:
    """Records of one layout that are as long as what they hold, each copied once into a
    slot of the full record size in one reused buffer, which numpy then reads in place (what
    lies past a record's end in its slot is never read, unless zeroed is asked for)."""

    def __init__(self, dtype: np.dtype, zeroed: bool = False):
        self.dtype = dtype
        self.zeroed = zeroed
        self.raw = ctypes.create_string_buffer(64 * dtype.itemsize)
        self.n = 0

    def add(self, data, size: int) -> None:
        stride = self.dtype.itemsize
        if (self.n + 1) * stride > len(self.raw):
            grown = ctypes.create_string_buffer(2 * len(self.raw) + stride)
            ctypes.memmove(grown, self.raw, self.n * stride)
            self.raw = grown
        at = ctypes.addressof(self.raw) + self.n * stride
        if self.zeroed:
            ctypes.memset(at, 0, stride)
        ctypes.memmove(at, data, min(size, stride))
        self.n += 1

    def take(self) -> np.ndarray | None:
        """The records added since the last take (a view of the buffer, valid until the
        next add: copy what is kept)."""
        n, self.n = self.n, 0
        return np.frombuffer(self.raw, self.dtype, count=n) if n else None


def attach_failed(pid: int, error: ProfinferError) -> ProfinferError:
    """The error to raise when attaching failed (after detaching what was attached)."""
    if not process.process_exists(pid):
        return ProfinferError(f"process {pid} exited while probes were being attached")
    return error


def steps_begun(obj: libbpf.BpfObject) -> int:
    """The steps (llama_decode calls, vLLM steps) the engine's programs began on its threads
    since attach, as the shared per-thread state counts them (open_spans: what a level under
    the engine reads); read before detaching."""
    dt = layout.parse(header="transport.h")[1]["pi_open_span"]
    return sum(int(np.frombuffer(value, dt)[0]["step"]) for _, value in obj.map_items("open_spans"))
