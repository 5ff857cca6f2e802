"""diff's false alarms measured at length, and its gate on broad regressions with one run a
side.

- Every pair of eleven runs of one command (55 comparisons of one run a side) and ten of five
  runs a side: what diff calls significant.
- The gate, `--fail-above 5%`, one run a side, with this command's run-to-run spread
  calibrated from six other runs of it (`profinfer calibrate --spread-of`): exit 1 (a failure)
  in at most one of the 55 pairs; and exit 1 against a model whose every matmul is ~27%
  larger and against a build whose CPU backend (libggml-cpu) is compiled at -O0, where
  without the calibration (one run a side cannot tell a slower build from a slower run) it
  is inconclusive (exit 3).

- `-t 2` against `-t 1` on the 1.5B model (timed runs of a model of 3 GB: here, not in the
  default tier): no op row fails the gate where tokens came faster.

Its figures go to bench/results.md."""
from __future__ import annotations

import dataclasses
import itertools
import json
import os
import random
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import PROFINFER, completion_cmd, llama_perf
from profinfer.engines.llamacpp import workload
from test_diff import BASE, REPEATS, SIDE, _alarms, _diff, _record, _rows, models  # noqa: F401 (a fixture)

CALIBRATION_RUNS = 6
# every matmul ~27% larger: n_embd and n_ff 12.5% wider (heads of 72, not 64)
LARGER = dataclasses.replace(BASE, n_embd=432, n_ff=1296)


@pytest.fixture(scope="module")
def base_runs(llama_build, llama_env, models, tmp_path_factory):
    d = tmp_path_factory.mktemp("base")
    return [_record(llama_build, models["base"], llama_env, d / f"base{i}.pftrace") for i in range(REPEATS + 1)]


def test_the_same_command_again_shows_no_significant_change(base_runs):
    """Every pair of the 11 runs of one command and build (55 comparisons of one run a
    side), and ten of five runs against five others: at most one in ten may report a
    significant change at 95% (the false-alarm bound diff's docs state), and each says nothing
    differs. Every pair, not ten: one odd run (an op twice its usual time, its memory placed
    so for the whole process) would make two of ten neighbouring pairs alarm at once."""
    pairs = list(itertools.combinations(base_runs, 2))
    single = _alarms(pairs)
    print(f"one run a side: false alarms in {len(single)} of {len(pairs)}: {single}")
    rng = random.Random(1)
    groups = []
    for _ in range(REPEATS):
        six = rng.sample(base_runs, 2 * SIDE)
        groups.append((six[:SIDE], six[SIDE:]))
    pooled = _alarms(groups)
    print(f"five runs a side: false alarms in {len(pooled)} of {REPEATS}: {pooled}")
    assert len(single) <= len(pairs) // 10 and len(pooled) <= REPEATS // 10, (single, pooled)


@pytest.fixture(scope="module")
def calibrated(llama_build, llama_env, models, tmp_path_factory) -> dict:
    """A cache directory of its own holding the base command's spread, measured from
    CALIBRATION_RUNS runs of it (not the runs judged); the environment that uses it."""
    d = tmp_path_factory.mktemp("spread")
    runs = [_record(llama_build, models["base"], llama_env, d / f"cal{i}.pftrace") for i in range(CALIBRATION_RUNS)]
    env = {**os.environ, "PROFINFER_CACHE": str(d / "cache")}
    p = subprocess.run([*PROFINFER, "calibrate", "--spread-of", ",".join(map(str, runs))], env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    print(p.stdout)
    return env


def _gate(a: Path, b: Path, env: dict) -> tuple[int, dict]:
    out = a.parent / f"gate-{a.stem}-{b.stem}.json"
    p = subprocess.run([*PROFINFER, "diff", str(a), str(b), "--fail-above", "5%", "--json", str(out)],
                       env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode in (0, 1, 3), p.stderr
    return p.returncode, json.loads(out.read_text())


def test_with_the_spread_calibrated_the_gate_fails_at_most_one_pair_in_fifty(base_runs, calibrated):
    """The 55 pairs of one command's runs, one run a side, `--fail-above 5%` with the
    calibrated spread: at most one exits 1."""
    codes = []
    for a, b in itertools.combinations(base_runs, 2):
        code, result = _gate(a, b, calibrated)
        assert any("run-to-run spread over" in w for w in result["warnings"]), result["warnings"]
        codes.append(code)
    print(f"one run a side, spread calibrated: exits {sorted(codes)}")
    assert codes.count(1) <= 1, codes


def _o0_cpu_backend(llama_build: Path) -> Path:
    """A directory holding libggml-cpu built at -O0 from the build's own source (once, in
    the cache beside the build): put first on LD_LIBRARY_PATH, every op of the CPU backend
    runs slower, the rest of the build as it was."""
    root = llama_build.parent.parent / f"{llama_build.parent.name}-O0-cpu"
    lib = root / "build" / "bin" / "libggml-cpu.so.0"
    if not lib.exists():
        cfg = ["cmake", "-S", str(llama_build.parent / "src"), "-B", str(root / "build"),
               "-DCMAKE_BUILD_TYPE=None", "-DCMAKE_C_FLAGS=-O0 -g", "-DCMAKE_CXX_FLAGS=-O0 -g",
               "-DBUILD_SHARED_LIBS=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
               "-DLLAMA_BUILD_SERVER=OFF", "-DGGML_NATIVE=ON"] + (["-G", "Ninja"] if shutil.which("ninja") else [])
        subprocess.run(cfg, check=True, capture_output=True, timeout=600)
        subprocess.run(["cmake", "--build", str(root / "build"), f"-j{len(os.sched_getaffinity(0))}",
                        "--target", "ggml-cpu"], check=True, capture_output=True, timeout=1800)
    only = root / "only"
    only.mkdir(exist_ok=True)
    shutil.copy2(lib.resolve(), only / "libggml-cpu.so.0")
    return only


def test_one_run_a_side_broad_regressions_with_the_calibrated_gate(llama_build, llama_env, models, base_runs,
                                                                   calibrated, tmp_path):
    """One run a side against a base run: the base model on a build whose CPU backend is
    compiled at -O0, and a model whose every matmul is ~27% larger. With the spread
    calibrated, `--fail-above 5%` exits 1 on the -O0 build (its time per token a failing
    row); without it its time per token is inconclusive (the parts' common change covers a
    change of most of the work). The larger model is never a pass: it fails where the
    change lies beyond what two runs differ by chance here, else it is inconclusive; which
    one, and the spread, are printed for bench/results.md."""
    larger = tmp_path / "larger.gguf"
    workload.write_model("diff-larger", LARGER, larger)
    slow_env = {**llama_env, "LD_LIBRARY_PATH": f"{_o0_cpu_backend(llama_build)}:{llama_env['LD_LIBRARY_PATH']}"}
    o0 = _record(llama_build, models["base"], slow_env, tmp_path / "o0.pftrace")
    bigger = _record(llama_build, larger, llama_env, tmp_path / "larger.pftrace")
    uncalibrated = {**os.environ, "PROFINFER_CACHE": str(tmp_path / "empty-cache")}
    before = base_runs[len(base_runs) // 2]
    for what, run in (("-O0 CPU backend", o0), ("larger matmuls", bigger)):
        code, result = _gate(before, run, calibrated)
        token = next(c for c in result["changes"] if c["name"] == "decode time per token")
        print(f"{what}: exit {code}, decode time per token {token['change']:+.1%} "
              f"({token['low']:+.1%}..{token['high']:+.1%}), spread sd {token['spread']:.1%}")
        assert code in (1, 3), (what, result["gate"], token)
        if what == "-O0 CPU backend":
            assert code == 1 and result["only_build_differs"], (result["gate"], result["differences"])
            assert any(r["name"] == "decode time per token" for r in result["gate"]["rows"]), result["gate"]
        code, result = _gate(before, run, uncalibrated)
        print(f"{what}, no spread calibrated: exit {code}: {[(r['name'], r['verdict']) for r in result['gate']['rows']]}")
        token = next(r for r in result["gate"]["rows"] if r["name"] == "decode time per token")
        assert code in (1, 3) and token["verdict"] == "inconclusive", (what, result["gate"])


def test_two_threads_against_one_fail_no_op_where_tokens_came_faster(llama_build, llama_env, big_model,
                                                                      tmp_path):
    """The 1.5B model's memory-bound decode, -t 1 against -t 2, one run a side, the default 5%
    gate: a second thread makes the tokens come faster (here ~30%) while the ops' CPU time
    summed over the threads grows (MUL_MAT's by ~37%: its share of each op, its waits). The
    ops' rows say CPU time, the wall judges: no op fails where the time per token (the wall
    a user waits) lies wholly below the limit (before, MUL_MAT failed: exit 1)."""
    runs, per_token = [], []
    for t in (1, 2):
        runs.append(tmp_path / f"t{t}.pftrace")
        rec = subprocess.run([*PROFINFER, "record", "--quiet", "-o", str(runs[-1]), "--",
                              *completion_cmd(llama_build, big_model, n=12, threads=t)],
                             capture_output=True, text=True, env=llama_env, timeout=600)
        assert rec.returncode == 0, rec.stderr[-2000:]
        ms, n = llama_perf(rec.stderr)["eval"]
        per_token.append(ms / n)
    p, gated = _diff(*runs, "--fail-above", "5%")
    rows = _rows(gated)
    decode = rows["decode time per token"]
    ops = {r["name"]: round(r["change"], 3) for r in gated["changes"]
           if r["section"] == "op" and r["name"].startswith("decode ") and r["change"] is not None}
    print(f"decode time per token {decode['change']:+.1%} ({decode['low']:+.1%}..{decode['high']:+.1%}); "
          f"decode ops {ops}; failed {gated['failed']}")
    # the truth this test needs: the second thread made decode faster, by llama.cpp's own
    # eval time per token (printed by each run), and so by the row the gate judges
    print(f"llama.cpp's eval per token: -t 1 {per_token[0]:.1f} ms, -t 2 {per_token[1]:.1f} ms")
    assert per_token[1] < 0.9 * per_token[0] and decode["high"] < 0.05, (per_token, decode)
    assert not any(rows[f["name"]]["section"] == "op" for f in gated["failed"]), gated["failed"]
    assert p.returncode != 1, p.stdout + p.stderr
