"""The HTML report (`profinfer report TRACE --html PAGE`), loaded in Debian's headless
Chromium (by Selenium, through Debian's chromedriver): the page raises no console error, asks
for nothing over the network, and every number of the summary it shows (marked data-key, the
path into the summary) is the JSON summary's, as written by `--json` next to it: its value
exactly, its text to the digits shown. The charts have a mark per data row, and the roofline's
points lie on log-log axes at their verdicts' intensity and GFLOP/s.

A real run of the tiny llama.cpp model is drawn, a run of the tiny MoE model with the sched
level and perf counters (its expert heatmaps against llama.cpp's own token counts), and the
stored recordings of tests/golden/ (vLLM's steps, also merged into groups; the CUDA level's
tables; llama.cpp's sched and counters). A flight recorder's capture is drawn in
tests/daemon/test_flight.py (a real slowdown's). PROFINFER_SCREENSHOT=PATH keeps the tiny run's screenshot
there (docs/report-example.png is one)."""
from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import PROFINFER, completion_cmd, llama_perf, run_profinfer, with_llama_log

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
GOLDEN = Path(__file__).resolve().parents[1] / "golden"

# What a shown number's unit multiplies it by to give the summary's unit.
UNITS = {"ns": 1, "µs": 1e3, "ms": 1e6, "s": 1e9, "%": 0.01, "MiB": 1 << 20,
         "tok/s": 1, "GFLOP/s": 1, "GB/s": 1, "": 1}
NUMBER = re.compile(r"^([-+]?[\d,]+)(?:\.(\d+))?\s*(.*)$")


@contextlib.contextmanager
def chromium(width: int = 1280, height: int = 900):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    for tool in (CHROMIUM, CHROMEDRIVER):
        assert os.access(tool, os.X_OK), f"{tool} missing: setup.sh installs Debian's chromium and chromium-driver"
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                f"--window-size={width},{height}"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    try:
        yield driver
    finally:
        driver.quit()


def load(driver, page: Path) -> dict:
    """The page loaded: what it logged, what it requested, and each number it marks."""
    from selenium.webdriver.support.ui import WebDriverWait
    driver.get(page.as_uri())
    # the page's script runs inline, before the load completes
    WebDriverWait(driver, 60).until(lambda d: d.execute_script("return document.readyState === 'complete'"))
    rendered = driver.execute_script("return document.body.dataset.rendered")
    marked = driver.execute_script("""
        return [...document.querySelectorAll('[data-key]')].map(e => ({
          tag: e.tagName, key: e.dataset.key, value: e.dataset.value, scale: e.dataset.scale || null,
          cls: e.getAttribute('class') || '',
          text: (e instanceof SVGGeometryElement) ? null : e.textContent.trim(),
          cx: e.getAttribute('cx'), cy: e.getAttribute('cy'),
          tip: (e.querySelector(':scope > title') || {}).textContent || null}));""")
    requests = [json.loads(e["message"])["message"] for e in driver.get_log("performance")]
    return {"logs": driver.get_log("browser"), "marked": marked, "rendered": rendered,
            "requests": {m["params"]["request"]["url"] for m in requests
                         if m["method"] == "Network.requestWillBeSent"}}


def at(summary: dict, path: list):
    v = summary
    for part in path:
        v = v[part]
    return v


def shown_value(text: str) -> tuple[float, float]:
    """A shown number in the summary's unit, and how far from it the true value may be (half
    its last digit)."""
    m = NUMBER.match(text)
    assert m, f"not a number with a unit: {text!r}"
    whole, frac, unit = m.groups()
    assert unit in UNITS, f"unknown unit in {text!r}"
    scale = UNITS[unit]
    value = float(whole.replace(",", "") + (f".{frac}" if frac else ""))
    return value * scale, 0.5 * 10 ** -len(frac or "") * scale


def check_page(summary: dict, page: Path, loaded: dict) -> set[tuple]:
    """The checks every page passes; returns the paths of the numbers it shows."""
    assert not [e for e in loaded["logs"] if e["level"] in ("SEVERE", "WARNING")], loaded["logs"]
    assert loaded["rendered"] == "1", "the page's script did not finish"
    assert loaded["requests"] <= {page.as_uri()}, f"the page asked for {loaded['requests']}"
    paths = set()
    for m in loaded["marked"]:
        path = json.loads(m["key"])
        want = at(summary, path)
        got = json.loads(m["value"])
        if isinstance(want, float) and isinstance(got, int):
            got = float(got)      # JavaScript writes a large float without its fraction (2e17: "200000000000000000")
        assert got == want, (path, m["value"], want)
        if m["text"] is not None:
            if want is None:
                assert m["text"] == "–", (path, m["text"])
            else:
                shown, within = shown_value(m["text"])
                want_shown = want * float(m["scale"] or 1)    # the text in another unit than the data's
                assert abs(shown - want_shown) <= within * (1 + 1e-9) + 1e-9 * abs(want_shown), (path, m["text"], want)
        paths.add(tuple(path))
    return paths



def shown_page(summary: dict, page: Path, script: str | None = None) -> tuple[dict, set[tuple], str, object]:
    """The page loaded in Chromium (load) and checked (check_page): what loading it gave, the
    paths of the numbers it shows, its text, and what `script` returned (None without one)."""
    with chromium() as driver:
        loaded = load(driver, page)
        return (loaded, check_page(summary, page, loaded), driver.execute_script("return document.body.innerText"),
                driver.execute_script(script) if script else None)

def report(trace: Path, tmp_path: Path) -> tuple[dict, Path]:
    page, js = tmp_path / "page.html", tmp_path / "s.json"
    p = subprocess.run([*PROFINFER, "report", str(trace), "--html", str(page), "--json", str(js)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    return json.loads(js.read_text()), page


def check_roofline_is_log_log(summary: dict, marked: list[dict]) -> None:
    """Each point's x (y) is an affine function of log10 intensity (GFLOP/s), increasing
    (decreasing: SVG's y runs down), within half a pixel."""
    verdicts = summary["roofline"]["verdicts"]
    plotted = [v for v in verdicts if (v["intensity"] or 0) > 0 and (v["gflops"] or 0) > 0]
    points = [(verdicts[json.loads(m["key"])[2]], float(m["cx"]), float(m["cy"]))
              for m in marked if "verdict" in m["cls"]]
    assert len(points) == len(plotted) >= 2
    for field, pos, sign in (("intensity", 1, 1), ("gflops", 2, -1)):
        pts = sorted({(math.log10(p[0][field]), p[pos]) for p in points})
        (l0, p0), (l1, p1) = pts[0], pts[-1]
        assert (p1 - p0) * sign > 0, field
        for lv, pv in pts:
            assert abs(p0 + (lv - l0) * (p1 - p0) / (l1 - l0) - pv) < 0.5, (field, lv, pv)


@pytest.fixture(scope="module")
def tiny_run(llama_build, tiny_model, llama_env, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("html")
    trace = tmp / "run.pftrace"
    r = with_llama_log(lambda: run_profinfer(   # -o: ops one by one (layers and the roofline need them)
        ["record", "--quiet", "-o", str(trace), "--", *completion_cmd(llama_build, tiny_model, n=24)],
        env=llama_env, tmp_path=tmp))
    assert r.rc == 0, r.stderr[-2000:]
    return trace, tmp


def test_the_page_of_a_real_run_shows_the_summarys_numbers(tiny_run, tmp_path):
    trace, _ = tiny_run
    summary, page = report(trace, tmp_path)
    with chromium() as driver:
        loaded = load(driver, page)
        shown = check_page(summary, page, loaded)
        height = driver.execute_script("return document.documentElement.scrollHeight")
        driver.set_window_size(1280, height)
        shot = tmp_path / "report.png"
        driver.save_screenshot(str(shot))
    # the headline numbers, each row of the roofline and of the layers, each decode call's bar
    assert {("ttft_ns",), ("tpot_ns",), ("tokens_per_s",), ("tokens", "prefill"), ("tokens", "decode"),
            ("roofline", "roofs", "peak_gflops"), ("roofline", "roofs", "peak_gbps")} <= shown
    assert summary["roofline"] and summary["layers"] and summary["decode_call_group"] == 1
    assert {("roofline", "verdicts", i, "gflops") for i in range(len(summary["roofline"]["verdicts"]))} <= shown
    assert {("layers", i, "time_ns") for i in range(len(summary["layers"]))} <= shown
    calls = summary["decode_call_list"]
    assert len(calls) == summary["decode_calls"]
    assert {("decode_call_list", i, "dur_ns") for i, c in enumerate(calls) if c["phase"] != "prefill"} <= shown
    for phase, p in summary["phases"].items():
        assert {("phases", phase, "ops", i, "total_ns") for i in range(min(10, len(p["ops"])))} <= shown
    check_roofline_is_log_log(summary, loaded["marked"])
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000
    if os.environ.get("PROFINFER_SCREENSHOT"):
        shutil.copyfile(shot, os.environ["PROFINFER_SCREENSHOT"])


def durations_shown(loaded: dict, key: str) -> dict[int, tuple[float, float]]:
    """Each timeline entry's duration bar: the time its tooltip says it drew (ns, and how
    exact its text is)."""
    out = {}
    for m in loaded["marked"]:
        path = json.loads(m["key"])
        if path[0] == key and "duration" in m["cls"]:
            out[path[1]] = shown_value(m["tip"].rsplit(": ", 1)[1])
    return out


@pytest.mark.parametrize("name", ["llamacpp", "vllm", "cuda_calls", "cuda_ops"])
def test_the_page_of_each_stored_recording(name, tmp_path):
    summary, page = report(GOLDEN / f"{name}.pftrace", tmp_path)
    with chromium() as driver:
        loaded = load(driver, page)
        shown = check_page(summary, page, loaded)
    assert ("lost_events",) in shown
    if summary.get("step_list"):     # vLLM's: each step a bar as long as the step (one a group)
        assert summary["step_group"] == 1
        assert {("step_list", i, "dur_ns") for i in range(len(summary["step_list"]))} <= shown
        drawn = durations_shown(loaded, "step_list")
        assert sorted(drawn) == list(range(len(summary["step_list"])))
        for i, (ns, within) in drawn.items():
            assert abs(ns - summary["step_list"][i]["dur_ns"]) <= within, (i, ns)
    if summary.get("sched"):        # the llama.cpp recording's: each thread's row and bar
        assert {("sched", "threads", i, k) for i in range(len(summary["sched"]["threads"]))
                for k in ("on_cpu_ns", "preempted_ns", "runnable_ns", "sleeping_ns", "preemptions")} <= shown
    if summary.get("counters"):
        c = summary["counters"]
        assert {("counters", "ops", i, "totals", n) for i in range(len(c["ops"])) for n in c["names"]} <= shown
        assert {("counters", "phases", p, "totals", n) for p in c["phases"] for n in c["names"]} <= shown
    if summary.get("cuda"):
        kernels = list(summary["cuda"]["kernels"])[:15]
        assert kernels and {("cuda", "kernels", k, "launches") for k in kernels} <= shown


def test_a_long_step_list_is_merged_into_groups(tmp_path, monkeypatch):
    """The steps' timeline is bound as the decode calls' is: the stored vLLM recording's steps,
    with the bound set to 2, are merged into groups of k = ceil(steps / 2), which hold every
    step, its tokens and own time, and start and end where their first and last step do; the
    page says so and draws each group's mean step."""
    from profinfer.core.plugin import timeline_groups
    from profinfer.exporters.json_summary import summary as summarise
    from profinfer.exporters.trace_reader import read_trace
    from profinfer.viewers import html
    profile = read_trace(GOLDEN / "vllm.pftrace")
    steps = sorted(profile.steps, key=lambda st: st.start_ns)
    assert len(steps) >= 3                   # more than the bound: merged
    monkeypatch.setattr(timeline_groups, "MAX_TIMELINE_POINTS", 2)
    summary = summarise(profile)
    k = -(-len(steps) // 2)
    groups = summary["step_list"]
    assert summary["step_group"] == k and len(groups) == -(-len(steps) // k) <= 2
    for g, part in zip(groups, [steps[i:i + k] for i in range(0, len(steps), k)]):
        assert g["steps"] == len(part) and g["tokens"] == sum(st.n_tokens for st in part)
        assert g["start_ns"] == part[0].start_ns and g["end_ns"] == part[-1].end_ns
        assert g["dur_ns"] == sum(st.end_ns - st.start_ns for st in part)
        assert g["calls"] == sum(st.n_calls for st in part)
        assert "query_lens" not in g
    page = tmp_path / "page.html"
    html.write_html(summary, page)
    loaded, shown, text, _ = shown_page(summary, page)
    assert {("step_list", i, "dur_ns") for i in range(len(groups))} <= shown
    assert f"mean of each group of {k} engine steps" in text
    for i, (ns, within) in durations_shown(loaded, "step_list").items():
        assert abs(ns - groups[i]["dur_ns"] / groups[i]["steps"]) <= within, (i, ns, groups[i])


@pytest.fixture(scope="module")
def moe_run(llama_build, moe_model, llama_env, tmp_path_factory):
    """The tiny MoE model (8 experts, 2 used a token, 4 layers) with the sched level and two
    software counters (this VM has no hardware PMU)."""
    tmp = tmp_path_factory.mktemp("html-moe")
    trace = tmp / "moe.pftrace"
    r = with_llama_log(lambda: run_profinfer(
        ["record", "--quiet", "--levels", "token,graph,op,sched", "--counters", "task-clock,page-faults",
         "-o", str(trace), "--", *completion_cmd(llama_build, moe_model, n=12)], env=llama_env, tmp_path=tmp))
    assert r.rc == 0, r.stderr[-2000:]
    return trace, llama_perf(r.stderr)


def test_moe_sched_and_counters_of_a_real_run(moe_run, llama_build, tmp_path):
    """The MoE, scheduling and counters sections of a real run: drawn, every number the
    summary's; the decode heatmap's cells, read off the page, add up per layer to llama.cpp's
    own count of generated tokens times the experts a token uses (the prefill's to its prompt
    tokens', the last layer routing only the token whose logits are asked for); the counters
    are those asked for; the sched table names the program's main thread (its comm)."""
    trace, perf = moe_run
    summary, page = report(trace, tmp_path)
    loaded, shown, text, headers = shown_page(summary, page, "return [...document.querySelectorAll('h2')].map(h => h.textContent)")
    assert {"Mixture of experts: expert selections per layer", "Perf counters",
            "Scheduling: on and off the CPU"} <= set(headers)
    m = summary["moe"]
    assert (m["n_experts"], m["n_used"], m["layers"]) == (8, 2, [0, 1, 2, 3])
    cells = {}
    for mk in loaded["marked"]:
        path = json.loads(mk["key"])
        if path[:2] == ["moe", "by_phase"] and mk["tag"] == "text":
            cells.setdefault(path[2], {}).setdefault(path[3], []).append(int(mk["text"].replace(",", "")))
    per_layer = {ph: [sum(rows[i]) for i in sorted(rows)] for ph, rows in cells.items()}
    assert per_layer["decode"] == [perf["eval"][1] * 2] * 4
    assert per_layer["prefill"] == [perf["prompt eval"][1] * 2] * 3 + [2]
    assert {("moe", "counts", i, e) for i in range(4) for e in range(8)} <= shown
    c = summary["counters"]
    assert c["names"] == ["task-clock", "page-faults"]
    assert {("counters", "ops", i, "totals", n) for i in range(len(c["ops"])) for n in c["names"]} <= shown
    sched = summary["sched"]
    assert {("sched", "threads", i, "on_cpu_ns") for i in range(len(sched["threads"]))} <= shown
    comm = Path(completion_cmd(llama_build, Path("m.gguf"))[0]).name[:15]    # the kernel's comm: 15 bytes
    assert any(t["name"] == comm for t in sched["threads"]), sched["threads"]
    assert comm in text


def test_cache_roofs_and_a_verdicts_roof_are_drawn(tmp_path):
    """The roofline's cache roofs (roofs.caches) each get a line and their bandwidth; a
    verdict's roof and notes a column."""
    from profinfer.viewers import html
    summary = json.loads((GOLDEN / "llamacpp.summary.json").read_text())
    roofs = summary["roofline"]["roofs"]
    roofs["caches"] = [{"level": "L1", "gbps": roofs["peak_gbps"] * 20, "bytes": 32768},
                       {"level": "L2", "gbps": roofs["peak_gbps"] * 6, "bytes": 1 << 20}]
    summary["roofline"]["verdicts"][0].update(roof="L2", roof_gbps=roofs["peak_gbps"] * 6, notes="fits in L2")
    page = tmp_path / "page.html"
    html.write_html(summary, page)
    _, shown, text, _ = shown_page(summary, page)
    assert {("roofline", "roofs", "caches", 0, "gbps"), ("roofline", "roofs", "caches", 1, "gbps")} <= shown
    assert "fits in L2" in text and "L1" in text


def test_bad_input_is_one_line(tmp_path):
    missing = subprocess.run([*PROFINFER, "report", str(tmp_path / "none.pftrace"), "--html", str(tmp_path / "p.html")],
                             capture_output=True, text=True, timeout=120)
    unwritable = subprocess.run([*PROFINFER, "report", str(GOLDEN / "llamacpp.pftrace"),
                                 "--html", str(tmp_path / "no" / "dir" / "p.html")],
                                capture_output=True, text=True, timeout=120)
    for p in (missing, unwritable):
        assert p.returncode != 0 and len(p.stderr.strip().splitlines()) == 1, p.stderr
        assert "Traceback" not in p.stderr
    assert "No such file" in missing.stderr and "--html" in unwritable.stderr
    assert not (tmp_path / "p.html").exists()
