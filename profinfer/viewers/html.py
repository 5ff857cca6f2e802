"""The HTML report: one self-contained page drawn from a summary dict (the JSON summary's).

The page embeds the dict as a <script type="application/json"> block and draws it with the
inline script and style of viewers/assets/ (no external asset; a Content-Security-Policy
forbids any request at view time). It takes a summary and a page kind, not a Profile, so
that other summaries (a diff's) are drawn the same way.
"""
from __future__ import annotations

import html
import json
import math
from importlib import resources
from pathlib import Path

# Page kinds the script knows how to draw.
KINDS = ("report",)


def _finite(value):
    """The summary with NaN and infinities as null: JSON.parse takes no other (Python's json
    writes them as bare NaN/Infinity)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _asset(name: str) -> str:
    return resources.files("profinfer.viewers").joinpath("assets", name).read_text(encoding="utf-8")


def render(summary: dict, kind: str = "report", title: str | None = None) -> str:
    if kind not in KINDS:
        raise ValueError(f"unknown page kind {kind!r}; known: {', '.join(KINDS)}")
    data = json.dumps(_finite(summary), separators=(",", ":"), ensure_ascii=False)
    title = title or f"profinfer {kind}: {summary.get('process_name') or ''} (pid {summary.get('pid')})"
    return (_asset("report.html")
            .replace("{{title}}", html.escape(title))
            .replace("{{kind}}", html.escape(kind))
            .replace("{{style}}", _asset("report.css"))
            # "<" as \u003c: the JSON text cannot close the script element it stands in
            .replace("{{data}}", data.replace("<", "\\u003c"))
            .replace("{{script}}", _asset("report.js").replace("</script", "<\\/script")))


def write_html(summary: dict, path: str | Path, kind: str = "report") -> None:
    text = render(summary, kind)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
