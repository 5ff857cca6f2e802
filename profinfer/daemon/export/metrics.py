"""The daemon's metrics, kept per watched process and exposed through prometheus-client at
scrape time (a custom collector): a process's series exist while it is watched and for a TTL
after it exits, then go away. Names: the `profinfer_` prefix, base units, `_total` for
counters; labels bounded (engine, pid, comm, container, pod, namespace, phase, program).
Who can reach /metrics reads its labels: LABEL_SETS says which a daemon gives (--labels).

GPU metrics come from NVML (nvml.py).
"""
from __future__ import annotations

import resource
import threading
from functools import lru_cache
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from profinfer.core.base import registry
from profinfer.core.plugin.processmetrics import Histogram, ProcessMetrics
from profinfer.core.profile.model import TokenCall
from profinfer.daemon.discovery.identity import Identity, printable
from profinfer.daemon.export.nvml import GpuSampler, gpu_changes, gpu_families

PROCESS_LABELS = ("engine", "pid", "comm", "container", "pod", "namespace")
# --labels: full, every label; no-paths, without the executable's and the model file's paths
# (the node's file layout, tenants' file names); minimal, engine and pid alone: no paths, no
# command, container, pod or namespace names, no CUDA kernel names (launches summed by process)
LABEL_SETS = ("full", "no-paths", "minimal")
# seconds: TTFT from a few ms (tiny models) to a minute (long prompts on a busy server)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
# seconds per output token: 1 ms to 2.5 s
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.5)
CALL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


@dataclass
class _Process:
    identity: Identity
    calls: dict[str, int] = field(default_factory=dict)     # phase -> decode calls
    tokens: dict[str, int] = field(default_factory=dict)    # prefill/decode -> tokens
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    tpot: Histogram = field(default_factory=lambda: Histogram(TPOT_BUCKETS))
    call_time: dict[str, Histogram] = field(default_factory=dict)
    lost: int = 0
    ops: dict[str, list[int]] = field(default_factory=dict)    # op type -> [ops, ns]
    level: int = 0
    share: float | None = None
    changes: int = 0
    # the graph level, counted in BPF (cumulative): backend -> (computes, ns, nodes, buckets)
    graphs: dict[str, tuple[int, int, int, list[int]]] = field(default_factory=dict)
    shares: dict[str, float] = field(default_factory=dict)   # the share by level ("daemon": its loop)
    # the graph counts of shared objects it has left (the governor moved it): added to the next
    graph_base: dict[str, tuple[int, int, int, list[int]]] = field(default_factory=dict)
    # level -> its counts (ProcessMetrics), from the first records it was given
    levels: dict[str, ProcessMetrics] = field(default_factory=dict)

    def labels(self, minimal: bool = False) -> list[str]:
        i = self.identity
        if minimal:
            return [i.engine, str(i.pid)]
        return [i.engine, str(i.pid), i.comm, i.container, i.pod, i.namespace]


@lru_cache(maxsize=1)
def level_metrics() -> dict[str, type[ProcessMetrics]]:
    """Each plug-in's per-process metrics (its daemon_metrics contribution: a level's, an
    engine's), by plug-in."""
    return {pl.name: pl.part("daemon_metrics").METRICS for pl in registry.plugins() if pl.daemon_metrics}


def _observe_call(p: _Process, t: TokenCall) -> None:
    p.call_time.setdefault(t.phase, Histogram(CALL_BUCKETS)).observe(t.dur_ns / 1e9)


class Metrics:
    def __init__(self, labels: str = "full"):
        assert labels in LABEL_SETS, labels
        self.label_set = labels
        self.registry = CollectorRegistry()
        self.lock = threading.Lock()
        self.processes: dict[int, _Process] = {}
        self.attach_errors = Counter("profinfer_attach_errors", "Processes found but not watched "
                                     "(attaching failed)", ["engine"], registry=self.registry)
        self._http_dropped = Counter("profinfer_http_connections_dropped", "Connections to the "
                                     "daemon's HTTP endpoint cut short, by reason: evicted (the oldest "
                                     "of the peer over its share, or holding the most, for a new one), deadline (a request "
                                     "not whole within its deadline), too_large, malformed, "
                                     "send_deadline (an answer not taken in time)", ["reason"],
                                     registry=self.registry)
        self._captures = Counter("profinfer_captures", "Captures the flight recorder kept, by the "
                                 "trigger that fired them (quantity and statistic)", ["reason"],
                                 registry=self.registry)
        self._capture_failures = Counter("profinfer_capture_failures", "Captures a trigger fired that "
                                         "could not be made or kept", ["reason"], registry=self.registry)
        self.watched_now = 0
        self.processes_dropped = 0    # found past the agent's cap on watched processes
        self.series_dropped = 0       # exited processes' series dropped before their TTL (the cap)
        self.programs: dict[str, tuple[int, int]] = {}
        self.gpu_state = "off"
        self.gpus: list[dict] = []
        self.gpu_problems: dict[str, str] = {}    # device index -> why it answered in part or not
        self._gpu_said: str | None = None           # the state the log last said
        self.gpu_sampler: GpuSampler | None = None   # NVML, in a thread of its own (daemon only)
        self.otlp = None          # an OtlpExport, with --otlp: fed the same observations
        self.otlp_event_errors = 0   # flight recorder events the OTLP export refused (/status)
        self.registry.register(_Exposer(self))

    def http_dropped(self, reason: str) -> None:
        self._http_dropped.labels(reason).inc()

    def capture_made(self, ident: Identity, reason: str, record: dict) -> None:
        """A flight recorder's capture kept (record: capturestore's, with its id)."""
        self._captures.labels(reason).inc()
        if self.otlp is not None:
            try:
                self.otlp.capture(ident, record)
            except Exception:           # the export's trouble: the capture is kept and counted
                self.otlp_event_errors += 1

    def capture_failed(self, ident: Identity, reason: str, why: str) -> None:
        self._capture_failures.labels(reason).inc()
        if self.otlp is not None:
            try:
                self.otlp.capture_failed(ident, reason, why)
            except Exception:
                self.otlp_event_errors += 1

    # ---- fed by the agent ----

    def watched(self, ident: Identity, keep_counts: bool = False) -> None:
        with self.lock:
            p = self.processes.get(ident.pid) if keep_counts else None
            if p is not None:
                p.identity = ident
            else:
                self.processes[ident.pid] = _Process(ident)

    def forget(self, ident: Identity) -> None:
        """Drop an exited process's series, unless its pid is a newer process's now (whose
        series replaced them: two series may not have the same labels)."""
        with self.lock:
            p = self.processes.get(ident.pid)
            if p is not None and p.identity.start == ident.start:
                del self.processes[ident.pid]

    def decode_call(self, ident: Identity, t: TokenCall, ttfts: list[int],
                    tpots: list[tuple[float, int]], timed: bool = True) -> None:
        with self.lock:
            p = self.processes.get(ident.pid)
            if p is None or p.identity.start != ident.start:
                return
            p.calls[t.phase] = p.calls.get(t.phase, 0) + 1
            p.tokens["prefill"] = p.tokens.get("prefill", 0) + t.prefill_tokens
            p.tokens["decode"] = p.tokens.get("decode", 0) + t.decode_tokens
            if timed:
                _observe_call(p, t)
            for v in ttfts:
                p.ttft.observe(v / 1e9)
            for per_token, n in tpots:
                p.tpot.observe(per_token / 1e9, n)
        if self.otlp is not None:
            self.otlp.decode_call(ident, t, ttfts, tpots)

    def call_time(self, ident: Identity, t: TokenCall) -> None:
        """A call's time known after it was counted (a vLLM step's, at the next step)."""
        with self.lock:
            p = self.processes.get(ident.pid)
            if p is not None and p.identity.start == ident.start:
                _observe_call(p, t)

    def op_totals(self, ident: Identity, totals: dict[str, tuple[int, int]]) -> None:
        with self.lock:
            p = self.processes.get(ident.pid)
            if p is None or p.identity.start != ident.start:
                return
            for op, (n, ns) in totals.items():
                acc = p.ops.setdefault(op, [0, 0])
                acc[0] += n
                acc[1] += ns

    def graphs(self, ident: Identity, backends: dict[str, tuple[int, int, int, list[int]]]) -> None:
        """The graph level's cumulative counts from BPF, replacing the last ones."""
        with self.lock:
            p = self.processes.get(ident.pid)
            if p is None or p.identity.start != ident.start:
                return
            before = p.graphs
            p.graphs = {**p.graph_base, **{b: _graph_sum(p.graph_base.get(b), v) for b, v in backends.items()}}
        if self.otlp is not None:
            for backend, (n, ns, _, _) in backends.items():
                old = before.get(backend, (0, 0, 0, []))
                if n > old[0]:
                    self.otlp.graphs(ident, backend, n - old[0], (ns - old[1]) / 1e9)

    def carry_graphs(self, ident: Identity) -> None:
        """The process moves to another shared object (whose counts begin at 0): its graph
        counts so far stay, the new object's added to them."""
        with self.lock:
            p = self.processes.get(ident.pid)
            if p is not None and p.identity.start == ident.start:
                p.graph_base = dict(p.graphs)

    def level(self, ident: Identity, rank: int, changed: bool = False) -> None:
        with self.lock:
            p = self.processes.get(ident.pid)
            if p is not None and p.identity.start == ident.start:
                p.level = rank
                p.changes += int(changed)

    def cost(self, ident: Identity, share: float, shares: dict[str, float] | None = None) -> None:
        with self.lock:
            p = self.processes.get(ident.pid)
            if p is not None and p.identity.start == ident.start:
                p.share = share
                p.shares = dict(shares or {})

    def level_records(self, ident: Identity, level: str, counted: list, sent: list) -> dict[str, tuple[int, int]]:
        """A level's records for the process (its daemon_metrics object reads them): BPF's
        cumulative counts (counted: they replace the last ones) and the records sent since.
        Returns the level's cumulative trigger quantities (ProcessMetrics.samples)."""
        with self.lock:
            p = self.processes.get(ident.pid)
            if p is None or p.identity.start != ident.start:
                return {}
            m = p.levels.get(level)
            if m is None:
                m = p.levels[level] = level_metrics()[level]()
            m.observe(counted, sent)
            if self.otlp is not None and (added := m.added()):
                self.otlp.added(ident, added)
            return m.samples()

    def ended(self, ident: Identity) -> None:
        """The process exited: each plug-in's metrics count what they still held open."""
        with self.lock:
            p = self.processes.get(ident.pid)
            if p is not None and p.identity.start == ident.start:
                for m in p.levels.values():
                    m.close()

    def totals(self, ident: Identity) -> dict[str, dict[str, tuple[float, float]]] | None:
        """The process's cumulative counts as the flight recorder's baseline samples them:
        family -> item -> (count, seconds): "op" (calls, time by op type), "graph" (computes,
        time by backend), "call" (decode calls or steps, their time, by phase), "kernel"
        (launches by kernel; no time: the cuda level counts them), "sync" (calls, time)."""
        with self.lock:
            p = self.processes.get(ident.pid)
            if p is None or p.identity.start != ident.start:
                return None
            out = {"op": {op: (n, ns / 1e9) for op, (n, ns) in p.ops.items()},
                    "graph": {b: (v[0], v[1] / 1e9) for b, v in p.graphs.items()},
                    # the calls timed (vLLM's last step before it idles is not), else counted
                    "call": {ph: ((sum(p.call_time[ph].counts), p.call_time[ph].total)
                                  if ph in p.call_time else (n, 0.0)) for ph, n in p.calls.items()}}
            for m in p.levels.values():
                out.update(m.totals())
            return out

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
        if self.gpu_sampler is None:
            self.gpu_sampler = GpuSampler()
        state, gpus, problems = self.gpu_sampler.latest()
        for line in gpu_changes(self._gpu_said, state, self.gpu_problems, problems):
            agent.log(line)                 # said before it shows in /metrics and /status
        self._gpu_said, self.gpu_problems = state, problems
        self.gpu_state, self.gpus = state, gpus


def _graph_sum(a, b):
    """Two graph counts of a backend (computes, ns, nodes, log2 buckets) added."""
    if a is None:
        return b
    n = max(len(a[3]), len(b[3]))
    buckets = [(a[3][i] if i < len(a[3]) else 0) + (b[3][i] if i < len(b[3]) else 0) for i in range(n)]
    return (a[0] + b[0], a[1] + b[1], a[2] + b[2], buckets)


class _Exposer:
    """prometheus-client custom collector: the families, built at each scrape."""

    def __init__(self, m: Metrics):
        self.m = m

    def collect(self):
        m = self.m
        with m.lock:                  # one moment's values: copied while the agent waits
            procs = [_Process(p.identity, dict(p.calls), dict(p.tokens), p.ttft.copy(), p.tpot.copy(),
                              {k: h.copy() for k, h in p.call_time.items()}, p.lost,
                              {k: list(v) for k, v in p.ops.items()}, p.level, p.share, p.changes,
                              dict(p.graphs), dict(p.shares),
                              levels={n: m.copy() for n, m in p.levels.items()})
                     for p in m.processes.values()]
            programs = dict(m.programs)
            watched = m.watched_now
        minimal = m.label_set == "minimal"
        labels = list(PROCESS_LABELS[:2] if minimal else PROCESS_LABELS)
        yield from self._process_families(procs, labels, minimal, m.label_set == "full")
        for name, cls in level_metrics().items():
            yield from cls.families([(p.labels(minimal), p.levels[name]) for p in procs if name in p.levels],
                                    labels, minimal, printable)
        yield from self._daemon_families(watched, programs)

    @staticmethod
    def _process_families(procs: list, labels: list[str], minimal: bool, paths: bool):
        """Each watched process's series: its engine's calls, tokens, sequences, graphs, ops,
        and what the governor did."""
        info = GaugeMetricFamily("profinfer_process_info", "A watched inference process (value 1)"
                                 + (": its executable and model file" if paths else ""),
                                 labels=labels + (["exe", "model"] if paths else []))
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
                                    "decode call (llama.cpp), or step from its start to the next's "
                                    "where the engine went straight on (vLLM), by phase",
                                    labels=labels + ["phase"])
        lost = CounterMetricFamily("profinfer_events_lost", "Events BPF could not hand to the "
                                   "collector", labels=labels)
        op_calls = CounterMetricFamily("profinfer_op_calls", "Engine ops run (llama.cpp's graph "
                                       "nodes, vLLM's native op calls), by op type (the op level, when the "
                                       "budget allows it)", labels=labels + ["op"])
        op_secs = CounterMetricFamily("profinfer_op_seconds", "Time in engine ops, by op type",
                                      labels=labels + ["op"])
        level = GaugeMetricFamily("profinfer_governor_level", "The levels a process is profiled at, "
                                  "as the governor set them: 3 op, 2 graph, 1 token (or step)", labels=labels)
        share = GaugeMetricFamily("profinfer_overhead_ratio", "What the probes cost a process: "
                                  "kernel-counted BPF time + probe hits x calibrated trap cost, over "
                                  "its CPU time (last governor window)", labels=labels)
        by_level = GaugeMetricFamily("profinfer_overhead_ratio_by_level", "The same, by level: op, "
                                     "cuda, graph, and the floor (token, or step) that is never taken "
                                     "away; daemon: its share of the daemon's loop", labels=labels + ["level"])
        changes = CounterMetricFamily("profinfer_governor_changes", "Level changes the governor made",
                                      labels=labels)
        graph_n = CounterMetricFamily("profinfer_graph_computes", "Backend graph computes (the "
                                      "graph level, counted in BPF), by backend (CPU, CUDA, ...; "
                                      "sched: the scheduler's, over every backend)",
                                      labels=labels + ["backend"])
        graph_t = HistogramMetricFamily("profinfer_graph_compute_duration_seconds", "Duration of "
                                        "each backend graph compute, by backend (log2 buckets "
                                        "counted in BPF)", labels=labels + ["backend"])
        graph_nodes = CounterMetricFamily("profinfer_graph_nodes", "Graph nodes computed (each "
                                          "compute's node count), by backend", labels=labels + ["backend"])
        for p in procs:
            lv = p.labels(minimal)
            for backend, (n, ns, nodes, buckets) in sorted(p.graphs.items()):
                backend = printable(backend)       # named after a symbol of the tenant's file
                graph_n.add_metric(lv + [backend], n)
                graph_nodes.add_metric(lv + [backend], nodes)
                graph_t.add_metric(lv + [backend], _log2_buckets(buckets), ns / 1e9)
            for op, (n, ns) in sorted(p.ops.items()):
                op_calls.add_metric(lv + [op], n)
                op_secs.add_metric(lv + [op], ns / 1e9)
            level.add_metric(lv, p.level)
            if p.share is not None:
                share.add_metric(lv, p.share)
            for part, v in sorted(p.shares.items()):
                by_level.add_metric(lv + [part], v)
            changes.add_metric(lv, p.changes)
            info.add_metric(lv + ([p.identity.exe, p.identity.model] if paths else []), 1)
            for phase, n in sorted(p.calls.items()):
                calls.add_metric(lv + [phase], n)
            for phase in ("prefill", "decode"):
                tokens.add_metric(lv + [phase], p.tokens.get(phase, 0))
            ttft.add_metric(lv, p.ttft.buckets(), p.ttft.total)
            tpot.add_metric(lv, p.tpot.buckets(), p.tpot.total)
            for phase, h in sorted(p.call_time.items()):
                dur.add_metric(lv + [phase], h.buckets(), h.total)
            lost.add_metric(lv, p.lost)
        yield from (info, calls, tokens, ttft, tpot, dur, lost, graph_n, graph_t, graph_nodes,
                    op_calls, op_secs, level, share, by_level, changes)

    def _daemon_families(self, watched: int, programs: dict[str, tuple[int, int]]):
        """The daemon's own series: what it watches and dropped, its BPF programs, its CPU,
        and the GPUs."""
        m = self.m
        g = GaugeMetricFamily("profinfer_processes_watched", "Inference processes being watched now")
        g.add_metric([], watched)
        yield g
        dropped = CounterMetricFamily("profinfer_processes_dropped", "Processes found but not watched: "
                                      "the daemon already watched --max-processes")
        dropped.add_metric([], m.processes_dropped)
        yield dropped
        early = CounterMetricFamily("profinfer_series_dropped", "Exited processes whose series went "
                                    "before their TTL: more than --max-processes had exited within it")
        early.add_metric([], m.series_dropped)
        yield early
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
        yield from gpu_families(m.gpus)


def _log2_buckets(counts: list[int]) -> list[tuple[str, int]]:
    """BPF's histogram (bucket k: under 2^(k+1) x 1024 ns; the last: the rest) as cumulative
    Prometheus buckets in seconds."""
    out, acc = [], 0
    for k, c in enumerate(counts):
        acc += c
        le = "+Inf" if k == len(counts) - 1 else repr((1 << (k + 1)) * 1024 / 1e9)
        out.append((le, acc))
    return out
