"""llama.cpp (and ggml): tokens from llama_decode, graphs, ops with tensor shapes."""
from profinfer.core.base.registry import Engine

PLUGIN = Engine("llamacpp", __name__, title="llama.cpp", bpf="llamacpp.bpf.c",
                collector="collector:LlamaCppCollector",
                capabilities=frozenset({"tokens_by_process", "graph_totals", "op_totals"}),
                timeline="timeline", report="report", commands="commands",
                accounting="barrier")
