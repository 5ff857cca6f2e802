"""Roofline: cost model and verdicts (pure), then the physics
on the real 1.5B model: batch-1 decode MUL_MAT is memory-bound, a 512-token prefill's is not."""
from __future__ import annotations

import gguf
import numpy as np
import pytest

from conftest import completion_cmd, run_profinfer, with_llama_log
from profinfer.core.calibration import machine_roofs, loadcheck
from profinfer.core.calibration.loadcheck import UnreliableMeasurement
from profinfer.core.profile.model import GraphCall, OpSlice, Profile, TokenCall
from profinfer.engines.llamacpp.views.nodes import node_runs
from profinfer.core.calibration.roofline import CacheRoof, Cost, Roofs, SourceReuse, judge_costs
from profinfer.engines.llamacpp.views.cost import judge, nbytes, node_cost, reuse_by_run, reuse_of, verdicts
from profinfer.exporters.trace_reader import read_trace


def run(op, ne, srcs, dtype="f32", dur=1000):
    from profinfer.engines.llamacpp.views.nodes import NodeRun
    from profinfer.core.profile.opcolumns import NodeDesc
    return NodeRun(0, NodeDesc(op, "t", ne, dtype, 1, (), (), 0, tuple(s[0] for s in srcs),
                               tuple(s[1] for s in srcs)), 0, dur, 1, dur)


def test_block_formats():
    assert nbytes((4096, 4096), "f16") == 4096 * 4096 * 2
    assert nbytes((4096, 1), "q4_0") == 4096 / 32 * 18
    assert nbytes((256,), "q4_k") == 144


def test_matmul_cost():
    # W [K=2048, M=8192] f16 times x [2048, N] f32
    for n in (1, 512):
        c = node_cost(run("MUL_MAT", (8192, n, 1, 1), [((2048, 8192, 1, 1), "f16"), ((2048, n, 1, 1), "f32")]))
        assert c.flops == 2 * 2048 * 8192 * n
        assert c.bytes == 2048 * 8192 * 2 + 2048 * n * 4 + 8192 * n * 4
    assert node_cost(run("MUL_MAT", (8192, 1, 1, 1), [])) is None   # sources unknown: no guess


def test_flash_attention_and_rows_costs():
    c = node_cost(run("FLASH_ATTN_EXT", (64, 32, 1, 1), [((64, 1, 32, 1), "f32"), ((64, 256, 8, 1), "f16")]))
    assert c.flops == 4 * 64 * 1 * 256 * 32
    # SET_ROWS writes src0's rows into the cache, not the whole cache
    c = node_cost(run("SET_ROWS", (512, 2048, 1, 1), [((512, 1, 1, 1), "f32")], dtype="f16"))
    assert c.bytes == 512 * 4 + 512 * 2


def test_verdicts():
    roofs = Roofs(peak_gflops=100.0, peak_gbps=10.0)             # ridge 10 FLOP/B
    mm = [((2048, 8192, 1, 1), "f16"), ((2048, 1, 1, 1), "f32")]
    w_bytes = 2048 * 8192 * 2
    fast = run("MUL_MAT", (8192, 1, 1, 1), mm, dur=int(w_bytes / 9.0))       # ~9 GB/s
    slow = run("MUL_MAT", (8192, 1, 1, 1), mm, dur=int(w_bytes / 1.0))       # ~1 GB/s
    assert judge("d", [fast], roofs).bound == "memory"
    assert judge("d", [slow], roofs).bound == "neither"
    mm512 = [((2048, 8192, 1, 1), "f16"), ((2048, 512, 1, 1), "f32")]
    flops = 2 * 2048 * 8192 * 512
    big = run("MUL_MAT", (8192, 512, 1, 1), mm512, dur=int(flops / 80.0))    # 80 GFLOP/s
    v = judge("p", [big], roofs)
    assert v.bound == "compute" and 0.75 < v.roof_share < 0.85 and v.intensity > roofs.ridge


def test_hierarchical_verdicts():
    """An op faster than DRAM is judged against the slowest cache roof that can deliver its
    GB/s, never shown above 100% of it unless it beats every roof (then said plainly)."""
    caches = (CacheRoof("L1", 300.0, 64 << 10), CacheRoof("L2", 200.0, 2 << 20), CacheRoof("L3", 150.0, 32 << 20))
    roofs = Roofs(peak_gflops=200.0, peak_gbps=25.0, caches=caches)      # ridge 8 FLOP/B

    def at(gbps, intensity=1.0):
        return judge_costs("d", [(Cost(intensity * gbps * 1e6, gbps * 1e6), 1_000_000, None)], roofs)

    v = at(20.0)                                   # below DRAM's roof: judged against it
    assert (v.roof, v.roof_gbps, v.bound, v.notes) == ("DRAM", 25.0, "memory", [])
    assert v.roof_share == pytest.approx(0.8)
    v = at(100.0)                                  # past DRAM: L3 bounds it
    assert (v.roof, v.roof_gbps, v.bound) == ("L3", 150.0, "memory")
    assert v.roof_share == pytest.approx(100 / 150) and v.notes == ["above the DRAM roof: cache-resident (L3)"]
    v = at(160.0)                                  # past L3: L2
    assert (v.roof, v.roof_share) == ("L2", pytest.approx(0.8))
    v = at(26.0)                                   # past DRAM within its margin: at it
    assert (v.roof, v.bound, v.roof_share) == ("DRAM", "memory", pytest.approx(1.04))
    assert v.notes == ["at the DRAM roof: past it by 4.0%, within 10% of the read benchmark"]
    v = at(35.0)                                   # past DRAM but far under L3: not bandwidth-bound
    assert (v.roof, v.bound) == ("L3", "neither") and "cache-resident (L3)" in v.notes[0]
    v = at(400.0)                                  # beats even L1: the only share above 100%
    assert (v.roof, v.roof_share) == ("L1", pytest.approx(400 / 300))
    assert "above every measured roof" in v.notes[0]
    v = at(2.0, intensity=50.0)                    # compute side (100 GFLOP/s): no bandwidth roof
    assert (v.roof, v.roof_gbps, v.bound, v.notes) == ("compute", None, "compute", [])
    assert v.roof_share == pytest.approx(0.5)


def test_residency_from_where_the_sources_were_touched():
    """Where the engine says how long ago an op's sources were touched, that decides which
    roof can bound it, not its speed: data touched longer ago than every cache holds is read
    from DRAM however far past that roof it runs; data that fits a cache is judged against it
    even past the DRAM margin, and never against a smaller cache it does not fit."""
    caches = (CacheRoof("L1", 300.0, 64 << 10), CacheRoof("L2", 200.0, 2 << 20), CacheRoof("L3", 150.0, 32 << 20))
    roofs = Roofs(peak_gflops=200.0, peak_gbps=25.0, caches=caches)

    def at(gbps, distances, sizes):
        reuse = SourceReuse(np.array(distances, float), np.array(sizes, float))
        return judge_costs("d", [(Cost(gbps * 1e6, gbps * 1e6), 1_000_000, None)], roofs, reuse=reuse)

    weights = ([3e9, 3.1e9, 5e3], [30e6, 30e6, 8e3])       # read a graph (3 GB) before
    v = at(40.0, *weights)                 # 60% past DRAM: still DRAM's, and said why
    assert (v.roof, v.roof_gbps, v.bound) == ("DRAM", 25.0, "memory") and v.roof_share == pytest.approx(1.6)
    assert v.notes == ["at the DRAM roof: past it by 60.0%, yet 100% of the bytes it reads were last "
                       "touched more than L3's 32 MiB before: no cache measured holds them"]
    small = ([6e6, 6e6, 1e3], [1e6, 1e6, 1e3])             # a 6 MB model: L3 holds it, L2 does not
    v = at(40.0, *small)
    assert (v.roof, v.bound, v.notes) == ("L3", "neither", ["above the DRAM roof: cache-resident (L3)"])
    v = at(26.0, *small)                   # within DRAM's margin: fits L3, so L3's (no margin rule)
    assert v.roof == "L3"
    v = at(180.0, *small)                  # faster than L3, yet L2 cannot hold it: not L2's
    assert v.roof == "L3" and v.roof_share == pytest.approx(1.2)
    assert "above every measured roof that could hold its data" in v.notes[0]
    v = at(20.0, *weights)                 # under DRAM's roof: DRAM's, no note
    assert (v.roof, v.notes) == ("DRAM", [])


def test_reuse_distances_follow_tensors_across_graphs():
    """A weight read in every graph is touched again after what every other node of the graph
    moved; an activation, after what moved since the node that wrote it (read through a view:
    its root); each after its own bytes too."""
    w, a, b, view = 0x100, 0x200, 0x300, 0x400
    wne, ane = (64, 64, 1, 1), (64, 1, 1, 1)
    graphs = [GraphCall(1, 0, 100, "CPU", 1), GraphCall(1, 200, 300, "CPU", 1)]
    ops = []
    for g0 in (0, 200):
        # b = W x a (a 64x64 f32 weight: 16 KiB), then a = b + b read through a view of b
        ops.append(OpSlice(1, 0, g0 + 10, g0 + 20, g0 + 20, "MUL_MAT", "mm", ane, "f32", tensor=b,
                           srcs=(w, a, 0), src_views=(0, 0, 0), src_ne=(wne, ane), src_dtypes=("f32", "f32")))
        ops.append(OpSlice(1, 0, g0 + 30, g0 + 40, g0 + 40, "ADD", "add", ane, "f32", tensor=a,
                           srcs=(view, view, 0), src_views=(b, b, 0), src_ne=(ane, ane), src_dtypes=("f32", "f32")))
    runs, _ = node_runs(Profile(pid=1, graphs=graphs, ops=ops, tokens=[TokenCall(1, 0, 400, 1, False)]))
    reads = reuse_by_run(runs)
    w_bytes, a_bytes = 64 * 64 * 4, 64 * 4
    add_bytes = 3 * a_bytes                              # b twice, a written: the cost model's moves
    # first graph: W and a never touched before (inf); second: W last read before the first
    # ADD's moves, a written by that ADD just before; each plus its own bytes (read in order)
    assert [r[0] for r in reads] == [[np.inf, np.inf], [a_bytes, a_bytes],
                                             [add_bytes + w_bytes, a_bytes], [a_bytes, a_bytes]]
    mm = reuse_of((r, rd) for r, rd in zip(runs, reads) if r.op == "MUL_MAT")
    # a verdict's distances: the sources touched before (the second graph's)
    assert mm.distances.tolist() == [add_bytes + w_bytes, a_bytes]
    assert mm.bytes.tolist() == [w_bytes, a_bytes]
    assert mm.share_within(add_bytes + w_bytes) == 1.0
    assert mm.share_within(add_bytes + w_bytes - 1) == pytest.approx(a_bytes / (w_bytes + a_bytes))
    # a recording that begins with its node: where its data was is not known
    assert reuse_of([(runs[0], reads[0])]) is None


def test_reuse_of_fused_results_third_sources_and_experts():
    """A fused node's result is its second op's tensor; a third source (FLASH_ATTN_EXT's V,
    whose shape is not read) is touched though not counted; MUL_MAT_ID reads the experts it
    uses, as its cost says."""
    x, g, f, wq, q, k, v, kv, vv, out, ex, ids, y = range(0x10, 0x1D)
    row = (64, 1, 1, 1)
    f32 = ("f32", "f32")
    ops = [OpSlice(1, 0, 10, 20, 20, "RMS_NORM+MUL", "norm", row, "f32", tensor=0x30, fused_tensor=f,
                   srcs=(x, g), src_views=(0, 0), src_ne=(row, row), src_dtypes=f32),
           OpSlice(1, 0, 30, 40, 40, "MUL_MAT", "q", row, "f32", tensor=q,
                   srcs=(wq, f), src_views=(0, 0), src_ne=((64, 64, 1, 1), row), src_dtypes=f32),
           OpSlice(1, 0, 50, 60, 60, "FLASH_ATTN_EXT", "fa", row, "f32", tensor=out,
                   srcs=(q, kv, vv), src_views=(0, k, v), src_ne=(row, (64, 4, 1, 1)), src_dtypes=f32),
           OpSlice(1, 0, 70, 80, 80, "CPY", "v copy", (64, 4, 1, 1), "f32", tensor=y,
                   srcs=(vv,), src_views=(v,), src_ne=((64, 4, 1, 1),), src_dtypes=("f32",)),
           OpSlice(1, 0, 90, 100, 100, "MUL_MAT_ID", "experts", (64, 2, 1, 1), "f32", tensor=0x40,
                   srcs=(ex, out, ids), src_views=(0, 0, 0), src_ne=((64, 64, 8, 1), row), src_dtypes=f32)]
    runs, _ = node_runs(Profile(pid=1, graphs=[GraphCall(1, 0, 200, "CPU", 1)], ops=ops,
                                tokens=[TokenCall(1, 0, 200, 1, False)]))
    reads = dict(zip((r.name for r in runs), reuse_by_run(runs)))
    assert reads["q"][0][1] == 64 * 4                         # the norm's fused MUL wrote it
    assert reads["v copy"] == ([64 * 4 * 4], [64 * 4 * 4])    # V: read by the attention just before
    fa_cost = node_cost(next(r for r in runs if r.name == "fa"))
    assert reads["fa"][1] == [64 * 4, 64 * 4 * 4] and fa_cost.bytes == 64 * 4 + 2 * 64 * 4 * 4 + 64 * 4
    experts = next(r for r in runs if r.name == "experts")
    assert reads["experts"][1] == [2 * 64 * 64 * 4, 64 * 4]  # 2 of its 8 experts, and its input
    assert node_cost(experts).bytes == sum(reads["experts"][1]) + 64 * 2 * 4


def test_above_dram_without_cache_roofs():
    """Roofs cached before the caches were measured: DRAM's roof, and the verdict says why its
    share passes 100%."""
    v = judge_costs("d", [(Cost(40e6, 40e6), 1_000_000, None)], Roofs(peak_gflops=200.0, peak_gbps=25.0))
    assert (v.roof, v.roof_gbps) == ("DRAM", 25.0) and v.roof_share == pytest.approx(1.6)
    assert "cache roofs were not measured" in v.notes[0]


def test_node_runs_merge_threads_within_a_graph():
    g = [GraphCall(1, 0, 100, "CPU", 2), GraphCall(1, 200, 300, "CPU", 2)]
    ops = [OpSlice(1, 0, 10, 30, 40, "MUL_MAT", "a", (1, 1, 1, 1), "f32", tensor=0xA),
           OpSlice(2, 1, 12, 35, 40, "MUL_MAT", "a", (1, 1, 1, 1), "f32", tensor=0xA),
           OpSlice(1, 0, 40, 50, 60, "ADD", "b", (1, 1, 1, 1), "f32", tensor=0xB),
           OpSlice(1, 0, 210, 230, 240, "MUL_MAT", "a", (1, 1, 1, 1), "f32", tensor=0xA)]
    runs, graphs = node_runs(Profile(pid=1, graphs=g, ops=ops, tokens=[TokenCall(1, 0, 400, 1, False)]))
    assert [(r.graph, r.tensor, r.start_ns, r.end_ns, r.threads, r.thread_ns) for r in runs] == [
        (0, 0xA, 10, 35, 2, 43), (0, 0xB, 40, 50, 1, 10), (1, 0xA, 210, 230, 1, 20)]


@pytest.fixture(scope="session")
def roofs():
    """This machine's checked roofs, measured now if setup could not cache them (busy then)."""
    if machine_roofs.cached(2) is None:
        loadcheck.wait_until_quiet(300)
    try:
        machine_roofs.calibrate(2, attempts=6)
    except UnreliableMeasurement as e:
        pytest.fail(f"no trustworthy roofs to judge against: {e}")
    return machine_roofs.cached_roofs(2)


def decode_matmul_past_dram(trace, dec: dict, caches: list[dict], peak_gflops: float):
    """The trace's decode MUL_MAT judged again against roofs that put DRAM's at half its GB/s
    (`dec`: its verdict in the summary) and every cache's (their capacities as `caches` say)
    far above it, slower the larger: where its data is read from is then all that decides."""
    cache_roofs = tuple(CacheRoof(c["level"], 10 * dec["gbps"] * (len(caches) - i), c["bytes"])
                        for i, c in enumerate(caches))
    low = Roofs(peak_gflops=peak_gflops, peak_gbps=dec["gbps"] / 2, caches=cache_roofs)
    (far,) = [v for v in verdicts(read_trace(trace), low) if v.scope == "decode MUL_MAT"]
    return far


def test_calibrated_roofs_are_physical(roofs):
    assert 1 < roofs.peak_gbps < 2000 and 1 < roofs.peak_gflops < 100_000


def test_decode_matmul_memory_bound_prefill_not(llama_build, big_model, llama_env, tmp_path, roofs):
    """On the 1.5B F16 model: 2 threads, a prompt of at least 128 tokens (a matmul over 128
    tokens reads each weight once for 128 of them: far past the ridge), 8 decodes."""
    words = "the and of to in is that it for on with as was at by this from".split()
    prompt = " ".join(words[i % len(words)] for i in range(140))   # one token a word in our vocab
    r = with_llama_log(lambda: run_profinfer(
        # verdicts need every node's shapes (-o; without a timeline ops are counted per type)
        ["record", "--quiet", "-o", str(tmp_path / "t.pftrace"), "--",
         *completion_cmd(llama_build, big_model, n=8, prompt=prompt,
                                                    extra=("-b", "128", "-ub", "128"))],
        env=llama_env, tmp_path=tmp_path, timeout=900))
    assert r.rc == 0, r.stderr[-2000:]
    s = r.summary
    assert s["tokens"]["prefill"] >= 128
    v = {x["scope"]: x for x in s["roofline"]["verdicts"]}
    dec, pre = v["decode MUL_MAT"], v["prefill MUL_MAT"]
    assert dec["bound"] == "memory", dec
    # its weights (the GGUF's tensors) are larger than any cache: read from DRAM, whatever its
    # GB/s against the read benchmark's roof, and said so when past it
    weights = sum(int(t.n_bytes) for t in gguf.GGUFReader(big_model).tensors)
    caches = s["roofline"]["roofs"]["caches"]
    assert caches and all(weights > c["bytes"] for c in caches)
    assert dec["roof"] == "DRAM", dec
    assert not dec["notes"] or dec["notes"][0].startswith("at the DRAM roof: past it by"), dec
    # and however far past DRAM's roof it ran: the same run against roofs that put DRAM's at
    # half its GB/s and every cache's far above it
    far = decode_matmul_past_dram(tmp_path / "t.pftrace", dec, caches, roofs.peak_gflops)
    assert (far.roof, far.roof_share) == ("DRAM", pytest.approx(2.0)), far
    assert far.notes[0].startswith("at the DRAM roof: past it by 100.0%, yet "), far
    assert pre["bound"] != "memory" and pre["intensity"] > s["roofline"]["roofs"]["ridge"], pre


def test_cross_check_with_llc_misses():
    """Where the PMU counts LLC load misses, each verdict carries the DRAM bandwidth they imply."""
    from profinfer.engines.llamacpp.views.cost import verdicts
    mm = dict(srcs=(0xA, 0xB), src_views=(0, 0), src_ne=((2048, 8192, 1, 1), (2048, 1, 1, 1)),
              src_dtypes=("f16", "f32"))
    ops = [OpSlice(1, 0, 0, 1_000_000, 1_000_000, "MUL_MAT", "x-0", (8192, 1, 1, 1), "f32", 0xC,
                   counters=(100_000.0, 5.0), **mm),
           OpSlice(2, 1, 0, 800_000, 1_000_000, "MUL_MAT", "x-0", (8192, 1, 1, 1), "f32", 0xC,
                   counters=(50_000.0, 1.0), **mm)]
    p = Profile(pid=1, graphs=[GraphCall(1, 0, 2_000_000, "CPU", 1)], ops=ops,
                tokens=[TokenCall(1, 0, 2_000_000, 1, False)],
                counter_names=["LLC-load-misses", "page-faults"])
    (v,) = verdicts(p, Roofs(peak_gflops=100.0, peak_gbps=10.0))
    assert v.scope == "decode MUL_MAT"
    assert v.measured_gbps == pytest.approx(150_000 * 64 / 1_000_000)   # lines × 64 B / node time
    p.counter_names = ["task-clock", "page-faults"]
    p.__dict__.pop("_derived", None)
    assert verdicts(p, Roofs(100.0, 10.0))[0].measured_gbps is None
