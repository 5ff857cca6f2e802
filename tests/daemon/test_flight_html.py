"""The HTML report of a real flight recorder's capture: what fired, the trigger's
series around the moment and the changes against the baseline, each number the summary's.

The incident is made without competing for the CPU (which this VM's noise would make
uncertain): a llama-server decoding for one client makes one-token decode calls; a second
client makes them two-token calls (the server batches both slots), which a trigger on the
calls' median batch, `batch_p50 > 1.5 for 2s`, sees. The trigger's text, limit, the capture's
length and level are this test's own, and the page says them."""
from __future__ import annotations

import json
import os
import threading
import time
import urllib.request

from conftest import llama_server
from daemon_helpers import Daemon, _get
from test_html_report import report, shown_page

TRIGGER = "batch_p50 > 1.5 for 2s"
RECORD_S = 2
# the baseline ends 10 s before the incident; its ranges need 3 intervals between the daemon's
# count samples, taken each SAMPLE_S: 4 samples, whatever their phase (and the intervals alike in rate)
SAMPLE_S = 1
BASELINE_LOAD_S = 10 + 4 * SAMPLE_S + 2


class Client(threading.Thread):
    """Completions asked one after another until stopped."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url, self.stop = url + "/completion", threading.Event()

    def run(self) -> None:
        body = json.dumps({"prompt": "Once upon a time there was", "n_predict": 48}).encode()
        while not self.stop.is_set():
            req = urllib.request.Request(self.url, data=body, method="POST", headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=60) as r:
                    r.read()
            except OSError:
                time.sleep(0.1)


def captures(d: Daemon) -> list[dict]:
    return json.loads(_get(d.url + "/captures", d.token)[1])["captures"]


def test_a_flight_capture_page_shows_what_fired_and_what_changed(tmp_path, llama_build, tiny_model, llama_env):
    clients = []
    with llama_server(llama_build, tiny_model, llama_env, 2) as (server, url):
        d = Daemon(tmp_path, ("--levels", "token,graph", "--trigger", TRIGGER, "--record-for", f"{RECORD_S}s",
                              "--keep", "1", "--captures-dir", str(tmp_path / "captures"), "--capture-levels", "token"),
                   env={**os.environ, "PROFINFER_BASELINE_SAMPLE_S": str(SAMPLE_S)})
        try:
            d.watched(server.pid)
            clients.append(Client(url))
            clients[0].start()
            time.sleep(BASELINE_LOAD_S)
            assert captures(d) == [], d.text()       # one client: one-token calls, nothing fires
            clients.append(Client(url))
            clients[1].start()
            deadline = time.monotonic() + 40
            while time.monotonic() < deadline and not captures(d):
                time.sleep(0.5)
            kept = captures(d)
            assert kept, d.text()
            status, trace = _get(d.url + f"/captures/{kept[0]['id']}", d.token)
            assert status == 200
        finally:
            for c in clients:
                c.stop.set()
            d.stop()
    path = tmp_path / "capture.pftrace"
    path.write_bytes(trace)
    summary, page = report(path, tmp_path)
    f = summary["flight"]
    assert list(summary)[0] == "flight"
    assert f["fired"]["trigger"] == TRIGGER and f["fired"]["limit"] == 1.5 and f["fired"]["unit"] == "tokens"
    # the capture's levels: those asked for and the process's own then (graph, where the governor kept it)
    assert f["record_for_s"] == RECORD_S and "token" in f["levels"]
    assert f["baseline"] and f["incident"] and f["changes"], f
    _, shown, text, _ = shown_page(summary, page)
    assert TRIGGER in text and "What changed" in text and f"at {', '.join(f['levels'])}." in text
    assert {("flight", "fired", "value"), ("flight", "fired", "limit"), ("flight", "record_for_s"),
            ("flight", "baseline", "seconds"), ("flight", "incident", "seconds")} <= shown
    assert {("flight", "fired", "series", j, "value") for j in range(len(f["fired"]["series"]))} <= shown
    # each change's row: its shares on the sides that have the item, the baseline's ranges (where
    # it has 3 busy intervals: this VM slows a process at times), its verdict
    for i, r in enumerate(f["changes"]):
        for side in ("baseline", "incident"):
            if r[side]:
                assert ("flight", "changes", i, side, "share") in shown
        if (r["baseline"] or {}).get("share_range"):
            assert {("flight", "changes", i, "baseline", "share_range", j) for j in (0, 1)} <= shown
        assert r["verdict"] in text
