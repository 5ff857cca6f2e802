"""`profinfer daemon`: the agent loop in the main thread, the HTTP endpoint in its own."""
from __future__ import annotations

import os
import signal
import sys
import threading
import time

from profinfer.core.base.errors import ProfinferError
from profinfer.daemon.agent import Agent
from profinfer.daemon.flight.captures import Captures
from profinfer.daemon.discovery.identity import printable
from profinfer.daemon.export.metrics import LABEL_SETS
from profinfer.daemon.http.server import MAX_CONNECTIONS, is_loopback, make_server, parse_listen
from profinfer.daemon.http.tls import server_context as tls_context
from profinfer.daemon.http.tokens import TOKEN_ENV, load_token

# A loop that fails every turn for this long ends the daemon (its exit says why, and a service
# manager or the kubelet starts it again): /healthz would otherwise say healthy over a loop
# that does nothing
LOOP_FAILING_MAX_S = 60.0


def log(msg: str) -> None:
    # one line each, whatever names a process chose (its comm, its paths) are in it
    print(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} profinfer daemon: {printable(msg)}", file=sys.stderr, flush=True)


def flight_settings(triggers: list[str], record_for: str, keep: int, captures_dir: str, max_bytes: int,
                    levels: set[str], cooldown: str, baseline: str, window: str = "10s") -> dict:
    """The flight recorder's settings, checked (ProfinferError: one line) before anything starts."""
    from profinfer.daemon.flight.captures import MAX_CAPTURE_S
    from profinfer.daemon.flight.triggers import parse_duration, parse_trigger
    seconds = parse_duration(record_for, "--record-for")
    if not 0.01 <= seconds <= MAX_CAPTURE_S:
        raise ProfinferError(f"--record-for {record_for!r}: from 10 ms to {MAX_CAPTURE_S} s")
    return {"triggers": [parse_trigger(t) for t in triggers], "record_for_s": seconds, "keep": keep,
            "captures_dir": captures_dir, "max_bytes": max_bytes, "levels": set(levels),
            "cooldown_s": parse_duration(cooldown, "--trigger-cooldown"),
            "baseline_s": parse_duration(baseline, "--trigger-baseline"),
            "window_s": parse_duration(window, "--trigger-window")}


def make_recorder(agent: Agent, captures: Captures, settings: dict):
    from profinfer.daemon.flight.capturestore import CaptureStore
    from profinfer.daemon.flight.recorder import FlightRecorder
    store = CaptureStore(settings["captures_dir"], settings["keep"], settings["max_bytes"])
    return FlightRecorder(agent, captures, store, settings["triggers"], settings["record_for_s"],
                          settings["levels"], settings["cooldown_s"], settings["baseline_s"], settings["window_s"])


def run_daemon(listen: str, budget: float, levels: set[str], token: str | None, token_file: str,
               allow_remote: bool, otlp: str | None = None, otlp_interval_s: float = 10.0,
               tls_cert: str | None = None, tls_key: str | None = None, max_processes: int = 64,
               max_per_tenant: int | None = None,
               labels: str = "full", allow_hosts: tuple[str, ...] = (),
               max_connections: int = MAX_CONNECTIONS, flight: dict | None = None) -> int:
    """flight: the flight recorder's options as given (flight_settings), with --trigger."""
    host, port = parse_listen(listen)
    recording = flight_settings(**flight) if flight else None
    if not is_loopback(host) and not allow_remote:
        raise ProfinferError(f"--listen {listen}: not a loopback address; pass --allow-remote to "
                             "serve other machines (metrics are readable without a token)")
    if labels not in LABEL_SETS:
        raise ProfinferError(f"--labels {labels!r}: choose from {', '.join(LABEL_SETS)}")
    os.environ.pop(TOKEN_ENV, None)          # nothing the daemon starts inherits it
    if not token and os.path.dirname(token_file):
        os.makedirs(os.path.dirname(token_file), mode=0o700, exist_ok=True)
    secret = load_token(token, token_file, warn=log)
    tls = tls_context(tls_cert, tls_key) if tls_cert else None
    if tls is None and not is_loopback(host):
        log("warning: serving beyond loopback over plain HTTP: the token crosses the network in "
            "clear; give --tls-cert and --tls-key")
    agent = Agent(levels, budget, log=log, max_processes=max_processes, max_per_tenant=max_per_tenant)
    agent.metrics.label_set = labels
    captures = Captures(agent, log)
    # a capture's probes (at their price), or one being priced and started (the flight recorder's)
    agent.governor.capture_cost = lambda pid: captures.running.get(pid, 0.0 if (
        agent.recorder is not None and pid in agent.recorder.starting) else None)
    try:
        if recording:
            agent.recorder = make_recorder(agent, captures, recording)
        server = make_server(agent, host, port, secret, log, allow_hosts, max_connections, ssl_context=tls,
                             captures=captures)
    except OSError as e:
        agent.close()
        raise ProfinferError(f"cannot listen on {listen}: {e.strerror}") from None
    except ProfinferError:
        agent.close()
        raise
    if otlp:
        from profinfer.daemon.export.otlp import OtlpExport
        agent.metrics.otlp = OtlpExport(otlp, otlp_interval_s)
        log(f"exporting OTLP metrics to {agent.metrics.otlp.endpoint} every {otlp_interval_s:g} s"
            + (", and the flight recorder's captures as OTLP events (/v1/logs)" if recording else ""))
    stop = threading.Event()

    def on_signal(signum, _frame):
        stop.set()

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    # the loop shares the interpreter with the HTTP threads: after each read of /proc or of a
    # library (each lets the GIL go) it waits for a busy thread to hand it back; a short turn
    # keeps a scrape's generation from slowing a scan down (bench/results.md)
    sys.setswitchinterval(0.0005)
    try:
        agent.poll(0)     # the first scan (and each loader hooked) before /healthz says ready
        server.start()
        agent.metrics.self_metrics(agent)           # says whether GPU metrics are on, and if not why
        log("new processes found " + ("from the kernel (exec and the loader's hook), and by a scan "
                                      "of /proc each second" if agent.discovery is not None else
                                      f"by a scan of /proc each second (discovery from the kernel is off: "
                                      f"{agent.discovery_off})"))
        if agent.recorder is not None:
            log(f"flight recorder: {'; '.join(t.text for t in agent.recorder.triggers.triggers)}: "
                f"{agent.recorder.record_for_s:g} s captures kept in {agent.recorder.store.dir} "
                f"(the last {agent.recorder.store.keep}, {agent.recorder.store.max_bytes:,} bytes at most)")
        log(f"listening on {'https' if tls else 'http'}://{host}:{port} (metrics, {labels} labels; control endpoints need the token"
            + ("" if token else f" in {token_file}") + f"); levels {','.join(sorted(agent.levels))}")
        run_loop(agent, stop, log)
    finally:
        agent.release_held()        # first: no process stays stopped on a slow close below
        server.close()
        agent.close()
        if agent.metrics.otlp is not None:
            agent.metrics.otlp.close()
        for s, h in old.items():
            signal.signal(s, h)
        log("stopped: every probe detached")
    return 0


def run_loop(agent: Agent, stop: threading.Event, log) -> None:
    """The agent's loop until `stop`: a fault of one turn is counted, said once, and the node
    stays watched; one in every turn for LOOP_FAILING_MAX_S ends it (ProfinferError)."""
    said: set[str] = set()
    failing_since = None
    while not stop.is_set():
        try:
            agent.poll(0.2)
            failing_since = None
        except Exception as e:
            agent.loop_errors += 1
            what = f"{type(e).__name__}: {e}"
            if what not in said and len(said) < 100:
                said.add(what)
                log(f"error in the agent's loop (the loop goes on): {what}")
            failing_since = failing_since or time.monotonic()
            if time.monotonic() - failing_since > LOOP_FAILING_MAX_S:
                raise ProfinferError(f"the agent's loop failed every turn for {LOOP_FAILING_MAX_S:g} s: {what}")
            stop.wait(0.2)          # a fault that repeats does not spin
