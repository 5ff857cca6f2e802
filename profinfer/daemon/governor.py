"""The overhead budget: what each watched process's probes cost it, at every level, and its
dearest levels taken away or given back to keep that under the budget.

Each process's cost, checked every GOVERN_S: its own op-level probes', its share of its
build's shared probes (token or step, graph) and of the shared cuda level (each shared
object's cost shared out by the probe hits each process made: shared.Charges), priced in one
place (selfcost.added_ns: kernel-counted BPF time + probe hits x trap costs), plus its share
of the CPU of the daemon's thread that watches; over its own CPU time. Over the budget, the
dearest level it has goes (STEP_DOWN_ORDER: op, the cuda level's per-call detail, graph);
the token or step level is the floor, its own cost reported. A level comes back, the last
taken first, after waits.STEP_UP_S with room (under half the budget, or the process idle) and no
capture of it running, waiting twice as long each time a step up went over again. A running
capture's price (capture_price) counts against the budget beside the process's own cost.

Trap costs: the cached calibration (`profinfer calibrate`); with none (the image's empty
cache), measured at start (probecost.measure_quick, under a second); if that fails, none:
the kernel-counted BPF time alone, and /status says why.
"""
from __future__ import annotations

import os
import time
from typing import Callable

from profinfer.core.ebpf import libbpf
from profinfer.core.calibration import probecost
from profinfer.core.calibration.hits import TRAP_KEYS
from profinfer.core.target import procfs
from profinfer.core.target.procfs import stat_fields
from profinfer.core.calibration.selfcost import added_ns
from profinfer.daemon.watch import Watch

GOVERN_S = 2.0
# dearest first: the op level (a trap on every node), the cuda level's per-call detail (per
# kernel, grid, stream and op: the cuda level keeps its counts by function), the graph level
STEP_DOWN_ORDER = ("op", "cuda-detail", "graph")
FLOOR_LEVELS = ("token", "step")
# levels whose probes trap in the threads that make the engine's calls (Watch.callers): each
# is charged against those threads' time, not the whole process's (vLLM's OpenMP pool spins);
# the op level too where the engine's plugin says its ops are called there (ops_on_callers)
CALLER_LEVELS = ("token", "step", "graph")
LEVEL_RANK = {"op": 3, "graph": 2, "token": 1, "step": 1}
MIN_CPU_TO_JUDGE_NS = 50_000_000
# a process that did next to nothing for this long (Governor._quiet: under MIN_CPU_TO_JUDGE_NS
# of CPU, or no decode call or step with its calling threads near still) is idle, and stays
# so while each check finds it so: nothing of its engine's time is being taken, so there is
# room (its levels may come back)
IDLE_S = 3 * GOVERN_S
MAX_STEP_UP_WAIT_S = 600.0
# An unattended capture's sched level, priced before it runs (sched_share): what it adds an
# event (a switch or wakeup record: the raw tracepoints' programs, the ring, the capture's
# collector reading it), as the capture's own accounting states it (bench/sched_price.py;
# bench/results.md, "A capture's sched level priced"). Each context switch of the process's
# threads counted over SCHED_SAMPLE_S is priced at the most events it makes: a voluntary
# one three (out, the wakeup, back in), another two
SCHED_EVENT_NS = 1850.0
SCHED_SAMPLE_S = 0.25
MAX_THREADS_READ = 4096


def context_switches(pid: int) -> dict[int, tuple[int, int]] | None:
    """Each of the process's threads' context switches so far, (voluntary, not), from its
    status (the process's own status counts its main thread's alone). Its first
    MAX_THREADS_READ threads: the thread count is the tenant's to choose."""
    counts = {}
    try:
        tids = procfs.first_entries(f"/proc/{pid}/task", MAX_THREADS_READ)
    except OSError:
        return None
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                fields = dict(line.split(":", 1) for line in f if "ctxt_switches:" in line)
            counts[int(tid)] = (int(fields["voluntary_ctxt_switches"]), int(fields["nonvoluntary_ctxt_switches"]))
        except (OSError, ValueError, KeyError):
            continue            # a thread gone meanwhile
    return counts


def level_rank(levels: set[str]) -> int:
    return max((LEVEL_RANK.get(lv, 0) for lv in levels), default=0)


def can_have(w: Watch, level: str) -> bool:
    """Whether the level may be given to the process: its engine offers it (op totals; the
    graph level is llama.cpp's, not an engine's that works in steps), or it has a runtime."""
    if level == "op":
        return "op_totals" in w.capabilities
    if level == "graph":
        return w.group is not None and "graph_totals" in w.capabilities
    if level == "cuda-detail":
        return w.cuda
    return True


def trap_costs() -> tuple[dict[str, float], str]:
    """The trap costs the governor prices hits at, and where they come from."""
    cached = probecost.cached()
    if cached:
        return {k: float(cached[k]) for k in TRAP_KEYS}, f"cached calibration ({cached.get('measured_at', '?')})"
    costs, how = probecost.measure_quick()
    if costs is not None:
        return {k: float(costs[k]) for k in TRAP_KEYS}, f"measured at start: {how}"
    return dict.fromkeys(TRAP_KEYS, 0.0), f"none: no calibration cached, and measuring at start failed: {how}"


class Governor:
    """Judges each watch's cost share every GOVERN_S and asks `relevel(watch, levels, why)`
    (True when done) to step its dearest level down, or the last one taken back up."""

    def __init__(self, budget: float, metrics, relevel: Callable[[Watch, set[str], str], bool]):
        self.budget = budget
        self.metrics = metrics
        self.relevel = relevel
        # the kernel's BPF run-time counts (run time, and runs: the probe hits), on while
        # this fd is open; refused, the op level cannot be governed
        self.stats_fd = libbpf.enable_run_time_stats()
        self.ticks = os.sysconf("SC_CLK_TCK")
        self.last = 0.0
        # a probe hit's trap by kind; without any, the kernel-counted BPF time alone
        self.trap_costs, self.trap_costs_source = trap_costs()
        self.traps_calibrated = any(self.trap_costs.values())
        self.loop_tid: int | None = None      # the thread running the agent's loop: the one that watches
        self.setup_cpu_ns = 0                 # of its CPU, what attaching and detaching took
        # a capture of the process (PID) running, its own probes beside the daemon's: what it
        # was priced at (capture_price; 0.0 while it is priced and started), None where none runs
        self.capture_cost: Callable[[int], float | None] = lambda pid: None

    @property
    def stats_on(self) -> bool:
        return self.stats_fd >= 0

    def close(self) -> None:
        if self.stats_fd >= 0:
            os.close(self.stats_fd)
            self.stats_fd = -1

    def cpu_ns(self, pid: int, tid: int | None = None) -> int | None:
        """A process's CPU time (utime + stime), or one of its threads' (tid)."""
        fields = stat_fields(pid if tid is None else f"{pid}/task/{tid}")
        if fields is None or len(fields) < 13:
            return None
        return (int(fields[11]) + int(fields[12])) * 1_000_000_000 // self.ticks

    def callers_cpu_ns(self, w: Watch) -> int | None:
        """The CPU time of the threads that make the process's engine calls (None: none
        seen yet, or none readable)."""
        times = [self.cpu_ns(w.identity.pid, t) for t in w.callers]
        times = [t for t in times if t is not None]
        return sum(times) if times else None

    def watching_cpu_ns(self) -> int:
        """The CPU of the daemon's thread that watches: the loop, where every probe's events are
        drained, every process looked at and every BPF object loaded. Not the HTTP threads'
        (a flood of scrapes is no watched process's cost), nor NVML's or OTLP's; the discovery
        watchdog's is left out too (it sleeps but to continue a process held too long); and so
        is the loop's set-up (attaching and detaching probes: once per change)."""
        if self.loop_tid is None:
            return 0
        return (self.cpu_ns(os.getpid(), self.loop_tid) or 0) - self.setup_cpu_ns

    def cost_ns(self, coll) -> float | None:
        """What a collector's probes cost so far (selfcost.added_ns)."""
        try:
            c = coll.cost_counts()
        except Exception:
            return None
        return added_ns(c, self.trap_costs) if c else None

    def probe_costs_ns(self, w: Watch, runtime) -> dict[str, float] | None:
        """What the process's probes cost it so far, by level: its own op level's, and its
        charged shares of its build's shared probes and of the cuda level."""
        if w.group is None and not w.cuda:
            return None
        parts: dict[str, float] = {}
        if w.collector is not None:
            own = self.cost_ns(w.collector)
            if own is None:
                return None
            parts["op"] = own
        if w.group is not None:
            parts.update(w.group.charges.of(w.identity.pid))
        if w.cuda and runtime is not None:
            parts.update(runtime.charges.of(w.identity.pid))
        return parts

    def due(self) -> bool:
        if time.monotonic() - self.last < GOVERN_S:
            return False
        self.last = time.monotonic()
        return True

    def govern(self, groups: list, runtime, watches: list[Watch], levels: set[str]) -> None:
        """Charge the shared probes' cost to their processes, then judge each process
        (`levels`: the daemon's, the most a process is given back)."""
        now = time.monotonic()
        for shared in groups + ([runtime] if runtime is not None else []):
            cost = self.cost_ns(shared.collector)
            if cost is not None:
                shared.charge(cost)
        own = self.watching_cpu_ns()
        for w in watches:
            cpu = self.cpu_ns(w.identity.pid)
            parts = self.probe_costs_ns(w, runtime)
            if cpu is None or parts is None:
                continue
            mark, calls, callers = w.cost_mark, engine_calls(w), self.callers_cpu_ns(w)
            if mark is not None and self._quiet(w, mark, now, cpu, calls, callers):
                # idle for IDLE_S, then judged idle at each check while it stays so: its wait
                # to get a level back counts in checks, not in IDLE_S windows
                if w.idle or now - mark[0] >= IDLE_S:
                    w.cost_mark, w.idle = (now, cpu, parts, own, callers, calls), True
                    self._judge(w, now, levels, 0.0)
                continue
            if mark is not None and cpu - mark[1] < MIN_CPU_TO_JUDGE_NS:   # too little CPU yet to judge
                continue
            w.cost_mark = (now, cpu, parts, own, callers, calls)
            if mark is None:
                continue
            # the watching thread's CPU, shared out among the processes it watches: on a busy
            # machine it is taken from them
            spent = cpu - mark[1]
            # the floor's and the graph level's probes against their callers' time, where known
            by_callers = callers - mark[4] if callers is not None and mark[4] is not None else 0
            if by_callers < MIN_CPU_TO_JUDGE_NS / 2:
                by_callers = spent
            on_callers = CALLER_LEVELS + (("op",) if "ops_on_callers" in w.capabilities else ())
            shares = {lv: max(0.0, ns - mark[2].get(lv, 0.0)) / (by_callers if lv in on_callers else spent)
                      for lv, ns in parts.items()}
            shares["daemon"] = max(0.0, (own - mark[3]) / max(len(watches), 1) / spent)
            w.shares, w.idle = shares, False
            w.share = sum(shares.values())
            w.known_shares.update(shares)
            self.metrics.cost(w.identity, w.share, shares)
            self._judge(w, now, levels, w.share)

    @staticmethod
    def _quiet(w: Watch, mark: tuple, now: float, cpu: int, calls: int | None, callers: int | None) -> bool:
        """Whether the process did next to nothing since the mark: under MIN_CPU_TO_JUDGE_NS
        each IDLE_S of CPU (a rate: the same whether judged each check or over IDLE_S), or
        no decode call or step while the threads that make them used under half that (its
        engine waits; a background thread's CPU is no work of its that the probes slow; a
        call under way for seconds still uses its caller's CPU)."""
        elapsed = max(now - mark[0], 1e-9)
        if cpu - mark[1] < MIN_CPU_TO_JUDGE_NS * min(1.0, elapsed / IDLE_S):
            return True
        if calls is None or calls != mark[5] or not w.callers or callers is None or mark[4] is None:
            return False
        return callers - mark[4] < MIN_CPU_TO_JUDGE_NS / 2 * min(1.0, elapsed / IDLE_S)

    def capture_fits(self, w: Watch, levels: set[str], priced: dict[str, float] | None = None) -> tuple[bool, str]:
        """Whether a capture at `levels` (a full attach of its own, beside the daemon's probes)
        keeps the process under the budget: its cost now plus what each of those levels cost
        it when it last had it here, or `priced` (capture_prices); a level priced by neither
        counts nothing, and is named; and why."""
        # copies: the loop's judgments change them meanwhile (a flight recorder's capture is
        # priced in a thread of its own)
        share, has, shares = w.share, set(w.levels), dict(w.known_shares)
        # not judged yet at the levels it has now (just changed): what they cost when it last had them
        now = share if share is not None else sum(v for lv, v in shares.items() if lv in has or lv == "daemon")
        extra = self._capture_levels(shares, levels, priced)
        total = now + sum(extra.values())
        said = ", ".join(f"{lv} {v:.2%}" for lv, v in extra.items()) or "no level measured on it yet"
        unknown = sorted(set(levels) - set(extra))
        why = (f"PID {w.identity.pid} costs {now:.2%} now; a capture at {','.join(sorted(levels))} adds "
               f"about {total - now:.2%} ({said}, as measured on it here"
               + (f"; {', '.join(sorted(priced))} estimated" if priced else "")
               + (f"; {', '.join(unknown)} never measured on it, not counted" if unknown else "")
               + f"): {total:.2%} {'>' if total > self.budget else '<='} budget {self.budget:.2%}")
        return total <= self.budget, why

    @staticmethod
    def _capture_levels(shares: dict[str, float], levels: set[str], priced: dict[str, float] | None) -> dict[str, float]:
        """What each of a capture's levels cost the process when it last had them (shares), or
        as priced (a level known by neither is left out)."""
        known = {**shares, **(priced or {})}
        return {lv: known[lv] for lv in sorted(levels) if lv in known}

    def capture_price(self, w: Watch, levels: set[str], priced: dict[str, float] | None = None) -> float:
        """What a capture at `levels` adds to the process's cost, as capture_fits prices it:
        counted against the budget while it runs (_judge)."""
        return sum(self._capture_levels(dict(w.known_shares), levels, priced).values())

    def capture_prices(self, w: Watch, levels: set[str]) -> tuple[dict[str, float], dict[str, str]]:
        """For an unattended capture: the levels the daemon never measured on the process,
        priced where it can be done without them (the sched level: sched_share, which sleeps
        SCHED_SAMPLE_S), and those that cannot be (why)."""
        priced, unpriced = {}, {}
        for lv in sorted(set(levels) - set(dict(w.known_shares))):
            if lv == "sched":
                share = self.sched_share(w.identity.pid)
                if share is not None:
                    priced[lv] = share
                    continue
                unpriced[lv] = f"PID {w.identity.pid}'s threads could not be read"
            else:
                unpriced[lv] = (f"its cost on PID {w.identity.pid} was never measured here (a level the "
                                f"daemon runs, --levels, is measured, and stepped down where it costs too much)")
        return priced, unpriced

    def sched_share(self, pid: int) -> float | None:
        """The sched level's estimated cost: the process's threads' context switches (each
        thread's since the first reading; a new one's whole count), as events at
        SCHED_EVENT_NS, against its CPU time meanwhile, or a tenth of a CPU for a process
        that barely ran (a stall: when the sched level is wanted most); None where its
        threads cannot be read."""
        before, cpu0, t0 = context_switches(pid), self.cpu_ns(pid), time.monotonic()
        time.sleep(SCHED_SAMPLE_S)
        after, cpu1, t1 = context_switches(pid), self.cpu_ns(pid), time.monotonic()
        if before is None or after is None or cpu0 is None or cpu1 is None:
            return None
        events = 0
        for tid, (voluntary, other) in after.items():
            v0, o0 = before.get(tid, (0, 0))
            events += 3 * max(0, voluntary - v0) + 2 * max(0, other - o0)
        against = max(cpu1 - cpu0, 0.1 * (t1 - t0) * 1e9, 1.0)
        return events * SCHED_EVENT_NS / against

    def _judge(self, w: Watch, now: float, levels: set[str], share: float) -> None:
        lower = next((lv for lv in STEP_DOWN_ORDER if lv in w.levels), None)
        # a capture's probes cost the process beside the daemon's (an idle process's, nothing):
        # the daemon's own levels make room for it
        capture = self.capture_cost(w.identity.pid)
        charged = capture if capture and not w.idle else 0.0
        if share + charged > self.budget:
            w.calm_since = None
            why = f"costs {share:.1%}" + (f" and its capture {charged:.1%}" if charged else "")
            if lower is not None and self.relevel(w, w.levels - {lower}, f"{why} > budget {self.budget:.1%}"):
                if w.stepped_up:          # the level it went back up to did not fit
                    w.step_up_wait_s = min(w.step_up_wait_s * 2, MAX_STEP_UP_WAIT_S)
                w.stepped_up = False
        elif capture is not None:
            w.calm_since = None       # a capture's probes take the room: nothing comes back meanwhile
        elif share <= self.budget / 2:
            w.calm_since = now if w.calm_since is None else w.calm_since
            missing = [lv for lv in reversed(STEP_DOWN_ORDER)
                       if _daemon_has(levels, lv) and lv not in w.levels and can_have(w, lv)]
            room = "idle" if w.idle else f"costs {share:.1%}, room under {self.budget:.1%}"
            if missing and now - w.calm_since >= w.step_up_wait_s and self.relevel(
                    w, w.levels | {missing[0]}, room):
                w.stepped_up, w.calm_since = True, None
        else:
            w.calm_since = None


def engine_calls(w: Watch) -> int | None:
    """The decode calls or steps its build's shared probes have seen it make (None: no
    engine's, a process watched at the cuda level alone)."""
    return None if w.group is None else w.group.token_calls.get(w.identity.pid, 0)


def _daemon_has(levels: set[str], level: str) -> bool:
    """The cuda level's detail comes with the cuda level."""
    return ("cuda" if level == "cuda-detail" else level) in levels
