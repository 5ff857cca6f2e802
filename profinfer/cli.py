"""Command line: attach, record, report, demo, doctor.

Every failure the user can act on ends as one line on stderr and a non-zero exit code.
"""
from __future__ import annotations

import math
import sys

import click

from profinfer.daemon.http import client
from profinfer.daemon.http.tokens import TOKEN_ENV
from profinfer.core.base.errors import OutputFailed, ProfinferError
from profinfer.core.profile.model import Profile
from profinfer.core.plugin.packs import KERNEL_LEVELS, LEVELS, MIN_DURATION_S, RUNTIME_LEVELS
from profinfer.recording import how_it_ended, record_command, shell_status
from profinfer.say import error as _error, note as _note, warn as _warn
from profinfer.traces import compare_sides, load_trace, write_diff_html

class FiniteRange(click.FloatRange):
    """A FloatRange that also refuses nan and the infinities (nan passes every bound)."""

    def convert(self, value, param, ctx):
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return number


def _levels(value: str, option: str = "--levels") -> set[str]:
    levels = {v.strip() for v in value.split(",") if v.strip()}
    known = LEVELS + ("step",) + KERNEL_LEVELS + RUNTIME_LEVELS
    bad = levels - set(known)
    if bad or not levels:
        raise click.BadParameter(f"unknown level(s) {', '.join(sorted(bad)) or '(none)'}; "
                                 f"choose from {','.join(known)}", param_hint=option)
    return levels


def _counters(value: str | None) -> list[str]:
    from profinfer.core.ebpf import perfevents as counters
    names = [v.strip() for v in (value or "").split(",") if v.strip()]
    try:
        counters.requested(names)
    except ProfinferError as e:
        raise click.BadParameter(str(e), param_hint="--counters") from None
    return names


def output_options(f):
    f = click.option("--json", "json_path", type=click.Path(dir_okay=False),
                     help="Write a machine-readable summary (JSON) to this file.")(f)
    f = click.option("-o", "--output", type=click.Path(dir_okay=False),
                     help="Write the timeline: .pftrace (Perfetto protobuf) or .json (Chrome JSON).")(f)
    f = click.option("--quiet", is_flag=True, help="Do not print the operator view.")(f)
    return f


def probe_options(f):
    f = click.option("--levels", default=",".join(LEVELS), show_default=True,
                     help="Comma-separated levels: token, graph, op (vLLM: op, step), sched (context "
                     "switches and wakeups of the target's threads: preempted and sleeping time per "
                     "op), and cuda (CUDA runtime and driver calls: launches, copies, allocations, "
                     "syncs, graphs; alone for a program that is no known engine).")(f)
    f = click.option("--pack", "packs", multiple=True, type=click.Path(dir_okay=False),
                     help="A probe pack file (TOML, as an engine's pack.toml), tried before the bundled "
                     "ones: an engine or a program's own functions as ops.")(f)
    f = click.option("--duration", type=FiniteRange(min=MIN_DURATION_S),
                     help="Stop after this many seconds (default: until Ctrl-C or target exit).")(f)
    f = click.option("--tensor-layout", help="Skip DWARF and decode ggml_tensor with this known layout, "
                     "or these offsets (type=0,ne=16,op=80,src=152,view_src=232,data=248,name=256); "
                     "validated on live data.")(f)
    f = click.option("--buffer", type=click.Choice(["auto", "ring", "perf"]), default="auto",
                     show_default=True, help="BPF-to-user transport: ring buffer (Linux 5.12+) "
                     "or per-CPU perf buffers.")(f)
    f = click.option("--counters", metavar="EVENTS", help="perf counters read at each op's start "
                     "and end, perf's names: cycles,instructions,cache-misses,task-clock,"
                     "page-faults,LLC-load-misses,r01a3,... (at most 4; needs the op level).")(f)
    return f


def _check_outputs(output: str | None, json_path: str | None, html_path: str | None = None) -> None:
    """Refuse an output that cannot be written before anything is attached or run."""
    from profinfer import outputs
    outputs.check_writable(outputs.requested(output, json_path, html_path))


def _emit(profile: Profile, output: str | None, json_path: str | None, quiet: bool,
          html_path: str | None = None) -> bool:
    """Write the outputs and print the operator view. False when an output could not be
    written where asked (it is then saved elsewhere, and an error line says where)."""
    from profinfer import outputs
    from profinfer.viewers import optable
    written = outputs.write_all(profile, outputs.requested(output, json_path, html_path), say=_note, error=_error)
    if not quiet:
        optable.render(profile)
    return written


def _version(ctx, _param, value):
    """--version: the version, and where the BPF objects come from (nothing is built)."""
    if value and not ctx.resilient_parsing:
        from importlib.metadata import version
        from profinfer.core.ebpf import bpfobj
        click.echo(f"profinfer, version {version('profinfer')}\nBPF objects: {bpfobj.provenance()}")
        ctx.exit()


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--version", is_flag=True, expose_value=False, is_eager=True, callback=_version,
              help="Show the version and where the BPF objects come from, and exit.")
def cli():
    """profinfer: eBPF profiler for LLM inference engines (llama.cpp, vLLM; the CUDA runtime under any)."""


@cli.command()
@click.option("-p", "--pid", type=int, required=True, help="Process to profile.")
@probe_options
@output_options
def attach(pid, levels, duration, tensor_layout, buffer, counters, packs, output, json_path, quiet):
    """Profile a running llama.cpp or vLLM process (or a CUDA program), without restarting it."""
    from profinfer.core.calibration import stamped
    from profinfer.core.session import profile_process
    levels, counters = _levels(levels), _counters(counters)
    _check_outputs(output, json_path)
    profile = profile_process(pid, levels, duration, tensor_layout=tensor_layout,
                              buffer=buffer, counters=counters, extra_packs=tuple(packs),
                              timeline=output is not None, warn=_warn, note=_note)
    stamped.stamp(profile)     # the roofs and trap costs that judge this run
    if not _emit(profile, output, json_path, quiet):
        sys.exit(1)


@cli.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@probe_options
@output_options
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def record(levels, duration, tensor_layout, buffer, counters, packs, output, json_path, quiet, command):
    """Run COMMAND under the profiler, attached before its first instruction.

    Exits with COMMAND's exit status (128+N if a signal N killed it), as time(1) does."""
    levels, counters = _levels(levels), _counters(counters)
    _check_outputs(output, json_path)
    profile, code = record_command(list(command), levels, duration, tensor_layout,
                                   buffer=buffer, counters=counters, packs=tuple(packs),
                                   timeline=output is not None, warn=_warn, note=_note)
    written = _emit(profile, output, json_path, quiet)
    if code:
        _warn(f"{command[0]} {how_it_ended(code)}")
    sys.exit(shell_status(code) or (0 if written else 1))


@cli.command()
@click.argument("trace", type=click.Path(dir_okay=False))
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Also write the JSON summary.")
@click.option("--html", "html_path", type=click.Path(dir_okay=False),
              help="Also write the report as one self-contained HTML page (charts drawn from the JSON summary).")
@click.option("--requests", "requests_table", is_flag=True, help="Also a table of the slowest requests (llama-server).")
def report(trace, json_path, html_path, requests_table):
    """Operator view of a saved trace (.pftrace written by profinfer)."""
    _check_outputs(None, json_path, html_path)
    if not _emit(load_trace(trace, frozenset({"requests"} if requests_table else ())), None, json_path, False, html_path):
        sys.exit(1)


@cli.command()
@click.argument("before")
@click.argument("after")
@click.option("--fail-above", "gates", multiple=True, metavar="[WHAT=]PCT",
              help="Exit 1 when a quantity is significantly slower by more than PCT: any "
              "phase's time per token or any op, or only WHAT (a row: 'decode', 'MUL_MAT', "
              "'decode layer 3'). Repeatable.")
@click.option("--noise", default="5%", show_default=True, metavar="PCT",
              help="The run-to-run noise floor: a change whose interval reaches inside it is "
              "not called significant.")
@click.option("--confidence", type=FiniteRange(0.5, 0.999), default=0.95, show_default=True)
@click.option("--statistic", type=click.Choice(["median", "mean"]), default="median", show_default=True,
              help="What is compared of each quantity's samples: the median (a stall in a few "
              "calls moves it little) or the mean (tails included).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False),
              help="Write the comparison (schema: docs/analysis.md#diff).")
@click.option("--html", "html_path", type=click.Path(dir_okay=False),
              help="Also write the comparison as one self-contained HTML page (a forest plot per section).")
@click.option("--all", "show_all", is_flag=True, help="Show every quantity, moved or not (in the terminal).")
def diff(before, after, gates, noise, confidence, statistic, json_path, html_path, show_all):
    """Compare two saved traces: per phase, op, layer, node, thread (and kernel, for cuda),
    what changed and with what confidence. BEFORE and AFTER are each a trace, traces joined
    by commas, or a directory of them: several runs a side are pooled, and the spread of
    their means is a noise floor. With --fail-above, exit 0 when every row it judges lies
    wholly below its limit, 1 when one lies wholly above it, 3 when one's interval spans it
    (inconclusive: more runs a side would tell); 2 when the runs cannot be compared (bad
    input included: a gate never fails for want of a run), 74 when --json or --html cannot
    be written."""
    from profinfer import outputs
    from profinfer.exporters import comparison
    from profinfer.viewers import difftable
    from profinfer.viewers.terminal import report_console
    try:
        outputs.check_writable([outputs.Output(option, path, "comparison", suffix, None) for option, path, suffix
                                in (("--json", json_path, ".json"), ("--html", html_path, ".html")) if path])
    except ProfinferError as e:
        raise OutputFailed(str(e)) from None
    try:
        result = compare_sides(before, after, gates, noise, confidence, statistic)
    except ProfinferError as e:
        if e.exit_code == 1:
            raise comparison.IncomparableRuns(str(e)) from None
        raise
    for path, write in ((json_path, comparison.write_json), (html_path, write_diff_html)):
        if path:
            try:
                write(result, path)
            except OSError as e:
                raise OutputFailed(f"cannot write {path}: {e.strerror}") from None
    difftable.render(result, report_console(), show_all)
    if result["gate"] is not None and result["gate"]["exit"]:
        sys.exit(result["gate"]["exit"])


def _check_output(option: str, path: str) -> None:
    """ProfinferError unless `path` can be written (outputs.check_writable)."""
    from profinfer import outputs
    outputs.check_writable([outputs.Output(option, path, "output", "", None)])


def _add_demo(group: click.Group, demos: list) -> None:
    """`profinfer demo`: the plugins' bundled workloads (core.commands.Demo), the first the default."""
    by_name = {d.name: d for d in demos}
    models = [m for d in demos for m in d.models]

    @group.command()
    @click.option("--engine", type=click.Choice(list(by_name)), default=demos[0].name, show_default=True,
                  help="Which bundled workload: " + " or ".join(d.describe for d in demos) + ".")
    @click.option("--model", type=click.Choice(models), default=models[0] if models else None,
                  show_default=True, help=" ".join(d.model_help for d in demos if d.model_help) + ".")
    @click.option("-n", "--tokens", default=32, show_default=True, help="Tokens to generate.")
    @click.option("-t", "--threads", default=2, show_default=True)
    @click.option("--levels", default=",".join(LEVELS), show_default=True)
    @click.option("--counters", metavar="EVENTS", help="perf counters per op, as for record.")
    @output_options
    def demo(engine, model, tokens, threads, levels, counters, output, json_path, quiet):
        """Build (once, cached) and profile a bundled workload (llama.cpp by default)."""
        levels, counters = _levels(levels), _counters(counters)
        output = output or "demo.pftrace"
        _check_outputs(output, json_path)
        cmd, env = by_name[engine].command(model, tokens, threads)
        click.echo(f"profinfer: recording {' '.join(cmd)}", err=True)
        profile, code = record_command(cmd, levels, None, env=env, counters=counters, warn=_warn, note=_note)
        written = _emit(profile, output, json_path, quiet)
        if code:
            _error(f"the workload {how_it_ended(code)}")
        sys.exit(shell_status(code) or (0 if written else 1))


def _add_plugin_commands() -> None:
    """The commands the plugins contribute (core.commands): demo's workloads, their own."""
    from profinfer.core.plugin.commands import Services, commands_modules, demos

    def report_console():
        from profinfer.viewers.terminal import report_console
        return report_console()

    found = demos()
    if found:
        _add_demo(cli, found)
    services = Services(load_trace=load_trace, console=report_console, warn=_warn, note=_note,
                        check_output=_check_output)
    for module in commands_modules():
        add = getattr(module, "add_commands", None)
        if add is not None:
            add(cli, services)


@cli.command(name="calibrate")
@click.option("-t", "--threads", type=click.IntRange(min=1), help="Threads (default: all CPUs).")
@click.option("--force", is_flag=True, help="Measure again even if cached (a measurement that "
              "fails its check does not replace the cached one).")
@click.option("--attempts", type=click.IntRange(min=2), default=4, show_default=True,
              help="Runs to try (two must pass their check) before giving up on a busy or "
              "noisy machine.")
@click.option("-p", "--pid", type=int, help="Instead: what a probe hit costs this running engine, "
              "measured in it (its op level's sites, timed by its steps) and cached for its build: "
              "the profiler-cost line and the daemon's budget then price its hits at that.")
@click.option("--windows", type=click.IntRange(min=3), default=20, show_default=True,
              help="With --pid: windows with the probes (as many without).")
@click.option("--window", "window_s", type=FiniteRange(min=0.2), default=1.5, show_default=True,
              help="With --pid: seconds a window.")
@click.option("--spread-of", "spread_of", metavar="RUNS",
              help="Instead: how much runs of one command vary here, from its recordings (traces joined "
              "by commas, or a directory; at least 6): diff then judges one run a side of that command "
              "with it.")
def calibrate_cmd(threads, force, attempts, pid, windows, window_s, spread_of):
    """Measure this machine's roofs (DRAM and each cache level's read bandwidth, f32 FMA peak) for roofline verdicts,
    and what a uprobe hit costs here (for the profiler-cost line).

    A measurement taken while other processes use the CPUs, or whose repetitions disagree, is
    repeated, and not cached if it never passes: then the exit status is 75 (try again later)."""
    from profinfer import calibrating
    given = {name for name in ("threads", "force", "attempts", "windows", "window_s")
             if click.get_current_context().get_parameter_source(name) is not click.core.ParameterSource.DEFAULT}
    wrong = given & ({"threads", "force", "attempts"} if pid is not None else {"windows", "window_s"})
    if wrong:
        options = ", ".join("--" + ("window" if w == "window_s" else w) for w in sorted(wrong))
        raise click.UsageError(f"{options}: " + ("not with --pid" if pid is not None else "only with --pid"))
    if spread_of is not None:
        if given or pid is not None:
            raise click.UsageError("--spread-of: alone")
        click.echo(calibrating.run_spread(spread_of))
    elif pid is not None:
        click.echo(calibrating.engine_price(pid, windows, window_s, note=_note))
    else:
        calibrating.machine(threads, force, attempts, echo=click.echo, note=_note, error=_error)


@cli.command()
@click.option("--workloads/--no-workloads", default=True, show_default=True,
              help="Record each bundled workload briefly (and attach to the CUDA runtimes found "
              "here) to say how many of its probes the kernel single-steps.")
def doctor(workloads):
    """What works on this machine, and how to fix what doesn't."""
    from profinfer.doctor import run_doctor
    sys.exit(run_doctor(workloads))


@cli.command()
@click.option("--listen", default="127.0.0.1:9464", show_default=True, help="HOST:PORT of the HTTP endpoint.")
@click.option("--allow-remote", is_flag=True, help="Allow a --listen address other than loopback.")
@click.option("--budget", type=FiniteRange(0.0001, 1.0), default=0.04, show_default=True,
              help="Share of the watched processes' CPU time profiling may cost.")
@click.option("--levels", default="token,graph,cuda", show_default=True, help="Always-on levels: token and graph (probes shared per build), op under the budget (per process), cuda where a process maps a CUDA runtime.")
@click.option("--token", envvar=TOKEN_ENV, help="Bearer token for the control endpoints; "
              "prefer the environment variable PROFINFER_TOKEN or --token-file: a command line is "
              "readable by every user (/proc/PID/cmdline). Default: read from, or made in, --token-file.")
@click.option("--token-file", default=client.DEFAULT_TOKEN_FILE, show_default=True, type=click.Path(dir_okay=False))
@click.option("--tls-cert", type=click.Path(exists=True, dir_okay=False),
              help="Serve HTTPS with this PEM certificate (chain): needed where the token crosses a network.")
@click.option("--tls-key", type=click.Path(exists=True, dir_okay=False),
              help="The certificate's PEM private key (default: in --tls-cert's file).")
@click.option("--otlp", metavar="ENDPOINT", help="Also send the metrics by OTLP/HTTP to this collector "
              "(e.g. http://127.0.0.1:4318).")
@click.option("--otlp-interval", type=FiniteRange(0.1, 3600), default=10.0, show_default=True,
              help="Seconds between OTLP exports.")
@click.option("--max-processes", type=click.IntRange(1, 100000), default=64, show_default=True,
              help="Most processes watched at once (and exited ones' series kept); more are counted "
              "in profinfer_processes_dropped_total, not watched.")
@click.option("--max-per-tenant", type=click.IntRange(1, 100000), default=None,
              help="Most processes of one tenant (a pod, else a root of its own, else the host) "
              "watched at once  [default: a quarter of --max-processes]. Where the cap is reached, "
              "a watched process that made no engine call in its first minute gives its place up.")
@click.option("--labels", "labels", type=click.Choice(["full", "no-paths", "minimal"]), default="full",
              show_default=True, help="Which labels /metrics gives anyone who can reach it: full; "
              "no-paths, without the executable and model file paths; minimal, engine and pid "
              "only (no paths, command, container, pod or namespace, no CUDA kernel names).")
@click.option("--allow-host", "allow_hosts", multiple=True, metavar="NAME",
              help="A Host header name to answer besides IP addresses, localhost and this "
              "machine's hostname (e.g. a Service's DNS name; '.example.com' admits its "
              "subdomains). Others are refused (421) against DNS rebinding. Repeatable.")
@click.option("--max-connections", type=click.IntRange(4, 65536), default=256, show_default=True,
              help="Open HTTP connections at most (a quarter of them from one peer address); over "
              "it the oldest of the peer holding the most is closed (each has 10 s to send its request whole).")
@click.option("--trigger", "triggers", multiple=True, metavar="CONDITION",
              help="Flight recorder: capture a process whose own series breaks CONDITION, e.g. "
              "'tpot_p99 > 3x baseline for 5s', 'ttft_p99 > 2s' or 'tps_p10 < 0.5x baseline' "
              "(quantities ttft, tpot, call, sync in s; tps in decode tokens/s; batch in tokens; "
              "a percentile over the last --trigger-window; baseline: the same over the "
              "--trigger-baseline before it). "
              "Repeatable.")
@click.option("--record-for", default="10s", show_default=True, help="How long a triggered capture records.")
@click.option("--keep", type=click.IntRange(1, 10000), default=20, show_default=True,
              help="Triggered captures kept (the oldest go).")
@click.option("--captures-dir", default="/var/lib/profinfer/captures", show_default=True,
              type=click.Path(file_okay=False), help="Where triggered captures are kept (the daemon's own).")
@click.option("--captures-max-bytes", type=click.IntRange(1 << 20), default=1 << 30, show_default=True,
              help="The kept captures' total size at most.")
@click.option("--capture-levels", default="op,sched", show_default=True,
              help="Levels a triggered capture adds to the process's own, as far as the budget allows.")
@click.option("--trigger-cooldown", default="60s", show_default=True,
              help="After a capture, the least time before the same trigger fires again for the process.")
@click.option("--trigger-baseline", default="5m", show_default=True,
              help="The window a trigger's baseline is taken over (before its own window); a process "
              "watched for less has none yet.")
@click.option("--trigger-window", default="10s", show_default=True,
              help="The window a trigger's percentile is taken over (widened where too few samples "
              "could resolve it).")
def daemon(listen, allow_remote, budget, levels, token, token_file, tls_cert, tls_key, otlp, otlp_interval,
           max_processes, max_per_tenant, labels, allow_hosts, max_connections, triggers, record_for, keep, captures_dir,
           captures_max_bytes, capture_levels, trigger_cooldown, trigger_baseline, trigger_window):
    """Run the node agent: watch every inference process, serve Prometheus metrics and traces.

    /status answers without a token only a client on loopback (its address, not the one
    listened on); /capture always needs the token."""
    from profinfer.daemon.run import run_daemon
    from profinfer.core.ebpf.kernel import require_root
    require_root()
    levels = _levels(levels)
    if tls_key and not tls_cert:
        raise click.BadParameter("--tls-key needs --tls-cert", param_hint="--tls-key")
    if token and click.get_current_context().get_parameter_source("token") == click.core.ParameterSource.COMMANDLINE:
        _warn("--token is readable by every user of this machine (/proc/PID/cmdline, ps): "
              f"give it in the environment ({TOKEN_ENV}) or in --token-file")
    sys.exit(run_daemon(listen, budget, levels, token, token_file, allow_remote, otlp, otlp_interval,
                        tls_cert=tls_cert, tls_key=tls_key, max_processes=max_processes,
                        max_per_tenant=max_per_tenant,
                        labels=labels, allow_hosts=allow_hosts, max_connections=max_connections,
                        flight=dict(triggers=list(triggers), record_for=record_for, keep=keep,
                                    captures_dir=captures_dir, max_bytes=captures_max_bytes,
                                    levels=_levels(capture_levels, "--capture-levels"), cooldown=trigger_cooldown,
                                    baseline=trigger_baseline, window=trigger_window)
                        if triggers else None))


def client_options(f):
    """How `status` and `capture` reach a daemon: its URL, the token, TLS."""
    f = click.option("--insecure-http", is_flag=True, help="Send the token over plain HTTP to a "
                     "host other than loopback (readable by anyone on the path).")(f)
    f = click.option("--cacert", type=click.Path(exists=True, dir_okay=False),
                     help="Trust this PEM CA certificate for an https:// URL (default: the system's).")(f)
    f = click.option("--token-file", default=client.DEFAULT_TOKEN_FILE, show_default=True,
                     type=click.Path(dir_okay=False), help=f"The control token (or {TOKEN_ENV}).")(f)
    f = click.option("--url", default=client.DEFAULT_URL, show_default=True)(f)
    return f


@cli.command()
@client_options
@click.option("--json", "as_json", is_flag=True, help="Print the daemon's JSON as is.")
def status(url, token_file, cacert, insecure_http, as_json):
    """What the daemon watches, at which levels, and what it costs."""
    client.show_status(url, token_file, cacert, insecure_http, as_json)


@cli.command()
@click.option("-p", "--pid", type=int, required=True)
@click.option("--seconds", type=FiniteRange(MIN_DURATION_S, 300), default=10, show_default=True)
@click.option("--levels", default="token,graph,op", show_default=True)
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False))
@click.option("--force", is_flag=True, help="Capture even where it takes the process over the daemon's "
              "budget (the daemon logs it).")
@client_options
def capture(pid, seconds, levels, output, force, url, token_file, cacert, insecure_http):
    """Ask the daemon for a Perfetto trace of one process. The token goes to whatever listens
    at --url: on loopback, make sure that is the daemon."""
    from urllib.parse import urlencode
    _check_output("-o", output)
    token = client.token(token_file, required=True)
    data = client.request("POST", url.rstrip("/") + "/capture?" + urlencode(
        {"pid": pid, "seconds": seconds, "levels": levels, **({"force": 1} if force else {})}), token,
        timeout=seconds + 120,
        cacert=cacert, insecure_http=insecure_http)
    try:
        with open(output, "wb") as f:
            f.write(data)
    except OSError as e:
        raise ProfinferError(f"cannot write -o {output}: {e.strerror}") from None
    _note(f"wrote {output} ({len(data):,} bytes)")


try:
    _add_plugin_commands()
    _PLUGIN_ERROR: ProfinferError | None = None
except ProfinferError as e:          # a plugin that cannot be loaded: said by main()
    _PLUGIN_ERROR = e


def main(argv: list[str] | None = None) -> None:
    try:
        if _PLUGIN_ERROR is not None:
            raise _PLUGIN_ERROR
        cli.main(args=argv, prog_name="profinfer", standalone_mode=False)
    except click.exceptions.Abort:
        sys.exit(130)
    except click.UsageError as e:
        _error(e.format_message())
        sys.exit(2)
    except click.ClickException as e:
        _error(e.format_message())
        sys.exit(e.exit_code)
    except ProfinferError as e:
        _error(str(e))
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        sys.exit(130)
    except BrokenPipeError:
        sys.exit(1)


if __name__ == "__main__":
    main()
