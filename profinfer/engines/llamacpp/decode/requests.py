"""llama-server's requests: its request marks (BPF's struct pi_request_event: tasks posted to
the server's queue, a task launched on its slot) joined with the decode calls by slot (a
slot's id is its sequence id in the batches) and time (docs/requests.md).

A task launched on slot S at L owns S's runs in the decode calls that start from L until the
next launch on S: its prompt runs (the first one's position is where its cached prefix
ends), the call that completed its prompt (its first token is sampled from that call's
logits), its decoding runs (one generated token each, after the first), and the last call's
end. Arrival is its post (a child task's, its parent's)."""
from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass

import numpy as np

from profinfer.core.profile.model import Profile, Request, decoding_run

MARKS = "request_marks"       # Profile.records' key (views/timeline.py: RequestKind)
POSTED, LAUNCHED = "posted", "launched"
# server_task_type in b11434 (tools/server/server-task.h), where the DWARF does not name them
# (probes/requests.py: task_types)
TASK_TYPES = ("completion", "embedding", "rerank", "decision", "infill", "cancel", "control",
              "next_response", "metrics", "slot_get", "slot_save", "slot_restore", "slot_erase",
              "get_lora", "set_lora")


@dataclass(slots=True)
class RequestMark:
    """One mark llama-server made: tasks posted to its queue, or a task launched on a slot."""
    pid: int
    tid: int
    start_ns: int
    what: str                     # POSTED or LAUNCHED
    tasks: tuple[int, ...]        # task ids (a post's first PI_REQ_TASKS)
    types: tuple[str, ...]        # their kinds (TASK_TYPES)
    slot: int = -1                # launched: the slot
    parent: int = -1              # launched: the parent task (-1: none)
    n_tasks: int = 0              # posted: the tasks the post carried

    @property
    def end_ns(self) -> int:
        return self.start_ns


def type_name(value: int, names: dict[int, str] | None = None) -> str:
    names = names or {}
    if value in names:
        return names[value]
    return TASK_TYPES[value] if 0 <= value < len(TASK_TYPES) else str(value)


def marks_of(events: np.ndarray, consts: dict[str, int], names: dict[int, str] | None = None) -> list[RequestMark]:
    """The marks in an array of pi_request_event records."""
    out = []
    for e in events:
        posted = int(e["mark"]) == consts["PI_REQ_POSTED"]
        n = min(int(e["n_tasks"]), consts["PI_REQ_TASKS"]) if posted else 1
        out.append(RequestMark(int(e["tgid"]), int(e["tid"]), int(e["ts_ns"]),
                               POSTED if posted else LAUNCHED,
                               tuple(int(x) for x in e["task"][:n]),
                               tuple(type_name(int(x), names) for x in e["type"][:n]),
                               int(e["slot"]), int(e["parent"]), int(e["n_tasks"])))
    return out


def requests(profile: Profile) -> list[Request]:
    """The profile's requests, in launch order (none without marks)."""
    marks = profile.records.get(MARKS) or []
    if not marks:
        return []
    return profile.derived("llamacpp_requests", (len(marks), len(profile.tokens)),
                           lambda: join(marks, profile.tokens, profile.pid))


def join(marks: list[RequestMark], tokens: list, pid: int = 0) -> list[Request]:
    pids = {m.pid for m in marks}
    if pid in pids:             # the profiled process's (record follows others)
        marks = [m for m in marks if m.pid == pid]
    arrival: dict[int, int] = {}
    for m in marks:
        if m.what == POSTED:
            for t in m.tasks:
                if t >= 0:          # a cancel's task is given its id inside the post: -1 here
                    arrival.setdefault(t, m.start_ns)
    launches = sorted((m for m in marks if m.what == LAUNCHED), key=lambda m: m.start_ns)
    calls = sorted(tokens, key=lambda t: (t.start_ns, t.tid))
    starts = [t.start_ns for t in calls]
    next_on_slot: dict[int, int] = {}
    bounds = []
    for m in reversed(launches):
        bounds.append(next_on_slot.get(m.slot))
        next_on_slot[m.slot] = m.start_ns
    bounds.reverse()
    out = []
    for m, until in zip(launches, bounds):
        task = m.tasks[0] if m.tasks else -1
        r = Request(id=task, seq=m.slot, start_ns=m.start_ns,
                    arrival_ns=arrival.get(task, arrival.get(m.parent) if m.parent >= 0 else None),
                    kind=m.types[0] if m.types else "", pid=m.pid)
        hi = len(calls) if until is None else bisect_left(starts, until)
        _fill(r, calls[bisect_left(starts, m.start_ns):hi])
        out.append(r)
    return out


def _fill(r: Request, calls: list) -> None:
    """The request's tokens and times from its slot's runs in `calls` (its window)."""
    decoding = 0
    for c in calls:
        if c.ret != 0:                  # refused (the KV cache full): the server submits it again
            continue
        for seq, pos0, n in c.runs:
            if seq != r.seq or n <= 0:
                continue
            if decoding_run(pos0, n) and r.first_token_ns is not None:
                decoding += 1
                r.end_ns = c.end_ns
            elif not decoding:          # its prompt, maybe in chunks
                if not r.prompt_tokens:
                    r.cached_tokens = pos0
                r.prompt_tokens += n
                r.first_token_ns = r.end_ns = c.end_ns
    if r.first_token_ns is not None and r.kind in ("completion", "infill"):
        r.generated_tokens = decoding + 1     # the first from the prompt's batch
