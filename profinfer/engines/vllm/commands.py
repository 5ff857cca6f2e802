"""vLLM's part of the command line: its demo workload (offline generation of a tiny Llama,
eager, in a venv of vLLM for CPUs made once)."""
from __future__ import annotations

from profinfer.core.plugin.commands import Demo


def _demo_command(model: str, tokens: int, threads: int) -> tuple[list[str], None]:
    from profinfer.engines.vllm import workload
    return [str(workload.ensure_vllm()), str(workload.GENERATE), str(workload.ensure_model()),
            str(tokens)], None


DEMO = Demo("vllm", "vLLM (offline generation of a tiny Llama, eager)", _demo_command,
            model_help="(vLLM's is its tiny Llama)")
