"""llama.cpp's part of the command line: its demo workload (llama-completion on a bundled
model) and `profinfer graph`, the computation graph of a saved trace."""
from __future__ import annotations

import click

from profinfer.core.plugin.commands import Demo, Services

PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time"


def _demo_command(model: str, tokens: int, threads: int) -> tuple[list[str], dict[str, str]]:
    from profinfer.engines.llamacpp import workload
    build = workload.ensure_llama_build()
    gguf = workload.ensure_model(model)
    return (workload.completion_command(build, gguf, PROMPT, tokens, threads),
            workload.llama_env(build))


def _demo_ready() -> bool:
    from profinfer.engines.llamacpp import workload
    return workload.built(workload.LLAMA_VERSION) and workload.model_made("tiny")


DEMO = Demo("llama.cpp", "llama.cpp (llama-completion)", _demo_command,
            models=("tiny", "llama-1.5b"), model_help="llama.cpp's model", ready=_demo_ready)


def add_commands(group: click.Group, services: Services) -> None:
    @group.command(name="graph")
    @click.argument("trace", type=click.Path(dir_okay=False))
    @click.option("-o", "--output", type=click.Path(dir_okay=False),
                  help="Write the graph: .svg/.png/.pdf (Graphviz) or .dot.")
    @click.option("--phase", type=click.Choice(["decode", "prefill"]), default="decode", show_default=True)
    @click.option("--no-collapse", is_flag=True, help="Keep every transformer layer's nodes.")
    def graph_cmd(trace, output, phase, no_collapse):
        """The computation graph (DAG) of a saved trace, with time shares and verdicts."""
        from profinfer.core.calibration import stamped
        from profinfer.engines.llamacpp.views import dag as dagmod, dagview
        if output:
            services.check_output("-o", output)
        profile = services.load_trace(trace)
        roofs = stamped.roofs(profile)
        dag = dagmod.build(profile, phase, collapse=not no_collapse, roofs=roofs.value)
        dagview.render(dag, services.console())
        judged_by = "" if roofs.value is None else \
            f" against {roofs.value.peak_gbps:,.1f} GB/s and {roofs.value.peak_gflops:,.1f} GFLOP/s"
        (click.echo if roofs.stored else services.warn)(f"verdicts{judged_by}: {roofs.origin}")
        if output:
            dagmod.write(dag, output)
            click.echo(f"profinfer: wrote {output}", err=True)
