"""The flight recorder: a watched process whose own series breaks a trigger (flight.py) is
captured at once, for `record_for` seconds, at the levels the budget allows (the governor's
capture_prices and capture_fits: a level it cannot price is not run unattended; what it left
out, and why, is written into the capture), and the capture is kept
(capturestore.py) with what fired it: the trigger, its value, its limit and baseline, the
quantity's series before the firing and during the capture, and the process's own counts
(baseline.py) in the baseline before the incident and in the incident up to the firing (not
the capture: its own probes would be in them). That record also goes into
the trace (meta.flight), so that `profinfer report` of the trace alone sets one against the
other."""
from __future__ import annotations

import json
import threading
import time

from profinfer.core.profile.model import TokenCall
from profinfer.daemon.flight.baseline import MIN_GAP_S, RollingTotals
from profinfer.daemon.flight.captures import CAPTURE_LEVELS, BadRequest, Captures
from profinfer.daemon.flight.capturestore import CaptureStore
from profinfer.daemon.flight.triggers import Firing, Trigger, Triggers, in_unit
from profinfer.daemon.discovery.identity import Identity
from profinfer.exporters.perfetto import with_meta

# levels a capture may go without when the budget cannot hold them all (the dearest first)
DROPPABLE = ("sched", "op", "graph")


class FlightRecorder:
    def __init__(self, agent, captures: Captures, store: CaptureStore, triggers: list[Trigger],
                 record_for_s: float, levels: set[str], cooldown_s: float, baseline_s: float, window_s: float):
        self.agent = agent
        self.captures = captures
        self.store = store
        self.record_for_s = record_for_s
        self.levels = set(levels)
        self.triggers = Triggers(triggers, self._fire, cooldown_s, baseline_s, self._pending, window_s)
        self.baseline_s = baseline_s
        self.window_s = window_s
        hold = max((t.hold_s for t in triggers), default=0.0)
        # a baseline held from before an earlier incident: the incident (under a baseline
        # window, or it shifted), the cooldown and a quarter window before a new one is whole
        self.totals = RollingTotals(2 * baseline_s + cooldown_s + window_s + hold)
        self.failed = 0
        # firings refused for want of a place (each tried again while its condition holds),
        # counted; said once per (pid, start, trigger) until it captures or fails
        self.deferred = 0
        self.deferred_said: set[tuple] = set()
        # a level's last cumulative (calls, ns) of each quantity, by (pid, start)
        self.cumulative_seen: dict[tuple, dict[str, tuple[int, int]]] = {}
        self.lock = threading.Lock()
        self.starting: set[int] = set()       # PIDs whose capture is being priced and started

    # ---- fed by the agent's loop ----

    def observe(self, ident: Identity, t: TokenCall, ttfts: list[int], tpots: list[tuple[float, int]],
                timed: bool = True) -> None:
        key, now = (ident.pid, ident.start), time.monotonic()
        if ttfts:
            self.triggers.observe(key, "ttft", now, [v / 1e9 for v in ttfts])
        if tpots:
            self.triggers.observe(key, "tpot", now, [v / 1e9 for v, _ in tpots])
        if timed:
            self.triggers.observe(key, "call", now, [t.dur_ns / 1e9])
            self.triggers.observe(key, "batch", now, [float(t.n_tokens)])
            if t.decode_tokens and t.dur_ns > 0:
                self.triggers.observe(key, "tps", now, [t.decode_tokens * 1e9 / t.dur_ns])

    def observe_cumulative(self, ident: Identity, quantity: str, count: int, total_ns: int) -> None:
        """A level's cumulative calls and time of a trigger quantity for the process (the
        cuda level's syncs): the mean time of those made since the last read is one sample."""
        key = (ident.pid, ident.start)
        seen = self.cumulative_seen.setdefault(key, {})
        before = seen.get(quantity)
        seen[quantity] = (count, total_ns)
        if before is not None and count > before[0] and total_ns >= before[1]:
            self.triggers.observe(key, quantity, time.monotonic(), [(total_ns - before[1]) / 1e9 / (count - before[0])])

    def judge(self) -> None:
        now = time.monotonic()
        if self.totals.due(now):
            with self.agent.lock:
                idents = [w.identity for w in self.agent.watches.values()]
            for ident in idents:
                self._sample(ident, now)
        self.triggers.judge(now)

    def forget(self, ident: Identity) -> None:
        self.triggers.forget((ident.pid, ident.start))
        self.cumulative_seen.pop((ident.pid, ident.start), None)
        self.totals.forget((ident.pid, ident.start))
        with self.lock:
            self.deferred_said = {k for k in self.deferred_said if k[:2] != (ident.pid, ident.start)}

    # ---- a firing ----

    def _fire(self, key: tuple, firing: Firing) -> None:
        with self.agent.lock:
            w = self.agent.watches.get(key[0])
        if w is None or w.identity.start != key[1]:
            return
        if w.identity.pid in self.captures.running:      # another trigger's, of the same incident
            self.agent.log(f"PID {w.identity.pid}: {firing.trigger.text} fired during its running capture")
            return
        counts = self._counts(w, firing)
        with self.lock:
            if w.identity.pid in self.starting:
                self.agent.log(f"PID {w.identity.pid}: {firing.trigger.text} fired as its capture starts")
                return
            self.starting.add(w.identity.pid)
        # priced and started in a thread of its own: pricing the sched level takes a while
        threading.Thread(target=self._capture, args=(w, firing, counts), name="profinfer-flight", daemon=True).start()

    def _counts(self, w, firing: Firing) -> dict:
        """The process's own counts (taken now, before the capture adds its probes): over the
        baseline window before the incident (the trigger's: from its re-arm at the earliest;
        for an absolute limit, the window before the condition began to hold), and over the
        incident from when the condition began to hold (a sample is taken then) to now (a
        sample taken now, however soon after; a hold under MIN_GAP_S reaches back to the
        sample before that)."""
        key, now = (w.identity.pid, w.identity.start), time.monotonic()
        began = firing.began if firing.began is not None else firing.at - firing.trigger.hold_s
        until = firing.baseline_until if firing.baseline_until is not None else began - firing.window_s
        try:
            self._sample(w.identity, now, force=True)
            start = self.totals.last_at_or_before(key, min(began, now - MIN_GAP_S))
            return {"baseline": self.totals.between(key, max(until - self.baseline_s, firing.baseline_from), until),
                    "incident": None if start is None else self.totals.between(key, start, now)}
        except Exception as e:          # the capture goes on without them
            self.agent.log(f"PID {w.identity.pid}: the flight recorder's counts: {type(e).__name__}: {e}")
            return {"baseline": None, "incident": None}

    def _pending(self, key: tuple) -> None:
        """A condition began to hold for the process: its counts now begin the incident's."""
        with self.agent.lock:
            w = self.agent.watches.get(key[0])
            ident = w.identity if w is not None and w.identity.start == key[1] else None
        if ident is not None:
            self._sample(ident, time.monotonic())

    def _sample(self, ident: Identity, now: float, force: bool = False) -> None:
        counts = self.agent.metrics.totals(ident)
        if counts is not None:
            with self.agent.lock:
                w = self.agent.watches.get(ident.pid)
                levels = sorted(w.levels) if w is not None else []
            self.totals.sample((ident.pid, ident.start), now, counts, levels, force)

    @staticmethod
    def _own(w) -> set[str]:
        """The process's levels as a capture takes them (the daemon's cuda-detail is the cuda
        level's timeline)."""
        return {"cuda" if lv == "cuda-detail" else lv for lv in w.levels} & CAPTURE_LEVELS

    def _asked(self, w) -> set[str]:
        """The process's levels and the capture's."""
        return self._own(w) | (self.levels & CAPTURE_LEVELS)

    def _affordable(self, w, asked: set[str]) -> tuple[set[str], dict[str, str], float]:
        """The levels asked for, less those the budget cannot price (a level the process does
        not have, never measured on it) or hold (of DROPPABLE, the dearest first), and why;
        and the price of what is left. That is captured even where it does not fit: the
        process's own floor."""
        governor = self.agent.governor
        priced, unpriced = governor.capture_prices(w, asked - self._own(w))
        left_out = {lv: f"not priced: {why}" for lv, why in unpriced.items()}
        levels = set(asked) - set(left_out)
        prices = {**dict(w.known_shares), **priced}
        for level in sorted((lv for lv in levels if lv in DROPPABLE),
                            key=lambda lv: (-prices.get(lv, 0.0), DROPPABLE.index(lv))):
            fits, why = governor.capture_fits(w, levels, priced)
            if fits:
                break
            levels.discard(level)
            left_out[level] = why
        return levels, left_out, governor.capture_price(w, levels, priced)

    def _capture(self, w, firing: Firing, counts: dict) -> None:
        ident, reason, t = w.identity, firing.trigger.reason, firing.trigger
        try:
            asked = self._asked(w)
            levels, left_out, price = self._affordable(w, asked)
            with self.lock:       # refused for want of a place before: said then, not again
                again = (ident.pid, ident.start, t.text) in self.deferred_said
            if not again:
                self.agent.log(f"PID {ident.pid}: {t.text} fired ({t.stat} {in_unit(firing.value, t.unit)} "
                               f"{'<' if t.below else '>'} {in_unit(firing.limit, t.unit)}): capturing "
                               f"{self.record_for_s:g} s at {','.join(sorted(levels))}"
                               + "".join(f"; {lv} left out ({why})" for lv, why in sorted(left_out.items())))
            started = time.time()
            tenant = self.agent.seen.tenants.tenant((ident.pid, ident.start))
            trace, summary = self.captures.run(ident.pid, self.record_for_s, levels, price, tenant)
        except Exception as e:          # BadRequest, or the capture's files gone wrong
            if isinstance(e, BadRequest) and e.status == 429:
                # the places taken (another process's incident, its tenant's capture): tried
                # again while the condition holds, not dropped
                self.triggers.rearm((ident.pid, ident.start), firing.trigger)
                key = (ident.pid, ident.start, firing.trigger.text)
                with self.lock:
                    self.deferred += 1
                    first = key not in self.deferred_said
                    self.deferred_said.add(key)
                if first:
                    self.agent.log(f"PID {ident.pid}: the capture {t.text} fired could not start yet ({e}): "
                                   "it fires again while its condition holds (said once; /status counts them)")
                return
            self._failed(ident, firing, f"could not be made: {e}")
            return
        finally:
            with self.lock:
                self.starting.discard(ident.pid)
        fired = firing.as_dict()
        # the quantity's series on from the firing, through the capture
        fired["series_after"] = [{"t": at, "value": v, "samples": n} for at, v, n in
                                 self.triggers.series_since((ident.pid, ident.start), firing.trigger, firing.at)]
        record = {"pid": ident.pid, "process": ident.as_dict(), "tenant": tenant, "fired": fired,
                  "started_at": started, "record_for_s": self.record_for_s,
                  "levels_asked": sorted(asked), "levels": sorted(levels),
                  "left_out": left_out, "cost": summary.get("profiler_cost"),
                  "lost_events": summary.get("lost_events"), "counts": counts,
                  **({"partial": summary["partial"]} if "partial" in summary else {})}
        try:
            trace = with_meta(trace, {"flight": json.dumps(record)})
            kept = self.store.add(record, trace)
        except Exception as e:             # a full volume, or a trace over the cap
            self._failed(ident, firing, f"was not kept: {e}")
            return
        with self.lock:
            self.deferred_said.discard((ident.pid, ident.start, t.text))
        self.agent.metrics.capture_made(ident, reason, kept)
        self.agent.log(f"PID {ident.pid}: capture {kept['id']} kept ({len(trace):,} bytes; "
                       f"{len(self.store.list())} kept)")

    def _failed(self, ident: Identity, firing: Firing, why: str) -> None:
        with self.lock:
            self.deferred_said.discard((ident.pid, ident.start, firing.trigger.text))
        self.failed += 1
        self.agent.metrics.capture_failed(ident, firing.trigger.reason, why)
        self.agent.log(f"PID {ident.pid}: the capture {firing.trigger.text} fired {why}")

    def status(self) -> dict:
        with self.agent.lock:
            idents = [w.identity for w in self.agent.watches.values()]
        now = time.monotonic()
        return {"triggers": [t.text for t in self.triggers.triggers], "record_for_s": self.record_for_s,
                "window_s": self.window_s, "baseline_window_s": self.baseline_s,
                "processes": [{"pid": i.pid, "triggers": self.triggers.state_dicts((i.pid, i.start), now)} for i in idents],
                "keep": self.store.keep, "max_bytes": self.store.max_bytes, "failed": self.failed,
                "deferred": self.deferred,
                "kept": [{k: r.get(k) for k in ("id", "pid", "started_at", "bytes", "levels")}
                         | {"trigger": r.get("fired", {}).get("trigger")} for r in self.store.list()]}
