"""The HTML report: one self-contained page drawn from a summary dict (the JSON summary's).

The page embeds the dict as a <script type="application/json"> block and draws it with the
inline script and style of viewers/assets/ (no external asset; a Content-Security-Policy
forbids any request at view time). It takes a summary and a page kind, not a Profile, so
that other summaries are drawn the same way: kind "report" a recording's JSON summary,
kind "diff" a comparison (exporters/comparison.py). Every kind shares the frame
(report.html), the style (report.css) and common.js; its own drawing is <kind>.js.
"""
from __future__ import annotations

import html
import json
import math
import re
from importlib import resources
from pathlib import Path

# Page kinds the script knows how to draw.
KINDS = ("report", "diff")


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


def _title(summary: dict, kind: str) -> str:
    if kind == "diff":
        sides = [summary["runs"][side]["traces"] for side in ("before", "after")]
        return "profinfer diff: " + " → ".join(t[0] if len(t) == 1 else f"{len(t)} runs" for t in sides)
    return f"profinfer {kind}: {summary.get('process_name') or ''} (pid {summary.get('pid')})"


def _json(value) -> str:
    # "<" as \u003c: the JSON text cannot close the script element it stands in
    return json.dumps(_finite(value), separators=(",", ":"), ensure_ascii=False).replace("<", "\\u003c")


def render(summary: dict, kind: str = "report", title: str | None = None, labels: dict | None = None) -> str:
    """The page; labels: names the page shows that are not the summary's own (section titles),
    embedded apart from it so that the embedded summary stays the JSON written by --json."""
    if kind not in KINDS:
        raise ValueError(f"unknown page kind {kind!r}; known: {', '.join(KINDS)}")
    title = title or _title(summary, kind)
    # one function around both: the kind's module uses common.js's names
    script = f'"use strict";\n(function () {{\n{_asset("common.js")}\n{_asset(kind + ".js")}\n}})();\n'
    fills = {"title": html.escape(title), "kind": html.escape(kind), "style": _asset("report.css"),
             "data": _json(summary), "labels": _json(labels or {}),
             "script": script.replace("</script", "<\\/script")}
    # in one pass: a trace path in the data that reads "{{script}}" stays text
    return re.sub(r"\{\{(\w+)\}\}", lambda m: fills[m.group(1)], _asset("report.html"))


def write_html(summary: dict, path: str | Path, kind: str = "report", labels: dict | None = None) -> None:
    text = render(summary, kind, labels=labels)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
