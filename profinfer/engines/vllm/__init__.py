"""vLLM: engine steps from the scheduler's output, native ops with tensor shapes.

Its collector (collector.py) drives what probes/ finds and decode/ reads, beside the server's
own /metrics (server_metrics.py); views/ reads and shows the profiles it makes; commands.py
and workload.py (with generate.py and make_model.py, run in vLLM's venv) are its commands and
bundled workload."""
from profinfer.core.base.registry import Engine

# ops_on_callers: its op probes trap in the threads that make its steps' calls (the model's
# forward, one thread; the OpenMP pool computes inside the ops), not in every thread
PLUGIN = Engine("vllm", __name__, title="vLLM", bpf="vllm.bpf.c", collector="collector:VllmCollector",
                capabilities=frozenset({"steps_by_process", "op_totals", "ops_on_callers"}),
                timeline="views.timeline", report="views.report", commands="commands")
