"""llama-server's requests as the daemon follows them, for days: the join of decode/requests.py
made as the marks and decode calls come, with bounded state (docs/requests.md).

Per process it keeps the posts not yet launched (task id -> arrival; at most MAX_PENDING,
the oldest dropped first, and none older than PENDING_MAX_NS) and the requests in flight
(one per slot: at most MAX_OPEN slots). A request is finished, handed over and forgotten as
soon as it can be: at the next launch on its slot, once its slot has been quiet for QUIET_NS
past its prompt, or at the process's exit. What is dropped unfinished is counted by reason."""
from __future__ import annotations

from collections import OrderedDict

from profinfer.core.profile.model import Request, decoding_run
from profinfer.engines.llamacpp.decode.requests import POSTED, RequestMark

MAX_PENDING = 4096              # posts waiting for a slot, per process
MAX_OPEN = 1024                 # requests in flight (slots), per process
QUIET_NS = 5_000_000_000        # a slot this long without a run of its request: it ended
PENDING_MAX_NS = 600_000_000_000   # a post this old never launched (cancelled, or its client left)
SLOT_TASKS = ("completion", "infill", "embedding", "rerank")   # the kinds launched on a slot
GENERATING = ("completion", "infill")
DROPS = ("pending_cap", "pending_expired", "in_flight_cap")


class _Open:
    __slots__ = ("req", "decoding", "last_ns")

    def __init__(self, req: Request, last_ns: int):
        self.req, self.decoding, self.last_ns = req, 0, last_ns


class RequestBook:
    """One process's requests, followed from its marks and decode calls (fed in time order)."""

    def __init__(self, max_pending: int = MAX_PENDING, max_open: int = MAX_OPEN,
                 quiet_ns: int = QUIET_NS, pending_max_ns: int = PENDING_MAX_NS):
        self.max_pending, self.max_open = max_pending, max_open
        self.quiet_ns, self.pending_max_ns = quiet_ns, pending_max_ns
        self.pending: OrderedDict[int, int] = OrderedDict()    # task id -> arrival (ns)
        self.open: dict[int, _Open] = {}                         # slot -> its request
        self.dropped = dict.fromkeys(DROPS, 0)
        self.finished: list[Request] = []                        # taken by take()
        self.marked = False             # a request mark came: a server (its series are shown)

    def feed(self, items: list, now_ns: int | None = None) -> None:
        """Marks (RequestMark) and decode calls (TokenCall) since the last feed; then what
        has been quiet since before now_ns - quiet is finished."""
        for x in sorted(items, key=lambda x: x.start_ns):
            if isinstance(x, RequestMark):
                self._mark(x)
            else:
                self._call(x)
        if now_ns is not None:
            self.expire(now_ns)

    def take(self) -> list[Request]:
        out, self.finished = self.finished, []
        return out

    def expire(self, now_ns: int) -> None:
        # only past its prompt: a prompt chunk is one decode call, seen at its end, which on a
        # big model can take longer than quiet_ns (a mid-prompt request ends at its slot's next
        # launch, or the process's exit)
        for slot in [s for s, o in self.open.items()
                     if o.req.first_token_ns is not None and now_ns - o.last_ns >= self.quiet_ns]:
            self._finish(self.open.pop(slot))
        while self.pending and now_ns - next(iter(self.pending.values())) >= self.pending_max_ns:
            self.pending.popitem(last=False)
            self.dropped["pending_expired"] += 1

    def close(self) -> None:
        """The process exited: its requests in flight end with what they did."""
        for o in self.open.values():
            self._finish(o)
        self.open.clear()
        self.pending.clear()

    def _mark(self, m: RequestMark) -> None:
        self.marked = True
        if m.what == POSTED:
            for task, kind in zip(m.tasks, m.types):
                if kind in SLOT_TASKS and task >= 0:
                    self.pending[task] = m.start_ns
                    self.pending.move_to_end(task)
            while len(self.pending) > self.max_pending:
                self.pending.popitem(last=False)
                self.dropped["pending_cap"] += 1
            return
        task = m.tasks[0] if m.tasks else -1
        arrival = self.pending.pop(task, None)
        if arrival is None and m.parent >= 0:
            arrival = self.pending.get(m.parent)
        prev = self.open.pop(m.slot, None)
        if prev is not None:
            self._finish(prev)
        while len(self.open) >= self.max_open:
            oldest = min(self.open, key=lambda s: self.open[s].last_ns)
            del self.open[oldest]
            self.dropped["in_flight_cap"] += 1
        self.open[m.slot] = _Open(Request(id=task, seq=m.slot, start_ns=m.start_ns, arrival_ns=arrival,
                                          kind=m.types[0] if m.types else "", pid=m.pid), m.start_ns)

    def _call(self, c) -> None:
        """One decode call: its runs on open slots, as decode/requests.py's _fill reads them."""
        if c.ret != 0:                  # refused (the KV cache full): the server submits it again
            return
        for seq, pos0, n in c.runs:
            o = self.open.get(seq)
            if o is None or n <= 0 or c.start_ns < o.req.start_ns:
                continue
            r = o.req
            if decoding_run(pos0, n) and r.first_token_ns is not None:
                o.decoding += 1
                r.end_ns = c.end_ns
            elif not o.decoding:
                if not r.prompt_tokens:
                    r.cached_tokens = pos0
                r.prompt_tokens += n
                r.first_token_ns = r.end_ns = c.end_ns
            o.last_ns = max(o.last_ns, c.end_ns)

    def _finish(self, o: _Open) -> None:
        r = o.req
        if r.first_token_ns is not None and r.kind in GENERATING:
            r.generated_tokens = o.decoding + 1
        self.finished.append(r)
