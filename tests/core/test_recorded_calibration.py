"""A recording keeps the roofs and probe trap costs that judge it: reports of a saved trace use
the trace's own, whatever this machine's calibration says now, and fall back to this
machine's only with a note."""
from __future__ import annotations

import json
import os

import pytest

from conftest import completion_cmd, run_profinfer

from profinfer.core.ebpf import bpfobj
from profinfer.core.calibration import machine_roofs, probecost, stamped
from profinfer.exporters.json_summary import summary
from profinfer.exporters.perfetto import write_perfetto
from profinfer.exporters.trace_reader import read_trace
from profinfer.core.profile.model import GraphCall, OpSlice, Profile, TokenCall


def calibration_cache(path, read_gbps, fma_gflops, emulated_ns, threads=2, caches=None):
    """A cache directory holding a checked calibration with these figures (`caches`: the
    entry's cache roofs; None: an entry cached before they were measured)."""
    path.mkdir()
    roofs = {"threads": threads, "read_gbps": read_gbps, "triad_gbps": read_gbps, "fma_gflops": fma_gflops,
             "check": "test entry", "measured_at": "2000-01-01T00:00:00",
             **({} if caches is None else {"caches": caches})}
    (path / "roofs.json").write_text(json.dumps({machine_roofs._key(threads): roofs}))
    costs = {"emulated_ns": emulated_ns, "stepped_ns": 4 * emulated_ns, "uretprobe_extra_ns": 100.0,
             "check": "test entry", "measured_at": "2000-01-01T00:00:00"}
    (path / "probecost.json").write_text(json.dumps({probecost._key(): costs}))
    # the compiled BPF objects, so that recording under this cache does not rebuild them
    os.symlink(bpfobj.cache_dir(), path / "bpf")
    return path


def decode_profile(graphs: int = 1) -> Profile:
    """`graphs` decode calls of one 1 ms matmul of the same weights, on two threads."""
    mm = dict(srcs=(0xA, 0xB), src_views=(0, 0), src_ne=((2048, 8192, 1, 1), (2048, 1, 1, 1)),
              src_dtypes=("f16", "f32"))
    at = [2_000_000 * g for g in range(graphs)]
    ops = [OpSlice(tid, tid, t, t + 1_000_000, t + 1_000_000, "MUL_MAT", "x-0", (8192, 1, 1, 1), "f32", 0xC, **mm)
           for t in at for tid in (1, 2)]
    return Profile(pid=1, graphs=[GraphCall(1, t, t + 2_000_000, "CPU", 1) for t in at], ops=ops,
                   tokens=[TokenCall(1, t, t + 2_000_000, 1, False) for t in at],
                   meta={"cost:bpf_ns": "1000", "cost:bpf_runs": "10", "cost:hits_emulated": "10",
                         "target_cpu_s": "1.0"})


def test_stored_calibration_round_trips(tmp_path, monkeypatch):
    recorder = calibration_cache(tmp_path / "recorder", 11.0, 110.0, 1000.0)
    reader = calibration_cache(tmp_path / "reader", 33.0, 330.0, 3000.0)
    monkeypatch.setenv("PROFINFER_CACHE", str(recorder))
    p = decode_profile()
    stamped.stamp(p)
    write_perfetto(p, tmp_path / "t.pftrace")

    monkeypatch.setenv("PROFINFER_CACHE", str(reader))
    s = summary(read_trace(tmp_path / "t.pftrace"))
    roofs = s["roofline"]["roofs"]
    assert (roofs["peak_gbps"], roofs["peak_gflops"], roofs["stored_in_trace"]) == (11.0, 110.0, True)
    cost = s["profiler_cost"]
    assert cost["hit_costs_ns"]["emulated"] == 1000.0 and cost["hit_costs"]["stored_in_trace"]
    assert s["meta"]["roofs:check"] == "test entry"

    old = decode_profile()                    # a trace that stores none: this machine's, said so
    write_perfetto(old, tmp_path / "old.pftrace")
    s = summary(read_trace(tmp_path / "old.pftrace"))
    roofs = s["roofline"]["roofs"]
    assert (roofs["peak_gbps"], roofs["stored_in_trace"]) == (33.0, False)
    assert "stores no roofs" in roofs["origin"]
    assert s["profiler_cost"]["hit_costs_ns"]["emulated"] == 3000.0
    assert not s["profiler_cost"]["hit_costs"]["stored_in_trace"]


def test_cache_roofs_round_trip(tmp_path, monkeypatch):
    """The cache roofs go into the trace and judge it there; a calibration without them judges
    with DRAM's roof alone and says the caches were not measured."""
    caches = [{"level": "L2", "gbps": 60.0, "bytes": 2 << 20, "working_set_bytes": 1 << 19},
              {"level": "L3", "gbps": 40.0, "bytes": 64 << 20, "working_set_bytes": 16 << 20}]
    recorder = calibration_cache(tmp_path / "recorder", 11.0, 110.0, 1000.0, caches=caches)
    reader = calibration_cache(tmp_path / "reader", 33.0, 330.0, 3000.0)
    monkeypatch.setenv("PROFINFER_CACHE", str(recorder))
    # 33.6 MB of F16 weights in 1 ms: 33.6 GB/s; read again each call, which L3 holds
    p = decode_profile(graphs=3)
    stamped.stamp(p)
    write_perfetto(p, tmp_path / "t.pftrace")

    monkeypatch.setenv("PROFINFER_CACHE", str(reader))
    roofline = summary(read_trace(tmp_path / "t.pftrace"))["roofline"]
    assert roofline["roofs"]["caches"] == [{"level": "L2", "gbps": 60.0, "bytes": 2 << 20},
                                           {"level": "L3", "gbps": 40.0, "bytes": 64 << 20}]
    (v,) = roofline["verdicts"]
    assert (v["roof"], v["roof_gbps"], v["bound"]) == ("L3", 40.0, "memory")
    assert v["roof_share"] == pytest.approx(v["gbps"] / 40.0) and v["roof_share"] <= 1
    assert v["notes"] == ["above the DRAM roof: cache-resident (L3)"]

    monkeypatch.setenv("PROFINFER_CACHE", str(recorder))
    old = decode_profile()
    old.meta.update({"roofs:fma_gflops": "110.0", "roofs:read_gbps": "11.0"})   # stamped before caches
    write_perfetto(old, tmp_path / "old.pftrace")
    roofline = summary(read_trace(tmp_path / "old.pftrace"))["roofline"]
    assert roofline["roofs"]["caches"] == [] and "cache roofs were not measured" in roofline["roofs"]["origin"]
    (v,) = roofline["verdicts"]
    assert (v["roof"], v["roof_gbps"]) == ("DRAM", 11.0) and v["roof_share"] > 1
    assert "cache roofs were not measured" in v["notes"][0]


def test_report_and_graph_of_a_trace_use_its_roofs(llama_build, tiny_model, llama_env, tmp_path):
    recorder = calibration_cache(tmp_path / "recorder", 11.0, 110.0, 1000.0)
    reader = calibration_cache(tmp_path / "reader", 33.0, 330.0, 3000.0)
    trace = tmp_path / "run.pftrace"
    rec = run_profinfer(["record", "--quiet", "-o", str(trace), "--",
                         *completion_cmd(llama_build, tiny_model, n=8)],
                        env={**llama_env, "PROFINFER_CACHE": str(recorder)}, tmp_path=tmp_path)
    assert rec.rc == 0, rec.stderr[-2000:]
    assert rec.summary["roofline"]["roofs"]["peak_gbps"] == 11.0

    env = {**llama_env, "PROFINFER_CACHE": str(reader)}
    rep = run_profinfer(["report", str(trace)], env=env, tmp_path=tmp_path)
    assert rep.rc == 0, rep.stderr[-2000:]
    roofs = rep.summary["roofline"]["roofs"]
    assert (roofs["peak_gbps"], roofs["peak_gflops"], roofs["stored_in_trace"]) == (11.0, 110.0, True)
    assert rep.summary["profiler_cost"]["hit_costs_ns"]["emulated"] == 1000.0
    assert "11.0 GB/s read" in rep.stdout and "stored in the recording" in rep.stdout

    graph = run_profinfer(["graph", str(trace)], env=env, json_summary=False)
    assert graph.rc == 0, graph.stderr[-2000:]
    assert "against 11.0 GB/s and 110.0 GFLOP/s: roofs stored in the recording" in graph.stdout
