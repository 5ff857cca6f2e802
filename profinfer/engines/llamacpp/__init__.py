"""llama.cpp (and ggml): tokens from llama_decode, graphs, ops with tensor shapes.

Its collector (collector.py) drives what probes/ plans and decode/ reads; views/ reads and
shows the profiles it makes; commands.py and workload.py are its commands and bundled
workload."""
from profinfer.core.base.registry import Engine

PLUGIN = Engine("llamacpp", __name__, title="llama.cpp", bpf="llamacpp.bpf.c",
                collector="collector:LlamaCppCollector",
                capabilities=frozenset({"tokens_by_process", "graph_totals", "op_totals",
                                          "records_by_process"}),
                timeline="views.timeline", report="views.report", commands="commands",
                accounting="probes.barrier", daemon_metrics="metrics")
