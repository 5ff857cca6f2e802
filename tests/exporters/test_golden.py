"""Golden outputs: four recordings made once (llama.cpp with op, sched and counters; vLLM; a
CUDA program alone; a CUDA program whose functions are ops through a pack) are kept in
tests/golden/ with what profinfer made of them when they were recorded, before the code was
reorganised into core, engines and levels. Reading each back and exporting it again must
give the same bytes: the operator report, the JSON summary, the Perfetto trace itself, the
Chrome JSON and (llama.cpp) the graph.

`python tests/exporters/test_golden.py` writes the expected files again; run it only for a change
of output that is meant, and say so in the commit.
"""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
RECORDINGS = ("llamacpp", "vllm", "cuda_calls", "cuda_ops")
PROFINFER = [sys.executable, "-m", "profinfer.cli"]


def _cli(args: list[str]) -> bytes:
    p = subprocess.run([*PROFINFER, *args], capture_output=True, timeout=300)
    assert p.returncode == 0, p.stderr.decode()
    return p.stdout


def outputs(name: str, work: Path) -> dict[str, bytes]:
    """Everything profinfer makes of one stored recording, by file name."""
    trace = GOLDEN / f"{name}.pftrace"
    summary = work / f"{name}.json"
    made = {f"{name}.report.txt": _cli(["report", str(trace), "--json", str(summary)])}
    made[f"{name}.summary.json"] = summary.read_bytes()
    again, chrome = work / f"{name}.pftrace", work / f"{name}.chrome.json"
    subprocess.run([sys.executable, "-c", (
        "import sys\n"
        "from profinfer.exporters.trace_reader import read_trace\n"
        "from profinfer.exporters.perfetto import write_chrome_json, write_perfetto\n"
        "p = read_trace(sys.argv[1])\n"
        "write_perfetto(p, sys.argv[2])\n"
        "write_chrome_json(p, sys.argv[3])\n"), str(trace), str(again), str(chrome)], check=True)
    made[f"{name}.pftrace"] = again.read_bytes()
    # The Chrome JSON is large: its digest is kept, not the file.
    made[f"{name}.chrome.json.sha256"] = hashlib.sha256(chrome.read_bytes()).hexdigest().encode() + b"\n"
    if name == "llamacpp":
        dot = work / "graph.dot"
        _cli(["graph", str(trace), "-o", str(dot)])
        made[f"{name}.graph.dot"] = dot.read_bytes()
    return made


@pytest.mark.parametrize("name", RECORDINGS)
def test_a_stored_recording_exports_as_before(name, tmp_path):
    made = outputs(name, tmp_path)
    for file, data in made.items():
        want = (GOLDEN / file).read_bytes()
        if file.endswith(".json"):
            assert json.loads(data) == json.loads(want), file
        assert data == want, f"{file} differs from tests/golden/{file}"


def test_the_recordings_cover_every_record_type(tmp_path):
    """The goldens are worth something only if they hold every kind of record: tokens,
    graphs, ops with shapes, sched slices, counters, vLLM steps and calls, CUDA calls."""
    summaries = {n: json.loads((GOLDEN / f"{n}.summary.json").read_text()) for n in RECORDINGS}
    flat = {n: json.dumps(s) for n, s in summaries.items()}
    assert '"task-clock"' in flat["llamacpp"] and '"preempted_ns"' in flat["llamacpp"]
    assert summaries["vllm"]["step_list"] and summaries["vllm"]["op_shapes"]
    assert summaries["cuda_calls"]["cuda"] and summaries["cuda_ops"]["cuda"] and summaries["cuda_ops"]["ops"]


if __name__ == "__main__":
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        for rec in RECORDINGS:
            for file, data in outputs(rec, Path(d)).items():
                if file != f"{rec}.pftrace":      # the recording itself is never rewritten
                    (GOLDEN / file).write_bytes(data)
    print(f"wrote the expected outputs in {GOLDEN}")
