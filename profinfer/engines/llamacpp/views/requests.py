"""llama-server's requests in the summary (every request) and in the report (report
--requests: the slowest). The figures: decode/requests.py; what is exact: docs/requests.md."""
from __future__ import annotations

from rich.console import Console
from rich.table import Table

from profinfer.core.plugin.tables import ms
from profinfer.core.profile.model import Profile, Request
from profinfer.engines.llamacpp.decode.requests import requests

SHOWN = "requests"        # Profile.shown: report --requests
SLOWEST = 20


def _int(x: float | None) -> int | None:
    return None if x is None else int(round(x))


def keys(profile: Profile) -> dict:
    rows = requests(profile)
    if not rows:
        return {}
    return {"requests": [{"id": r.id, "slot": r.seq, "kind": r.kind, "pid": r.pid,
                          "arrival_ns": r.arrival_ns, "start_ns": r.start_ns, "queue_ns": r.queue_ns,
                          "prompt_tokens": r.prompt_tokens, "cached_tokens": r.cached_tokens,
                          "generated_tokens": r.generated_tokens, "first_token_ns": r.first_token_ns,
                          "ttft_ns": r.ttft_ns, "tpot_ns": _int(r.tpot_ns), "end_ns": r.end_ns,
                          "latency_ns": r.latency_ns} for r in rows]}


def table(rows: list[Request], first_ns: int) -> Table:
    slowest = sorted(rows, key=lambda r: -(r.latency_ns or 0))[:SLOWEST]
    t = Table(title=f"Requests ({len(rows)}; the {len(slowest)} slowest, arrival to end)",
              title_justify="left")
    for col in ("task", "slot", "arrival ms", "queue ms", "TTFT ms", "TPOT ms", "prompt",
                "cached", "generated", "latency ms"):
        t.add_column(col, justify="right")
    for r in slowest:
        arrival = r.start_ns if r.arrival_ns is None else r.arrival_ns
        t.add_row(str(r.id), str(r.seq), ms(arrival - first_ns), ms(r.queue_ns), ms(r.ttft_ns),
                  ms(r.tpot_ns), f"{r.prompt_tokens:,}", f"{r.cached_tokens:,}",
                  f"{r.generated_tokens:,}", ms(r.latency_ns))
    return t


def render(profile: Profile, console: Console) -> None:
    if SHOWN not in profile.shown:
        return
    rows = requests(profile)
    if not rows:
        console.print("No requests recorded (llama-server's request marks: docs/requests.md).")
        return
    first = min(min(r.arrival_ns or r.start_ns for r in rows),
                min((t.start_ns for t in profile.tokens), default=rows[0].start_ns))
    console.print(table(rows, first))
