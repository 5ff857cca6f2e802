"""The cuda level's series in the daemon (this plugin's `daemon_metrics`): kernel and graph
launches, copies and sets, sync time and live device memory, per process."""
from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from profinfer.core.plugin.processmetrics import Added, ProcessMetrics

TOP_KERNELS = 20        # kernel names per process in metrics; the rest are "other"
# OpenTelemetry eBPF Instrumentation's names for CUDA
LAUNCHES = ("gpu.cuda.kernel.launch.calls", "{call}", "CUDA kernel launches (cuda.kernel.name)")
GRAPH_LAUNCHES = ("gpu.cuda.graph.launch.calls", "{call}", "CUDA graph launches")


class CudaMetrics(ProcessMetrics):
    def __init__(self):
        self.kernels: dict[str, int] = {}
        self.copies: dict[str, list[int]] = {}         # kind -> [count, bytes] (counted in BPF)
        self.sent_copies: dict[str, list[int]] = {}    # Default copies: sent, not counted in BPF
        self.syncs: dict[str, list[int]] = {}          # call -> [count, ns]
        self.graphs = 0
        self.live: dict[int, int] = {}                 # device allocations: pointer -> bytes
        self.before: tuple[dict[str, int], int] | None = None   # the launches the last counts replaced

    def observe(self, counted: list, sent: list) -> None:
        self.before = None
        if counted:
            kernels: dict[str, int] = {}
            copies: dict[str, list[int]] = {}
            syncs: dict[str, list[int]] = {}
            graphs = 0
            for c in counted:
                if c.what == "launch" and not c.captured:
                    kernels[c.kernel] = kernels.get(c.kernel, 0) + c.count
                elif c.what in ("copy", "set"):
                    acc = copies.setdefault(c.copy_kind if c.what == "copy" else "memset", [0, 0])
                    acc[0] += c.count
                    acc[1] += c.bytes
                elif c.what == "sync":
                    acc = syncs.setdefault(c.api, [0, 0])
                    acc[0] += c.count
                    acc[1] += c.total_ns
                elif "GraphLaunch" in c.api:
                    graphs += c.count
            self.before = (self.kernels, self.graphs)
            self.kernels, self.copies, self.syncs, self.graphs = kernels, copies, syncs, graphs
        for c in sent:
            if c.what == "memory" and c.ret == 0 and c.copy_kind == "device":
                if c.api.startswith("cudaMalloc") and c.ptr:
                    self.live[c.ptr] = c.bytes
                elif c.api.startswith("cudaFree"):
                    self.live.pop(c.ptr, None)
            elif c.what == "copy":
                acc = self.sent_copies.setdefault(c.copy_kind, [0, 0])
                acc[0] += 1
                acc[1] += c.bytes

    def added(self) -> list[Added]:
        if self.before is None:
            return []
        kernels, graphs = self.before
        top = {k for k, _ in sorted(self.kernels.items(), key=lambda kv: -kv[1])[:TOP_KERNELS]}
        by_name: dict[str, int] = {}
        for k, n in self.kernels.items():
            if n > kernels.get(k, 0):
                name = k if k in top else "other"      # bounded, as /metrics
                by_name[name] = by_name.get(name, 0) + n - kernels.get(k, 0)
        out = [Added(*LAUNCHES, n, (("cuda.kernel.name", k),)) for k, n in by_name.items()]
        if self.graphs > graphs:
            out.append(Added(*GRAPH_LAUNCHES, self.graphs - graphs))
        return out

    def copy(self) -> "CudaMetrics":
        other = CudaMetrics()
        other.kernels, other.graphs, other.live = dict(self.kernels), self.graphs, dict(self.live)
        other.copies = {k: list(v) for k, v in self.copies.items()}
        other.sent_copies = {k: list(v) for k, v in self.sent_copies.items()}
        other.syncs = {k: list(v) for k, v in self.syncs.items()}
        return other

    def totals(self) -> dict[str, dict[str, tuple[float, float]]]:
        # launches have no time: the cuda level counts them
        return {"kernel": {k: (n, 0.0) for k, n in self.kernels.items()},
                "sync": {a: (n, ns / 1e9) for a, (n, ns) in self.syncs.items()}}

    def samples(self) -> dict[str, tuple[int, int]]:
        return {"sync": (sum(n for n, _ in self.syncs.values()), sum(ns for _, ns in self.syncs.values()))}

    @staticmethod
    def families(processes, labels, minimal, printable):
        launches = CounterMetricFamily("profinfer_cuda_kernel_launches", "CUDA kernel launches" + (
                                       "" if minimal else f", by kernel (each process's top {TOP_KERNELS} "
                                       "by launches; the rest: other)"),
                                       labels=labels + ([] if minimal else ["kernel"]))
        graphs = CounterMetricFamily("profinfer_cuda_graph_launches", "CUDA graph launches", labels=labels)
        copies = CounterMetricFamily("profinfer_cuda_copies", "CUDA copies and sets, by kind "
                                     "(H2H, H2D, D2H, D2D, Default..., memset)", labels=labels + ["kind"])
        copy_bytes = CounterMetricFamily("profinfer_cuda_copy_bytes", "Bytes CUDA copies and sets moved, "
                                         "by kind", labels=labels + ["kind"])
        syncs = CounterMetricFamily("profinfer_cuda_sync_seconds", "Host time blocked in CUDA syncs, by "
                                    "call", labels=labels + ["call"])
        live = GaugeMetricFamily("profinfer_cuda_live_device_bytes", "Device memory allocated by the "
                                 "process's CUDA runtime calls since profinfer watched it, not freed",
                                 labels=labels)
        for lv, m in processes:
            ranked = sorted(m.kernels.items(), key=lambda kv: -kv[1])
            if minimal:
                launches.add_metric(lv, sum(n for _, n in ranked))
                ranked = []
            for name, n in ranked[:TOP_KERNELS]:
                launches.add_metric(lv + [printable(name)], n)     # a symbol of the tenant's file
            if len(ranked) > TOP_KERNELS:
                launches.add_metric(lv + ["other"], sum(n for _, n in ranked[TOP_KERNELS:]))
            graphs.add_metric(lv, m.graphs)
            kinds: dict[str, list[int]] = {}
            for src in (m.copies, m.sent_copies):
                for kind, (n, b) in src.items():
                    acc = kinds.setdefault(kind, [0, 0])
                    acc[0] += n
                    acc[1] += b
            for kind, (n, b) in sorted(kinds.items()):
                copies.add_metric(lv + [kind], n)
                copy_bytes.add_metric(lv + [kind], b)
            for call, (_, ns) in sorted(m.syncs.items()):
                syncs.add_metric(lv + [call], ns / 1e9)
            live.add_metric(lv, sum(m.live.values()))
        return (launches, graphs, copies, copy_bytes, syncs, live)


METRICS = CudaMetrics
