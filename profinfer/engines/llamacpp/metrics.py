"""llama-server's requests in the daemon (this plugin's `daemon_metrics`): per process, the
histograms of each request's queue, time to first token from its slot's launch, time per
output token and tokens, as each request is finished (decode/live.py: bounded); what was
dropped unfinished, counted. No token text: task ids, slots and token counts only."""
from __future__ import annotations

import time

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

from profinfer.core.plugin.processmetrics import Histogram, ProcessMetrics
from profinfer.engines.llamacpp.decode.live import DROPS, RequestBook

SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
PER_TOKEN = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.5)
TOKENS = tuple(float(2 ** i) for i in range(18))      # 1 to 131072
# name, help, buckets
FAMILIES = (
    ("profinfer_request_queue_seconds", "llama-server requests: from the post of its task to "
     "the server's queue to its launch on a slot", SECONDS),
    ("profinfer_request_time_to_first_token_seconds", "llama-server requests: from the launch on "
     "its slot (not the client's send) to the end of the decode call that completed its prompt, "
     "as the server's prompt_ms", SECONDS),
    ("profinfer_request_time_per_output_token_seconds", "llama-server requests: per generated "
     "token after the first, as the server's predicted_per_token_ms", PER_TOKEN),
    ("profinfer_request_prompt_tokens", "llama-server requests: prompt tokens computed (the "
     "cached prefix not counted), as the server's prompt_n", TOKENS),
    ("profinfer_request_generated_tokens", "llama-server requests (completions): tokens "
     "generated, as the server's predicted_n", TOKENS),
)


class RequestMetrics(ProcessMetrics):
    def __init__(self, book: RequestBook | None = None):
        self.book = book if book is not None else RequestBook()
        self.hists = [Histogram(b) for _, _, b in FAMILIES]

    def observe(self, counted: list, sent: list) -> None:
        """sent: the process's request marks and decode calls since the last observe (maybe
        none: what has been quiet is finished all the same)."""
        self.book.feed(sent, time.monotonic_ns())      # CLOCK_MONOTONIC, as BPF's stamps
        self._finished()

    def close(self) -> None:
        self.book.close()
        self._finished()

    def _finished(self) -> None:
        queue, ttft, tpot, prompt, generated = self.hists
        for r in self.book.take():
            if r.queue_ns is not None:
                queue.observe(r.queue_ns / 1e9)
            if r.ttft_ns is not None:
                ttft.observe(r.ttft_ns / 1e9)
            if r.tpot_ns is not None:
                tpot.observe(r.tpot_ns / 1e9)
            if r.first_token_ns is not None:
                prompt.observe(r.prompt_tokens)
                if r.generated_tokens:
                    generated.observe(r.generated_tokens)

    def copy(self) -> "RequestMetrics":
        other = RequestMetrics(RequestBook())        # a scrape's copy: its counts, no requests
        other.hists = [h.copy() for h in self.hists]
        other.book.dropped = dict(self.book.dropped)
        other.book.marked = self.book.marked
        return other

    @staticmethod
    def families(processes, labels, minimal, printable):
        fams = [HistogramMetricFamily(name, doc, labels=labels) for name, doc, _ in FAMILIES]
        dropped = CounterMetricFamily("profinfer_requests_dropped", "llama-server requests the daemon "
                                      "let go unfinished, by reason: pending_cap (posts waiting over "
                                      "its cap per process), pending_expired (a post never launched), "
                                      "in_flight_cap (requests in flight over its cap)",
                                      labels=labels + ["reason"])
        for values, m in processes:
            if not m.book.marked:       # no server (llama-completion): no request series
                continue
            for fam, h in zip(fams, m.hists):
                fam.add_metric(values, h.buckets(), h.total)
            for reason in DROPS:
                dropped.add_metric(values + [reason], m.book.dropped[reason])
        yield from fams
        yield dropped


METRICS = RequestMetrics
