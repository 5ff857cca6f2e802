"""What the cuda level's calls add up to (pure logic): kernels launched (and by which op),
copies by kind, syncs, graph launches, allocations with live device memory, its peak, and
what was never freed (with where it was allocated)."""
from __future__ import annotations

from collections import defaultdict

from profinfer.levels.cuda.records import CudaCall


def live_memory(calls: list[CudaCall], memory: str = "device") -> tuple[list[tuple[int, int]], int, list[CudaCall]]:
    """Successful allocations and frees of `memory` in the order they took effect (at their
    return: an address freed on one thread can be allocated on another before the free's call
    began): the live bytes after each change as (ns, bytes), the peak, and the allocations
    never freed."""
    live: dict[tuple[int, int], CudaCall] = {}
    total, peak, series = 0, 0, []
    for c in sorted((c for c in calls if c.what == "memory" and c.copy_kind == memory and c.ret == 0
                     and c.count == 1), key=lambda c: c.end_ns or c.start_ns):
        key = (c.pid, c.ptr)
        if c.api.startswith(("cudaMalloc", "cudaHostAlloc")):
            if c.ptr == 0:
                continue
            if key in live:                 # a pointer reused without a free we saw
                total -= live.pop(key).bytes
            live[key] = c
            total += c.bytes
        elif key in live:
            total -= live.pop(key).bytes
        else:
            continue
        peak = max(peak, total)
        series.append((c.end_ns or c.start_ns, total))
    return series, peak, sorted(live.values(), key=lambda c: c.start_ns)


def summary(calls: list[CudaCall], steps: int = 0) -> dict:
    kernels: dict[str, dict] = {}
    by_api: dict[str, dict] = defaultdict(lambda: {"calls": 0, "host_ns": 0, "failed": 0})
    copies: dict[str, dict] = defaultdict(lambda: {"calls": 0, "bytes": 0, "host_ns": 0})
    syncs: dict[str, dict] = defaultdict(lambda: {"calls": 0, "blocked_ns": 0, "max_ns": 0})
    per_op: dict[str, dict] = defaultdict(lambda: defaultdict(int))
    graphs: dict[str, int] = defaultdict(int)
    errors: dict[str, dict[int, int]] = defaultdict(lambda: defaultdict(int))
    memory = {"allocations": 0, "allocated_bytes": 0, "frees": 0, "failed": 0}
    launches = captured = 0
    for c in calls:
        a = by_api[c.api]
        a["calls"] += c.count
        a["host_ns"] += c.total_ns
        if c.ret:
            a["failed"] += c.count
            errors[c.api][c.ret] += c.count
        op = c.op or "(no op)"
        if c.what == "launch":
            k = kernels.setdefault(c.kernel, {"launches": 0, "captured": 0, "configs": defaultdict(int),
                                              "ops": defaultdict(int)})
            if c.captured:
                k["captured"] += c.count
                captured += c.count
            else:
                k["launches"] += c.count
                launches += c.count
                k["ops"][op] += c.count
                per_op[op]["launches"] += c.count
            k["configs"][f"grid {c.grid} block {c.block} shmem {c.shmem}"] += c.count
        elif c.what in ("copy", "set"):
            kind = c.copy_kind if c.what == "copy" else "memset"
            copies[kind]["calls"] += c.count
            copies[kind]["bytes"] += c.bytes
            copies[kind]["host_ns"] += c.total_ns
            per_op[op]["copy_bytes"] += c.bytes
        elif c.what == "sync":
            s = syncs[c.api]
            s["calls"] += c.count
            s["blocked_ns"] += c.total_ns
            s["max_ns"] = max(s["max_ns"], c.max_ns or c.dur_ns)
            per_op[op]["sync_ns"] += c.total_ns
            per_op[op]["syncs"] += c.count
        elif c.what == "graph":
            if "GraphLaunch" in c.api:
                graphs[f"0x{c.handle:x}"] += c.count
                per_op[op]["graph_launches"] += c.count
        elif c.what == "memory":
            if c.ret:
                memory["failed"] += c.count
            elif c.api.startswith(("cudaMalloc", "cudaHostAlloc")):
                memory["allocations"] += c.count
                memory["allocated_bytes"] += c.bytes
            else:
                memory["frees"] += c.count
    _, peak, leaks = live_memory(calls)
    _, host_peak, host_leaks = live_memory(calls, "host")
    memory.update(device_peak_bytes=peak, device_live_bytes_at_end=sum(c.bytes for c in leaks),
                  host_pinned_peak_bytes=host_peak,
                  not_freed=[{"ptr": f"0x{c.ptr:x}", "bytes": c.bytes, "memory": c.copy_kind,
                              "api": c.api, "site": c.caller, "pid": c.pid}
                             for c in leaks + host_leaks])
    out = {
        "launches": launches, "captured_launches": captured,
        "graph_launches": sum(graphs.values()), "graph_launches_by_exec": dict(graphs),
        "kernels": {name: {"launches": k["launches"], "captured": k["captured"],
                           "configs": dict(k["configs"]), "ops": dict(k["ops"])}
                    for name, k in sorted(kernels.items(), key=lambda kv: -kv[1]["launches"])},
        "copies": dict(copies), "syncs": dict(syncs), "memory": memory,
        "per_op": {op: dict(v) for op, v in per_op.items()},
        "calls": {api: dict(v) for api, v in sorted(by_api.items())},
        "errors": {api: {str(r): n for r, n in v.items()} for api, v in errors.items()},
    }
    if steps:
        out["launches_per_step"] = launches / steps
        out["graph_launches_per_step"] = out["graph_launches"] / steps
    return out
