"""The cuda level's record: one CUDA runtime or driver call, or a group of counted ones."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class CudaCall:
    """One CUDA runtime or driver call (the cuda level); without a timeline, a group of
    identical ones that BPF counted (count > 1, total_ns their host time, no start)."""
    pid: int
    tid: int                   # 0 in a group (BPF counts per process)
    api: str                   # the function called (cudaLaunchKernel, cuLaunchKernel, ...)
    what: str                  # launch, graph, copy, set, memory, sync, registration
    start_ns: int = 0
    end_ns: int = 0            # 0: probed at entry only (launches)
    count: int = 1
    total_ns: int = 0          # host time in the call(s), where probed at return
    kernel: str = ""           # launches: the kernel's name (demangled)
    grid: tuple[int, int, int] = (0, 0, 0)
    block: tuple[int, int, int] = (0, 0, 0)
    shmem: int = 0
    stream: int = 0
    bytes: int = 0             # copied, set, or asked to allocate
    copy_kind: str = ""        # H2H, H2D, D2H, D2D, Default (unresolved), or device/host memory
    ptr: int = 0               # allocated or freed pointer; copy destination; graph exec made
    handle: int = 0            # graph exec launched, stream or event waited on
    ret: int = 0               # the call's result (0: success or not read)
    caller: str = ""           # the call site (function+offset), for allocations
    captured: bool = False     # a launch recorded into a graph being captured, not run
    step: int = 0              # the engine's step open on the thread (0: none)
    op: str = ""               # the engine's op open on the thread ("": none)
    engine: str = ""
    max_ns: int = 0            # the longest of a group's calls (one call: its own time)

    @property
    def dur_ns(self) -> int:
        return self.end_ns - self.start_ns if self.end_ns else 0
