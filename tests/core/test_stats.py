"""profinfer.core.profile.stats on small hand-built profiles whose numbers are worked out by hand."""
from __future__ import annotations

import pytest

from profinfer.core.profile.model import GraphCall, OpSlice, Profile, TokenCall
from profinfer.core.profile.stats import compute, op_arrays, op_table, sequences


def op(tid, start, end, barrier_end, name="MUL_MAT", cpu=0):
    return OpSlice(tid=tid, cpu=cpu, start_ns=start, end_ns=end, barrier_end_ns=barrier_end, op=name,
                   name="t", ne=(1, 1, 1, 1), dtype="f32")


def scenario() -> Profile:
    """Two sequences: chunked prompt (A, B) + 2 decodes (C, D); prompt E + 1 decode F.
    Graph G1 inside A, G2 inside C; threads 1 (main), 2 (worker), 3 (an op outside everything)."""
    tokens = [
        TokenCall(1, 0, 100, 5, True),          # A
        TokenCall(1, 110, 200, 3, True),        # B: same prompt chain
        TokenCall(1, 300, 350, 1, False),       # C
        TokenCall(1, 400, 460, 1, False),       # D
        TokenCall(1, 1000, 1100, 4, True),      # E: new sequence
        TokenCall(1, 1200, 1250, 1, False),     # F
    ]
    graphs = [GraphCall(1, 10, 90, "CPU", 2), GraphCall(1, 310, 340, "CPU", 1)]
    ops = [
        op(1, 20, 50, 60), op(1, 60, 70, 80, "ADD"),
        op(2, 30, 60, 60), op(2, 65, 75, 80, "ADD"),
        op(2, 320, 330, 335),
        op(3, 2000, 2010, 2010, "SOFT_MAX"),
    ]
    return Profile(pid=1, thread_names={1: "main", 2: "worker"}, tokens=tokens, graphs=graphs,
                   ops=ops, lost_events=7)


def test_phase_totals_and_calls():
    st = compute(scenario())
    assert st.decode_calls == 6
    pre, dec = st.phases["prefill"], st.phases["decode"]
    assert (pre.calls, pre.tokens, pre.time_ns) == (3, 12, 290)
    assert (dec.calls, dec.tokens, dec.time_ns) == (3, 3, 160)
    assert st.tokens_per_s == pytest.approx(3 / 160e-9)
    assert pre.tokens_per_s == pytest.approx(12 / 290e-9)
    assert st.graphs == 2 and st.lost_events == 7


def test_sequences_ttft_tpot():
    st = compute(scenario())
    s1, s2 = st.sequences
    assert (s1.prefill_calls, s1.prefill_tokens, s1.decode_tokens) == (2, 8, 2)
    assert s1.ttft_ns == 200                      # start of A .. end of B
    assert s1.tpot_ns == pytest.approx((460 - 200) / 2)
    assert s2.ttft_ns == 100 and s2.tpot_ns == pytest.approx(150)
    assert st.ttft_ns == 150                      # medians over sequences
    assert st.tpot_ns == pytest.approx(140)


def test_decode_only_sequence_uses_first_decode_start():
    seqs = sequences([TokenCall(1, 100, 150, 1, False), TokenCall(1, 200, 260, 1, False)])
    assert len(seqs) == 1
    assert seqs[0].ttft_ns is None
    assert seqs[0].tpot_ns == pytest.approx((260 - 100) / 2)


def test_thread_totals():
    st = compute(scenario())
    th = {t.tid: t for t in st.threads}
    # main: G1 (10..90) ran its ops; G2 has no op of its own -> counted as the issuer (30)
    assert (th[1].graph_ns, th[1].op_ns, th[1].barrier_ns) == (80 + 30, 40, 20)
    # worker: ran ops in both graphs, each counted whole
    assert (th[2].graph_ns, th[2].op_ns, th[2].barrier_ns) == (80 + 30, 50, 10)
    assert (th[3].graph_ns, th[3].op_ns, th[3].barrier_ns) == (0, 10, 0)
    assert th[1].name == "main" and th[3].name == ""
    # the worker started G1 at 30, 10 ns after main's first op; alone in G2: no arrival there
    assert (th[1].arrival_ns, th[2].arrival_ns, th[3].arrival_ns) == (0, 10, 0)
    assert th[2].coverage == pytest.approx((10 + 60) / 110) and th[3].coverage is None


def test_op_table():
    st = compute(scenario())
    assert [o.op for o in st.ops] == ["MUL_MAT", "ADD", "SOFT_MAX"]
    mm = st.ops[0]
    assert (mm.count, mm.total_ns) == (3, 70)
    assert mm.mean_ns == pytest.approx(70 / 3)
    assert mm.p50_ns == 30 and mm.p99_ns == pytest.approx(30)
    assert mm.share == pytest.approx(0.7)
    assert st.op_total_ns == 100 and st.barrier_total_ns == 30


def test_percentiles_match_numpy():
    import numpy as np
    durs = list(range(1, 201))
    ops = [op(1, 0, d, d, "A" if d % 2 else "B") for d in durs]
    arr = op_arrays(ops)
    rows = {r.op: r for r in op_table(arr.dur, arr.code, arr.names)}
    odd = [d for d in durs if d % 2]
    assert rows["A"].p99_ns == pytest.approx(np.percentile(odd, 99))
    assert rows["A"].p50_ns == pytest.approx(np.percentile(odd, 50))
    assert rows["A"].count == 100 and rows["A"].total_ns == sum(odd)


def test_per_phase_ops():
    st = compute(scenario())
    pre, dec, other = st.phases["prefill"], st.phases["decode"], st.phases["other"]
    assert pre.op_ns == 80 and {o.op: o.total_ns for o in pre.ops} == {"MUL_MAT": 60, "ADD": 20}
    assert dec.op_ns == 10 and {o.op: o.count for o in dec.ops} == {"MUL_MAT": 1}
    assert other.op_ns == 10 and [o.op for o in other.ops] == ["SOFT_MAX"]
    assert pre.barrier_ns == 10 + 10 + 0 + 5 and dec.barrier_ns == 5


def test_no_other_phase_when_all_ops_attributed():
    p = scenario()
    p.ops = p.ops[:-1]
    assert "other" not in compute(p).phases


def test_empty_profile():
    st = compute(Profile(pid=1))
    assert st.decode_calls == 0 and st.ops == [] and st.threads == []
    assert st.ttft_ns is None and st.tpot_ns is None and st.tokens_per_s is None
    assert st.phases["prefill"].tokens == 0 and st.op_total_ns == 0


def _run(start: int, end: int, runs: tuple) -> TokenCall:
    return TokenCall.of_batch(1, start, end, sum(n for _, _, n in runs), 0, runs)


def test_a_slot_reused_with_a_cached_prefix_starts_a_new_sequence():
    """A server's slot 0: a request cancelled after one prompt chunk (positions 0-63), then the
    next request on the slot reusing 32 cached tokens (its prompt from position 32, at or
    below the last position): two sequences, the second's TTFT its own (not from the first's
    start, 3 s before). Then a context shift (a decoding run dropping below the last
    position) continues the sequence it shifts."""
    from profinfer.core.profile.sequences import SequenceTracker
    t = SequenceTracker()
    t.feed(_run(0, 10_000_000, ((0, 0, 64),)))                            # cancelled mid-prompt
    t.feed(_run(3_000_000_000, 3_005_000_000, ((0, 32, 40),)))            # the next request, cached prefix
    ttfts, _ = t.feed(_run(3_006_000_000, 3_007_000_000, ((0, 72, 1),)))  # its first decode
    assert [s.start_ns for s in t.seqs] == [0, 3_000_000_000]
    assert ttfts == [5_000_000]
    t.feed(_run(3_008_000_000, 3_009_000_000, ((0, 73, 1),)))
    t.feed(_run(3_010_000_000, 3_011_000_000, ((0, 40, 1),)))             # shifted down: the same one
    assert len(t.seqs) == 2 and t.seqs[-1].decode_tokens == 3


def test_a_sequence_that_never_decoded_gives_its_ttft_when_replaced():
    """A request that generated one token (its prompt's call gave it: no decode call), then
    the next request on the slot from position 0: the first's TTFT is said when the second
    begins, not never."""
    from profinfer.core.profile.sequences import SequenceTracker
    t = SequenceTracker(keep=False)
    assert t.feed(_run(0, 7_000_000, ((0, 0, 20),))) == ([], [])
    ttfts, _ = t.feed(_run(50_000_000, 58_000_000, ((0, 0, 30),)))
    assert ttfts == [7_000_000]


def test_a_refused_call_and_an_idle_return_below_the_last_position_give_no_sample():
    """A prompt chunk the engine refused (KV cache full, return 1) and submitted again is one
    chunk, not a new sequence with a TTFT of its own; a decoding run back below the sequence's
    last position after an idle gap (a slot's fully cached re-sent prompt) gives no TPOT
    sample the length of the gap."""
    from profinfer.core.profile.sequences import SequenceTracker
    t = SequenceTracker()
    t.feed(_run(0, 10_000_000, ((0, 0, 32),)))
    refused = TokenCall.of_batch(1, 11_000_000, 12_000_000, 32, 1, ((0, 32, 32),))
    assert t.feed(refused) == ([], [])
    t.feed(_run(13_000_000, 20_000_000, ((0, 32, 32),)))                 # the chunk again
    ttfts, _ = t.feed(_run(21_000_000, 22_000_000, ((0, 64, 1),)))
    assert len(t.seqs) == 1 and t.seqs[0].prefill_tokens == 64 and ttfts == [20_000_000]
    _, tpots = t.feed(_run(5_022_000_000, 5_023_000_000, ((0, 63, 1),)))  # 5 s later, cached
    assert tpots == [], tpots
