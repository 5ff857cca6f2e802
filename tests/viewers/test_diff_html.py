"""The diff page (`profinfer diff BEFORE AFTER --html PAGE`), loaded in Debian's
headless Chromium as the report page is (tests/viewers/test_html_report.py): no console error, no
request, every number it marks equal to the comparison written by `--json` in the same run
(to the digits shown), every compared quantity a table row with its verdict, and each
section's forest plot placing its points on one log-ratio axis in the order of their changes,
each inside its interval's bar. Real recordings of the tiny llama.cpp model, one and two a
side. PROFINFER_SCREENSHOT=PATH keeps the one-a-side page's screenshot (docs/diff-example.png)."""
from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import PROFINFER, completion_cmd
from test_html_report import check_page, chromium, load


@pytest.fixture(scope="module")
def runs(llama_build, tiny_model, llama_env, tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("diffhtml")
    out = {}
    for name in ("a1", "a2", "b1", "b2"):
        out[name] = d / f"{name}.pftrace"
        p = subprocess.run([*PROFINFER, "record", "--quiet", "-o", str(out[name]), "--",
                            *completion_cmd(llama_build, tiny_model, n=24)],
                           capture_output=True, text=True, env=llama_env, timeout=300)
        assert p.returncode == 0, p.stderr[-2000:]
    return out


def diff_page(before: str, after: str, tmp_path: Path, *args: str) -> tuple[dict, Path]:
    page, js = tmp_path / "diff.html", tmp_path / "diff.json"
    p = subprocess.run([*PROFINFER, "diff", before, after, "--json", str(js), "--html", str(page), *args],
                       capture_output=True, text=True, timeout=300)
    result = json.loads(js.read_text())
    # the exit status is the gate's verdict: 1 exactly when a row failed, 3 inconclusive, 0 passed
    gate = result["gate"]
    assert p.returncode == (gate["exit"] if gate else 0), p.stderr
    assert gate is None or (gate["verdict"] == "fail") == bool(result["failed"]), gate
    return result, page


DRAWN = """
return {
  rows: [...document.querySelectorAll('section[data-section] tbody tr')].map(tr => ({
    section: tr.closest('section').dataset.section, name: tr.cells[0].textContent,
    verdict: tr.querySelector('[data-verdict]').dataset.verdict, failed: tr.classList.contains('failed')})),
  points: [...document.querySelectorAll('section[data-section] svg circle.change')].map(c => ({
    section: c.closest('section').dataset.section, key: c.dataset.key, cx: +c.getAttribute('cx'),
    domain: JSON.parse(c.closest('svg').dataset.domain),
    bar: (() => { const l = c.parentNode.querySelector('line.interval');
                  return l && [+l.getAttribute('x1'), +l.getAttribute('x2')]; })()})),
  text: document.body.innerText};
"""


def check_diff_page(result: dict, page: Path, driver) -> dict:
    loaded = load(driver, page)
    shown = check_page(result, page, loaded)
    drawn = driver.execute_script(DRAWN)
    changes = result["changes"]
    # every quantity a row, with its verdict, in its section; failed gates' rows in red
    assert sorted((r["section"], r["name"], r["verdict"]) for r in drawn["rows"]) == \
        sorted((c["section"], c["name"], c["verdict"]) for c in changes)
    failed = {f["name"] for f in result["failed"]}
    assert all(r["failed"] == (r["name"] in failed) for r in drawn["rows"])
    for i, c in enumerate(changes):
        assert {("changes", i, "before"), ("changes", i, "after"), ("changes", i, "change")} <= shown
        if c["low"] is not None:
            assert {("changes", i, "low"), ("changes", i, "high"), ("changes", i, "floor")} <= shown
    for side in ("before", "after"):
        assert {("runs", side, "lost_events"), ("runs", side, "events"), ("runs", side, "graph_coverage")} <= shown
    # the forest plot: per section a point per change, x an increasing affine function of
    # log(1 + change) (half a pixel), inside its interval's bar; a ratio beyond the axis'
    # domain (an op nearly gone: -100%) at the domain's end
    by_section: dict[str, list] = {}
    for p in drawn["points"]:
        i = json.loads(p["key"])[1]
        lo, hi = p["domain"]
        # the axis spans every ratio but one under a thousandth
        assert 1 + changes[i]["change"] <= hi and (lo <= 1 + changes[i]["change"] or 1 + changes[i]["change"] < 1e-3)
        ratio = min(hi, max(lo, 1 + changes[i]["change"]))
        by_section.setdefault(p["section"], []).append((math.log(ratio), p["cx"], p["bar"]))
    assert sum(map(len, by_section.values())) == sum(c["change"] is not None for c in changes)
    for section, pts in by_section.items():
        pts.sort(key=lambda p: p[0])
        assert all(a[1] <= b[1] for a, b in zip(pts, pts[1:])), section
        (l0, x0, _), (l1, x1, _) = pts[0], pts[-1]
        if l1 - l0 > 1e-6:
            assert x1 > x0
            for lv, xv, _ in pts:
                assert abs(x0 + (lv - l0) * (x1 - x0) / (l1 - l0) - xv) < 0.5, (section, lv, xv)
        for _, xv, bar in pts:
            assert bar is None or bar[0] - 0.5 <= xv <= bar[1] + 0.5, (section, xv, bar)
    for w in result["warnings"]:
        assert w in drawn["text"]
    if result["only_build_differs"]:
        assert "Only the build differs" in drawn["text"]
    return loaded


def test_one_run_a_side(runs, tmp_path):
    result, page = diff_page(str(runs["a1"]), str(runs["b1"]), tmp_path)
    assert len(result["changes"]) > 20
    with chromium() as driver:
        check_diff_page(result, page, driver)
        height = driver.execute_script("return document.documentElement.scrollHeight")
        driver.set_window_size(1280, height)
        shot = tmp_path / "diff.png"
        driver.save_screenshot(str(shot))
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if os.environ.get("PROFINFER_SCREENSHOT"):
        shutil.copyfile(shot, os.environ["PROFINFER_SCREENSHOT"])


def test_two_runs_a_side_with_a_gate(runs, tmp_path):
    """A 0.1% gate on every row: whether any fails is the runs' business; the page shows the
    gate and draws exactly the failed rows in red."""
    result, page = diff_page(f"{runs['a1']},{runs['a2']}", f"{runs['b1']},{runs['b2']}", tmp_path,
                             "--fail-above", "0.1%")
    assert len(result["runs"]["before"]["traces"]) == 2 and result["gates"] == ["0.1%"]
    with chromium() as driver:
        check_diff_page(result, page, driver)
        text = driver.execute_script("return document.body.innerText")
    assert "--fail-above 0.1%" in text


def test_an_unwritable_page_is_one_line_before_any_work(tmp_path):
    p = subprocess.run([*PROFINFER, "diff", str(tmp_path / "none.pftrace"), str(tmp_path / "none.pftrace"),
                        "--html", str(tmp_path / "no" / "dir" / "d.html")], capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert "--html" in p.stderr and "Traceback" not in p.stderr
