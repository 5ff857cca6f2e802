"""The daemon's metrics through OTLP (opentelemetry-sdk; OTLP/HTTP, protobuf), for
`--otlp ENDPOINT`: the same counts as /metrics, under the OpenTelemetry GenAI semantic
conventions' names where they exist (gen_ai.server.time_to_first_token,
gen_ai.server.time_per_output_token, with gen_ai.operation.name and gen_ai.provider.name) and
profinfer's own elsewhere. Each data point carries the process's attributes (process.pid,
process.executable.name, container.id, k8s.pod.name, k8s.namespace.name, k8s.pod.uid) and the
engine. Delta temporality: each export holds what happened since the previous one.

The flight recorder's captures go out as OTLP log records with an event name (OTLP/HTTP
`/v1/logs` beside `/v1/metrics`): `profinfer.capture` for each one kept (its id, trigger,
value, limit, baseline, levels), `profinfer.capture.failed` for one that could not be made
or kept (why)."""
from __future__ import annotations

import socket

from opentelemetry._logs import LogRecord, SeverityNumber
from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter
from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
from opentelemetry.sdk._logs import LoggerProvider
from opentelemetry.sdk._logs.export import BatchLogRecordProcessor
from opentelemetry.sdk.metrics import Counter, Histogram, MeterProvider
from opentelemetry.sdk.metrics.export import AggregationTemporality, PeriodicExportingMetricReader
from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View
from opentelemetry.sdk.resources import Resource

from profinfer.core.profile.model import TokenCall
from profinfer.daemon.discovery.identity import Identity
from profinfer.daemon.export.metrics import TPOT_BUCKETS, TTFT_BUCKETS

TTFT = "gen_ai.server.time_to_first_token"
TPOT = "gen_ai.server.time_per_output_token"


def attributes(ident: Identity) -> dict[str, str | int]:
    out: dict[str, str | int] = {"gen_ai.operation.name": "text_completion",
                                 "gen_ai.provider.name": ident.engine, "profinfer.engine": ident.engine,
                                 "process.pid": ident.pid, "process.executable.name": ident.comm}
    for key, value in (("container.id", ident.container), ("k8s.pod.name", ident.pod),
                       ("k8s.namespace.name", ident.namespace), ("k8s.pod.uid", ident.pod_uid)):
        if value:
            out[key] = value
    return out


class OtlpExport:
    def __init__(self, endpoint: str, interval_s: float = 10.0):
        base = endpoint.rstrip("/").removesuffix("/v1/metrics")
        url = base + "/v1/metrics"
        # delta temporality: the SDK keeps no state for a process once it has gone quiet
        # (cumulative would export every process that ever ran, for ever)
        delta = {kind: AggregationTemporality.DELTA for kind in (Counter, Histogram)}
        reader = PeriodicExportingMetricReader(OTLPMetricExporter(endpoint=url, preferred_temporality=delta),
                                               export_interval_millis=int(interval_s * 1000))
        views = [View(instrument_name=TTFT, aggregation=ExplicitBucketHistogramAggregation(TTFT_BUCKETS)),
                 View(instrument_name=TPOT, aggregation=ExplicitBucketHistogramAggregation(TPOT_BUCKETS))]
        resource = Resource.create({"service.name": "profinfer", "host.name": socket.gethostname()})
        self.provider = MeterProvider(resource=resource, metric_readers=[reader], views=views)
        self.logs = LoggerProvider(resource=resource)
        self.logs.add_log_record_processor(BatchLogRecordProcessor(OTLPLogExporter(endpoint=base + "/v1/logs"),
                                                                   schedule_delay_millis=1000))
        self.events = self.logs.get_logger("profinfer.flight")
        meter = self.meter = self.provider.get_meter("profinfer")
        self.level_counters: dict = {}      # a level's counters by name (added)
        self.ttft = meter.create_histogram(TTFT, unit="s", description="Time to generate the first "
                                           "token of a sequence, from its first prompt decode call")
        self.tpot = meter.create_histogram(TPOT, unit="s", description="Time per output token "
                                           "after the first, per sequence")
        self.tokens = meter.create_counter("profinfer.tokens", unit="{token}", description="Tokens the "
                                           "engine computed, by gen_ai.token.type: input (prompt), output")
        self.calls = meter.create_counter("profinfer.decode_calls", unit="{call}",
                                          description="Engine decode calls, by phase")
        self.graph_computes = meter.create_counter("profinfer.graph.computes", unit="{compute}",
                                                   description="Backend graph computes, by profinfer.backend")
        self.graph_time = meter.create_counter("profinfer.graph.compute.time", unit="s",
                                               description="Time in backend graph computes, by profinfer.backend")
        self.endpoint = url

    def decode_call(self, ident: Identity, t: TokenCall, ttfts: list[int],
                    tpots: list[tuple[float, int]]) -> None:
        attrs = attributes(ident)
        self.calls.add(1, {**attrs, "profinfer.phase": t.phase})
        if t.prefill_tokens:
            self.tokens.add(t.prefill_tokens, {**attrs, "gen_ai.token.type": "input"})
        if t.decode_tokens:
            self.tokens.add(t.decode_tokens, {**attrs, "gen_ai.token.type": "output"})
        for v in ttfts:
            self.ttft.record(v / 1e9, attrs)
        for per_token, n in tpots:
            for _ in range(n):
                self.tpot.record(per_token / 1e9, attrs)

    def added(self, ident: Identity, added: list) -> None:
        """What a level's counters gained (processmetrics.Added): each counter made at its
        first use."""
        attrs = attributes(ident)
        for a in added:
            counter = self.level_counters.get(a.name)
            if counter is None:
                counter = self.level_counters[a.name] = self.meter.create_counter(
                    a.name, unit=a.unit, description=a.description)
            counter.add(a.count, {**attrs, **dict(a.attributes)})

    def graphs(self, ident: Identity, backend: str, computes: int, seconds: float) -> None:
        attrs = {**attributes(ident), "profinfer.backend": backend}
        self.graph_computes.add(computes, attrs)
        self.graph_time.add(seconds, attrs)

    def capture(self, ident: Identity, record: dict) -> None:
        fired = record.get("fired") or {}
        attrs = {**attributes(ident), "profinfer.capture.id": record.get("id", ""),
                 "profinfer.trigger": fired.get("trigger", ""), "profinfer.trigger.reason": fired.get("reason", ""),
                 "profinfer.capture.levels": ",".join(record.get("levels") or []),
                 "profinfer.trigger.unit": fired.get("unit", "")}
        for key in ("value", "limit", "baseline"):
            if isinstance(fired.get(key), (int, float)):
                attrs[f"profinfer.trigger.{key}"] = float(fired[key])
        self.events.emit(LogRecord(event_name="profinfer.capture", severity_number=SeverityNumber.WARN,
                                   severity_text="WARN", attributes=attrs,
                                   body=f"{fired.get('trigger', '')} fired: capture {record.get('id', '')} kept"))

    def capture_failed(self, ident: Identity, reason: str, why: str) -> None:
        self.events.emit(LogRecord(event_name="profinfer.capture.failed", severity_number=SeverityNumber.ERROR,
                                   severity_text="ERROR", body=why[:500],
                                   attributes={**attributes(ident), "profinfer.trigger.reason": reason}))

    def close(self) -> None:
        self.provider.shutdown()       # exports what is left
        self.logs.shutdown()
