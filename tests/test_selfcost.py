"""What profiling cost the target: the kernel's count of our programs, the measured cost of a
probe hit, and the shares derived from them."""
from __future__ import annotations

from pathlib import Path

from conftest import completion_cmd, run_profinfer

from profinfer import probecost, selfcost
from profinfer.model import Profile

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
    assert cost["bpf_runs"] == 2 * calls
    assert cost["probe_hits"]["return"] == calls
    assert cost["probe_hits"]["emulated"] + cost["probe_hits"]["stepped"] == calls
    assert cost["bpf_ns"] > 0 and cost["target_cpu_ns"] > 0
    assert "profiler cost:" in r.stdout
    assert STATS_SYSCTL.read_text() == before        # statistics off again once we are gone
