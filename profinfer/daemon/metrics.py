"""The daemon's metrics, kept per watched process and exposed through prometheus-client at
scrape time (a custom collector): a process's series exist while it is watched and for a TTL
after it exits, then go away. Names: the `profinfer_` prefix, base units, `_total` for
counters; labels bounded (engine, pid, comm, container, pod, namespace, phase, program).

GPU metrics come from NVML (nvidia-ml-py) where a driver is present, named so that a DCGM
exporter user finds their way (the DCGM field each matches is in its help text); without
one, they are off, said once.
"""
from __future__ import annotations

import bisect
import resource
import threading
import time
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from ..model import TokenCall
from .identity import Identity

PROCESS_LABELS = ("engine", "pid", "comm", "container", "pod", "namespace")
# seconds: TTFT from a few ms (tiny models) to a minute (long prompts on a busy server)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
# seconds per output token: 1 ms to 2.5 s
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.5)
CALL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


@dataclass
class _Histogram:
    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0

    def __post_init__(self):
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, v: float, n: int = 1) -> None:
        self.counts[bisect.bisect_left(self.bounds, v)] += n
        self.total += v * n

    def copy(self) -> "_Histogram":
        h = _Histogram(self.bounds)
        h.counts, h.total = list(self.counts), self.total
        return h

    def buckets(self) -> list[tuple[str, int]]:
        out, acc = [], 0
        for le, c in zip(list(self.bounds) + [float("inf")], self.counts):
            acc += c
            out.append(("+Inf" if le == float("inf") else repr(float(le)), acc))
        return out


@dataclass
class _Process:
    identity: Identity
    calls: dict[str, int] = field(default_factory=dict)     # phase -> decode calls
    tokens: dict[str, int] = field(default_factory=dict)    # prefill/decode -> tokens
    ttft: _Histogram = field(default_factory=lambda: _Histogram(TTFT_BUCKETS))
    tpot: _Histogram = field(default_factory=lambda: _Histogram(TPOT_BUCKETS))
    call_time: dict[str, _Histogram] = field(default_factory=dict)
    lost: int = 0
    ops: dict[str, list[int]] = field(default_factory=dict)    # op type -> [ops, ns]
    level: int = 0
    share: float | None = None
    changes: int = 0

    def labels(self) -> list[str]:
        i = self.identity
        return [i.engine, str(i.pid), i.comm, i.container, i.pod, i.namespace]


class Metrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        self.lock = threading.Lock()
        self.processes: dict[int, _Process] = {}
        self.attach_errors = Counter("profinfer_attach_errors", "Processes found but not watched "
                                     "(attaching failed)", ["engine"], registry=self.registry)
        self.watched_now = 0
        self.programs: dict[str, tuple[int, int]] = {}
        self.gpu_state = "off"
        self.gpus: list[dict] = []
        self.otlp = None          # an OtlpExport, with --otlp: fed the same observations
        self.registry.register(_Exposer(self))

    # ---- fed by the agent ----

    def watched(self, ident: Identity, keep_counts: bool = False) -> None:
        with self.lock:
            p = self.processes.get(ident.pid) if keep_counts else None
            if p is not None:
                p.identity = ident
            else:
                self.processes[ident.pid] = _Process(ident)

    def exited(self, ident: Identity) -> None:
        pass       # kept until forget(): a scrape after the exit still sees its last counts

    def forget(self, ident: Identity) -> None:
        """Drop an exited process's series, unless its pid is a newer process's now (whose
        series replaced them: two series may not have the same labels)."""
        with self.lock:
            p = self.processes.get(ident.pid)
            if p is not None and p.identity.start == ident.start:
                del self.processes[ident.pid]

    def decode_call(self, ident: Identity, t: TokenCall, ttfts: list[int],
                    tpots: list[tuple[float, int]]) -> None:
        with self.lock:
            p = self.processes.get(ident.pid)
            if p is None or p.identity.start != ident.start:
                return
            p.calls[t.phase] = p.calls.get(t.phase, 0) + 1
            p.tokens["prefill"] = p.tokens.get("prefill", 0) + t.prefill_tokens
            p.tokens["decode"] = p.tokens.get("decode", 0) + t.decode_tokens
            p.call_time.setdefault(t.phase, _Histogram(CALL_BUCKETS)).observe(t.dur_ns / 1e9)
            for v in ttfts:
                p.ttft.observe(v / 1e9)
            for per_token, n in tpots:
                p.tpot.observe(per_token / 1e9, n)
        if self.otlp is not None:
            self.otlp.decode_call(ident, t, ttfts, tpots)

    def op_totals(self, ident: Identity, totals: dict[str, tuple[int, int]]) -> None:
        with self.lock:
            p = self.processes.get(ident.pid)
            if p is None or p.identity.start != ident.start:
                return
            for op, (n, ns) in totals.items():
                acc = p.ops.setdefault(op, [0, 0])
                acc[0] += n
                acc[1] += ns

    def level(self, ident: Identity, rank: int, changed: bool = False) -> None:
        with self.lock:
            p = self.processes.get(ident.pid)
            if p is not None and p.identity.start == ident.start:
                p.level = rank
                p.changes += int(changed)

    def cost(self, ident: Identity, share: float) -> None:
        with self.lock:
            p = self.processes.get(ident.pid)
            if p is not None and p.identity.start == ident.start:
                p.share = share

    def lost(self, ident: Identity, n: int) -> None:
        with self.lock:
            p = self.processes.get(ident.pid)
            if p is not None:
                p.lost += n

    def self_metrics(self, agent) -> None:
        totals = agent.program_totals()
        with self.lock:
            self.watched_now = len(agent.watches)
            self.programs = totals
        self.gpus = gpu_sample(self)


class _Exposer:
    """prometheus-client custom collector: the families, built at each scrape."""

    def __init__(self, m: Metrics):
        self.m = m

    def collect(self):
        m = self.m
        with m.lock:                  # one moment's values: copied while the agent waits
            procs = [_Process(p.identity, dict(p.calls), dict(p.tokens), p.ttft.copy(), p.tpot.copy(),
                              {k: h.copy() for k, h in p.call_time.items()}, p.lost,
                              {k: list(v) for k, v in p.ops.items()}, p.level, p.share, p.changes)
                     for p in m.processes.values()]
            programs = dict(m.programs)
            watched = m.watched_now
        labels = list(PROCESS_LABELS)
        info = GaugeMetricFamily("profinfer_process_info", "A watched inference process (value 1): "
                                 "its executable and model file", labels=labels + ["exe", "model"])
        calls = CounterMetricFamily("profinfer_decode_calls", "Engine decode calls (llama_decode) by "
                                    "phase: prefill, decode, mixed", labels=labels + ["phase"])
        tokens = CounterMetricFamily("profinfer_tokens", "Tokens the engine computed, by phase: "
                                     "prefill (prompt) and decode (generated)", labels=labels + ["phase"])
        ttft = HistogramMetricFamily("profinfer_time_to_first_token_seconds", "Time from a "
                                     "sequence's first prompt decode call to the end of its prefill "
                                     "(its first token), per sequence", labels=labels)
        tpot = HistogramMetricFamily("profinfer_time_per_output_token_seconds", "Time per generated "
                                     "token of a sequence (since its previous token)", labels=labels)
        dur = HistogramMetricFamily("profinfer_decode_call_duration_seconds", "Duration of each "
                                    "decode call, by phase", labels=labels + ["phase"])
        lost = CounterMetricFamily("profinfer_events_lost", "Events BPF could not hand to the "
                                   "collector", labels=labels)
        op_calls = CounterMetricFamily("profinfer_op_calls", "Engine ops (graph nodes) run, by op "
                                       "type (the op level, when the budget allows it)", labels=labels + ["op"])
        op_secs = CounterMetricFamily("profinfer_op_seconds", "Time in engine ops, by op type",
                                      labels=labels + ["op"])
        level = GaugeMetricFamily("profinfer_governor_level", "The levels a process is profiled at, "
                                  "as the governor set them: 3 op, 2 graph, 1 token", labels=labels)
        share = GaugeMetricFamily("profinfer_overhead_ratio", "What the probes cost a process: "
                                  "kernel-counted BPF time + probe hits x calibrated trap cost, over "
                                  "its CPU time (last governor window)", labels=labels)
        changes = CounterMetricFamily("profinfer_governor_changes", "Level changes the governor made",
                                      labels=labels)
        for p in procs:
            lv = p.labels()
            for op, (n, ns) in sorted(p.ops.items()):
                op_calls.add_metric(lv + [op], n)
                op_secs.add_metric(lv + [op], ns / 1e9)
            level.add_metric(lv, p.level)
            if p.share is not None:
                share.add_metric(lv, p.share)
            changes.add_metric(lv, p.changes)
            info.add_metric(lv + [p.identity.exe, p.identity.model], 1)
            for phase, n in sorted(p.calls.items()):
                calls.add_metric(lv + [phase], n)
            for phase in ("prefill", "decode"):
                tokens.add_metric(lv + [phase], p.tokens.get(phase, 0))
            ttft.add_metric(lv, p.ttft.buckets(), p.ttft.total)
            tpot.add_metric(lv, p.tpot.buckets(), p.tpot.total)
            for phase, h in sorted(p.call_time.items()):
                dur.add_metric(lv + [phase], h.buckets(), h.total)
            lost.add_metric(lv, p.lost)
        yield from (info, calls, tokens, ttft, tpot, dur, lost, op_calls, op_secs, level, share, changes)
        g = GaugeMetricFamily("profinfer_processes_watched", "Inference processes being watched now")
        g.add_metric([], watched)
        yield g
        runs = CounterMetricFamily("profinfer_bpf_program_runs", "Runs of profinfer's BPF programs "
                                   "(the kernel's count, run-time statistics on)", labels=["program"])
        secs = CounterMetricFamily("profinfer_bpf_program_run_seconds", "Time profinfer's BPF "
                                   "programs ran (the kernel's count)", labels=["program"])
        for prog, (ns, n) in sorted(programs.items()):
            runs.add_metric([prog], n)
            secs.add_metric([prog], ns / 1e9)
        yield from (runs, secs)
        ru = resource.getrusage(resource.RUSAGE_SELF)
        cpu = CounterMetricFamily("profinfer_collector_cpu_seconds", "CPU time the daemon process "
                                  "used (its loop, HTTP, NVML; captures run as processes of their own)")
        cpu.add_metric([], ru.ru_utime + ru.ru_stime)
        yield cpu
        gpu_on = GaugeMetricFamily("profinfer_gpu_metrics_enabled", "1 when NVML answers (a GPU driver "
                                   "is present), else 0")
        gpu_on.add_metric([], 1 if m.gpu_state == "on" else 0)
        yield gpu_on
        yield from _gpu_families(m.gpus)


# ---- NVML ----

_nvml = {"state": None, "tried": 0.0}
NVML_RETRY_S = 60.0      # a driver loaded after the daemon started is found within this


def _nvml_init() -> str:
    """"on", or why GPU metrics are off (the caller says it once); tried again now and then."""
    now = time.monotonic()
    if _nvml["state"] != "on" and (_nvml["state"] is None or now - _nvml["tried"] >= NVML_RETRY_S):
        _nvml["tried"] = now
        try:
            import pynvml
            pynvml.nvmlInit()
            _nvml["state"] = "on"
        except Exception as e:        # NVMLError, a missing libnvidia-ml: GPU metrics off
            _nvml["state"] = f"off: {type(e).__name__}: {e}"
    return _nvml["state"]


def _nvml_value(fn, *args, default=None):
    """One NVML query; a query a device does not support (MIG, some boards) is left out."""
    import pynvml
    try:
        return fn(*args)
    except pynvml.NVMLError:
        return default


def gpu_sample(m: Metrics) -> list[dict]:
    state = _nvml_init()
    m.gpu_state = state
    if state != "on":
        return []
    import pynvml
    count = _nvml_value(pynvml.nvmlDeviceGetCount, default=0)
    out = []
    for i in range(count):
        h = _nvml_value(pynvml.nvmlDeviceGetHandleByIndex, i)
        if h is None:
            continue
        util = _nvml_value(pynvml.nvmlDeviceGetUtilizationRates, h)
        mem = _nvml_value(pynvml.nvmlDeviceGetMemoryInfo, h)
        power = _nvml_value(pynvml.nvmlDeviceGetPowerUsage, h)
        procs = _nvml_value(pynvml.nvmlDeviceGetComputeRunningProcesses, h, default=[])
        out.append({"gpu": str(i), "uuid": _nvml_value(pynvml.nvmlDeviceGetUUID, h, default=""),
                    "util": None if util is None else util.gpu / 100,
                    "used": None if mem is None else mem.used, "total": None if mem is None else mem.total,
                    "power": None if power is None else power / 1000,
                    "processes": [(p.pid, p.usedGpuMemory or 0) for p in procs]})
    return out


def _gpu_families(gpus: list[dict]):
    if not gpus:
        return
    util = GaugeMetricFamily("profinfer_gpu_utilization_ratio", "GPU busy share over the last "
                             "sample period (DCGM_FI_DEV_GPU_UTIL / 100)", labels=["gpu", "uuid"])
    used = GaugeMetricFamily("profinfer_gpu_memory_used_bytes", "GPU memory used (DCGM_FI_DEV_FB_USED, "
                             "in bytes)", labels=["gpu", "uuid"])
    total = GaugeMetricFamily("profinfer_gpu_memory_total_bytes", "GPU memory (DCGM_FI_DEV_FB_TOTAL, "
                              "in bytes)", labels=["gpu", "uuid"])
    power = GaugeMetricFamily("profinfer_gpu_power_watts", "GPU power draw (DCGM_FI_DEV_POWER_USAGE)",
                              labels=["gpu", "uuid"])
    pmem = GaugeMetricFamily("profinfer_gpu_process_memory_bytes", "GPU memory a process uses "
                             "(NVML's compute processes; host pids)", labels=["gpu", "uuid", "pid"])
    for g in gpus:
        lv = [g["gpu"], g["uuid"]]
        for fam, key in ((util, "util"), (used, "used"), (total, "total"), (power, "power")):
            if g[key] is not None:
                fam.add_metric(lv, g[key])
        for pid, b in g["processes"]:
            pmem.add_metric(lv + [str(pid)], b)
    yield from (util, used, total, power, pmem)

