"""What profiling cost the target: the kernel's count of our programs, the measured cost of a
probe hit, and the shares derived from them."""
from __future__ import annotations

from pathlib import Path

from conftest import completion_cmd, run_profinfer

from profinfer.core.calibration import probecost, selfcost
from profinfer.core.profile.model import GraphCall, OpSlice, Profile

STATS_SYSCTL = Path("/proc/sys/kernel/bpf_stats_enabled")


def test_shares_from_counts():
    p = Profile(pid=1, meta={"cost:bpf_ns": "2000000", "cost:bpf_runs": "1000",
                             "cost:hits_emulated": "900", "cost:hits_stepped": "10",
                             "cost:hits_return": "100", "collector_cpu_decoding_s": "0.004",
                             "target_cpu_s": "1.0"})
    c = selfcost.compute(p, {"emulated_ns": 1000.0, "stepped_ns": 5000.0, "uretprobe_extra_ns": 500.0})
    assert c.trap_ns == 900 * 1000 + 10 * 5000 + 100 * 500            # 1.0 ms
    assert c.in_target_ns == 3_000_000                                 # + 2 ms of BPF
    assert abs(c.in_target_share - 0.003 / 0.997) < 1e-12              # of the time without it
    assert abs(c.collector_share - 0.004 / 0.997) < 1e-12
    uncalibrated = selfcost.compute(p, None)
    assert uncalibrated.trap_ns is None and uncalibrated.in_target_share is None
    assert selfcost.compute(Profile(pid=1), None) is None              # not counted: no claim


def test_the_probes_time_is_judged_against_the_threads_that_took_the_hits():
    """One thread calls every op while two others spin through the same time (vLLM's OpenMP
    pool): the probes' time is a share of the calling thread's time, not of all three's."""
    from profinfer.core.profile.model import OpCall
    meta = {"cost:bpf_ns": "0", "cost:bpf_runs": "300", "cost:hits_emulated": "100",
            "cost:hits_stepped": "0", "cost:hits_return": "100", "target_cpu_s": "3.0",
            "collector_cpu_decoding_s": "0.03", "threads_cpu_s": "10:1.00 11:1.00 12:1.00"}
    calls = [OpCall(1, 10, i, i + 1, "op") for i in range(100)]
    costs = {"emulated_ns": 2e6, "stepped_ns": 0.0, "uretprobe_extra_ns": 1e6}      # 0.3 s in all
    c = selfcost.compute(Profile(pid=1, meta=meta, calls=calls), costs)
    assert abs(c.in_target_share - 0.3 / 0.7) < 1e-9        # the caller's 1 s, 0.3 s of it probes
    assert abs(c.collector_share - 0.03 / 0.7) < 1e-9
    # its CPU not recorded (an older recording): the whole target's, as before
    old = selfcost.compute(Profile(pid=1, meta={k: v for k, v in meta.items() if k != "threads_cpu_s"},
                                   calls=calls), costs)
    assert abs(old.in_target_share - 0.3 / 2.7) < 1e-9
    # the collector delays the caller only while the caller waits for a CPU
    waited = selfcost.compute(Profile(pid=1, meta={**meta, "threads_waited_s": "10:0.01 11:0.5 12:0.5"},
                                      calls=calls), costs)
    assert abs(waited.collector_share - 0.01 / 0.7) < 1e-9
    # two threads sharing the hits alike, each against its own time
    calls2 = calls + [OpCall(1, 11, i, i + 1, "op") for i in range(100)]
    both = selfcost.compute(Profile(pid=1, meta=meta, calls=calls2), costs)
    assert abs(both.in_target_share - 0.15 / 0.85) < 1e-9


def _two_thread_graph(gap_ns: int) -> list[OpSlice]:
    """Two threads through 3 nodes; at each barrier the last to arrive starts the next node
    gap_ns after its barrier probe, the other waited there."""
    ops, t = [], 1000
    for node, (a, b) in enumerate([(400, 700), (900, 500), (300, 300)]):
        end_a, end_b = t + a, t + b
        for tid, end in ((1, end_a), (2, end_b)):
            ops.append(OpSlice(tid, tid - 1, t, end, end, "ADD", f"n{node}", (1, 1, 1, 1), "f32"))
        t = max(end_a, end_b) + gap_ns
    return ops


def test_trap_cost_in_situ_and_collector_in_the_threads_time():
    ops = _two_thread_graph(gap_ns=1200)
    meta = {"cost:bpf_ns": "0", "cost:bpf_runs": "12", "cost:hits_emulated": "12",
            "cost:hits_stepped": "0", "cost:hits_return": "0", "collector_cpu_decoding_s": "0.000001",
            "target_cpu_s": "0.000100", "cpus_online": "2", "engine": "llama.cpp"}
    p = Profile(pid=1, graphs=[GraphCall(1, 900, 9000, "CPU", 3)], ops=ops, meta=meta)
    c = selfcost.compute(p, {"emulated_ns": 500.0, "stepped_ns": 5000.0, "uretprobe_extra_ns": 500.0})
    # read by the engine's plugin (its accounting) where the recording does not hold it: the
    # last arriver's gap, not the waiter's
    assert c.trap_in_situ_ns == 1200
    added = 12 * 1200
    assert abs(c.in_target_share_in_situ - added / (100_000 - added)) < 1e-12
    # two compute threads on two CPUs: inside a graph compute the collector's CPU is taken out
    # of both threads' time (no tokens recorded here: all of the time counts as in graphs)
    assert c.collector_critical and abs(c.slowdown - (c.in_target_share_in_situ + 2 * c.collector_share)) < 1e-12
    # with half the decoding time outside graph computes, it delays one thread there
    from profinfer.core.profile.model import TokenCall
    half = selfcost.compute(Profile(pid=1, graphs=p.graphs, ops=ops, meta=meta,
                                    tokens=[TokenCall(1, 900 - 8100, 9000, 1, False)]),
                            {"emulated_ns": 500.0, "stepped_ns": 5000.0, "uretprobe_extra_ns": 500.0})
    assert abs(half.in_graphs - 0.5) < 1e-12 and abs(half.collector_factor - 1.5) < 1e-12
    spare = selfcost.compute(Profile(pid=1, graphs=p.graphs, ops=ops, meta={**meta, "cpus_online": "4"}),
                             {"emulated_ns": 500.0, "stepped_ns": 5000.0, "uretprobe_extra_ns": 500.0})
    assert not spare.collector_critical and spare.slowdown == spare.in_target_share_in_situ
    # without ops (token and graph levels) the compute threads are unknown: counted once
    no_ops = selfcost.compute(Profile(pid=1, graphs=p.graphs, ops=[], meta=meta),
                              {"emulated_ns": 500.0, "stepped_ns": 5000.0, "uretprobe_extra_ns": 500.0})
    assert no_ops.collector_factor == 1.0
    assert abs(no_ops.slowdown - (no_ops.in_target_share + no_ops.collector_share)) < 1e-12


def test_probe_costs_are_measured():
    c = probecost.measure()
    # a single-stepped instruction traps twice; an emulated one once
    assert 0 < c["emulated_ns"] < c["stepped_ns"] < 100_000
    assert c["uretprobe_extra_ns"] > 0


def test_kernel_counts_every_probe_hit(llama_build, tiny_model, llama_env, tmp_path):
    """The kernel's run counts of our programs match the events exactly: at token+graph level
    each llama_decode and each graph compute is one entry and one return."""
    before = STATS_SYSCTL.read_text()
    r = run_profinfer(["record", "--levels", "token,graph", "--",
                       *completion_cmd(llama_build, tiny_model, n=16)],
                      env=llama_env, tmp_path=tmp_path)
    assert r.rc == 0, r.stderr
    s = r.summary
    cost = s["profiler_cost"]
    calls = s["decode_calls"] + s["graphs"]
    # record's probes sit on the library files: hits in other processes using them (another
    # llama.cpp running here) are counted apart, and not charged to the target
    others = int(s["meta"].get("cost:other_process_hits", 0))
    assert cost["bpf_runs"] - others == 2 * calls
    assert cost["probe_hits"]["return"] == calls
    assert cost["probe_hits"]["emulated"] + cost["probe_hits"]["stepped"] == calls
    assert cost["bpf_ns"] > 0 and cost["target_cpu_ns"] > 0
    assert "profiler cost:" in r.stdout
    assert STATS_SYSCTL.read_text() == before        # statistics off again once we are gone
