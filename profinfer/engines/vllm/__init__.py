"""vLLM: engine steps from the scheduler's output, native ops with tensor shapes."""
from profinfer.core.registry import Engine

PLUGIN = Engine("vllm", __name__, title="vLLM", capabilities=frozenset({"steps_by_process", "op_totals"}),
                timeline="timeline", report="report", commands="commands")
