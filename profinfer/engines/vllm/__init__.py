"""vLLM: engine steps from the scheduler's output, native ops with tensor shapes."""
from profinfer.core.base.registry import Engine

# ops_on_callers: its op probes trap in the threads that make its steps' calls (the model's
# forward, one thread; the OpenMP pool computes inside the ops), not in every thread
PLUGIN = Engine("vllm", __name__, title="vLLM", bpf="vllm.bpf.c", collector="collector:VllmCollector",
                capabilities=frozenset({"steps_by_process", "op_totals", "ops_on_callers"}),
                timeline="timeline", report="report", commands="commands")
