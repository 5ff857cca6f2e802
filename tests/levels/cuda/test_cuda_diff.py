"""`profinfer diff` of the cuda level, against the program's own log of its calls: a
program run with twice the repetitions launches each kernel twice as often, and copies
of each kind twice as often; diff must say so, kernel by kernel."""
from __future__ import annotations

import json
import subprocess
from collections import Counter

from test_cuda_level import LAUNCHES, PROFINFER, _captured, _expected_kernel, _log, _program


def _launches(log: list[dict]) -> Counter:
    return Counter(_expected_kernel(d, log) for d, cap in zip(log, _captured(log))
                   if d["fn"] in LAUNCHES and not cap)


def _copies(log: list[dict]) -> Counter:
    """The program's copies by kind, as diff names them."""
    return Counter("copy " + {0: "H2H", 1: "H2D", 2: "D2H", 3: "D2D", 4: "Default"}[d["kind"]]
                   for d in log if d["fn"].startswith("cudaMemcpy"))


def test_twice_the_work_is_twice_the_launches_of_each_kernel(tmp_path, libcuda):
    program = _program("cuda_calls", "static")
    runs, logs = [], []
    for repeat in (2, 4):
        log, trace = tmp_path / f"calls{repeat}.jsonl", tmp_path / f"r{repeat}.pftrace"
        p = subprocess.run([*PROFINFER, "record", "--quiet", "--levels", "cuda", "-o", str(trace), "--",
                            str(program), "--log", str(log), "--libcuda", str(libcuda), "--repeat", str(repeat)],
                           capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr[-2000:]
        runs.append(trace)
        logs.append(_log(log))
    out = tmp_path / "diff.json"
    p = subprocess.run([*PROFINFER, "diff", str(runs[0]), str(runs[1]), "--json", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    rows = {c["name"]: c for c in json.loads(out.read_text())["changes"]}
    before, after = _launches(logs[0]), _launches(logs[1])
    assert before and set(before) == set(after)
    for kernel, n in before.items():
        row = rows[f"launches {kernel}"]
        # no engine steps: one sample a side, the program's count (a count needs no interval)
        assert (row["before"], row["after"]) == (n, after[kernel]), (kernel, row, n, after[kernel])
        assert row["change"] == after[kernel] / n - 1
    copies_before, copies_after = _copies(logs[0]), _copies(logs[1])
    assert copies_after and set(copies_before) == set(copies_after)
    for kind, n in copies_after.items():
        row = rows[kind]
        assert (row["before_events"], row["after_events"]) == (copies_before[kind], n), (kind, row)
