"""What keeps the op level cheap gives what the slow way gives: node descriptions read once per
graph change, and per-thread state in direct-mapped slots."""
from __future__ import annotations

import pytest

from conftest import completion_cmd, run_profinfer, with_llama_log
from profinfer.core.ebpf import kernel
from profinfer.exporters.trace_reader import read_trace


def _ops_by_thread(trace) -> list[list[tuple]]:
    """Each compute thread's ops in order, as descriptions with tensor addresses replaced by
    their order of first appearance in the run (addresses differ between runs; which op reads
    which tensor does not)."""
    numbering: dict[int, int] = {}

    def n(addr: int) -> int:
        return numbering.setdefault(addr, len(numbering)) if addr else -1

    threads: dict[int, list[tuple]] = {}
    for o in sorted(read_trace(trace).ops, key=lambda o: o.start_ns):
        threads.setdefault(o.tid, []).append(
            (o.op, o.name, o.ne, o.dtype, n(o.tensor), tuple(map(n, o.srcs)),
             tuple(map(n, o.src_views)), n(o.fused_tensor), o.src_ne, o.src_dtypes))
    return sorted(threads.values(), key=len)


def test_descriptions_by_generation_equal_descriptions_read_every_run(
        llama_build, tiny_model, llama_env, tmp_path):
    """By default a node's description is read once, and again only after ggml_init,
    ggml_reset or ggml_new_graph_custom (node_check "generation"); PROFINFER_NODE_CHECK=content
    reads it on every run. Both must say the same for every op, here across the graph that
    llama.cpp builds anew when the context passes 256 (the KV views' shapes change)."""
    words = "the and of to in is that it for on with as was at by this from".split()
    prompt = " ".join(words[i % len(words)] for i in range(236))
    cmd = completion_cmd(llama_build, tiny_model, n=40, prompt=prompt)
    seen = {}
    for mode in ("generation", "content"):
        trace = tmp_path / f"{mode}.pftrace"
        env = {**llama_env, "PROFINFER_NODE_CHECK": mode}
        r = with_llama_log(lambda: run_profinfer(["record", "--quiet", "-o", str(trace), "--", *cmd],
                                                 env=env, tmp_path=tmp_path))
        assert r.rc == 0, r.stderr[-2000:]
        assert r.summary["meta"]["node_check"] == mode
        assert r.summary["lost_events"] == 0
        ops = _ops_by_thread(trace)
        meta = r.summary["meta"]
        seen[mode] = (ops, int(meta["node_descriptions"]), int(meta["node_reads"]))
    (by_generation, described, reads), (every_run, described_every_run, reads_every_run) = (
        seen["generation"], seen["content"])
    assert len(by_generation) == 2 and by_generation == every_run
    # content reads every run; the generation skips nearly all reads: each node is read again
    # only at the few rebuilds (prompt, first decode, context past 256), not at every one of
    # the 40 decodes, so a bump on every compute (e.g. ggml_init's size misread) would fail here
    n_ops = sum(map(len, every_run))
    assert reads_every_run == n_ops
    assert reads < n_ops / 5
    # attention read a 256-long, then a 512-long KV view (FLASH_ATTN_EXT's K: its second
    # source, ne[1]): shapes did change mid-run, and were read again
    kv_lengths = {o[8][1][1] for t in by_generation for o in t if o[0] == "FLASH_ATTN_EXT"}
    assert {256, 512} <= kv_lengths
    assert described == described_every_run      # both sent each distinct description once


def test_threads_sharing_a_direct_slot_lose_nothing(llama_build, tiny_model, llama_env, tmp_path):
    """A thread's op state is its slot of a direct-mapped array (TID modulo its size, claimed
    by compare-and-swap), or an entry of a hash map when another thread holds that slot.
    With one slot the second compute thread takes the hash map; with none, both do. Each
    must record the same ops for each thread as the default, lose nothing, and leave nothing."""
    if not kernel.release_at_least(5, 12):
        pytest.skip("direct slots need BPF compare-and-swap (Linux 5.12)")
    cmd = completion_cmd(llama_build, tiny_model, n=16)
    per_thread = {}
    for slots in ("64", "1", "0"):
        trace = tmp_path / f"slots{slots}.pftrace"
        env = {**llama_env, "PROFINFER_THREAD_SLOTS": slots}
        r = run_profinfer(["record", "--quiet", "-o", str(trace), "--", *cmd], env=env, tmp_path=tmp_path)
        assert r.rc == 0, r.stderr[-2000:]
        meta = r.summary["meta"]
        assert r.summary["lost_events"] == 0 and meta["op_threads_left"] == "0"
        # each compute thread's state went where the slot count says, and every slot taken
        # was released whole when its thread exited
        assert meta["thread_slots"] == slots and meta["thread_slots_releasing"] == "0"
        in_slots, hashed = int(meta["thread_states_in_slots"]), int(meta["thread_states_hashed"])
        assert (in_slots, hashed) == {"64": (2, 0), "1": (1, 1), "0": (0, 2)}[slots]
        per_thread[slots] = [[o[0] for o in ops] for ops in _ops_by_thread(trace)]
    assert len(per_thread["64"]) == 2
    assert per_thread["64"] == per_thread["1"] == per_thread["0"]
    bad = run_profinfer(["record", "--quiet", "--", *cmd], env={**llama_env, "PROFINFER_THREAD_SLOTS": "3"},
                        tmp_path=tmp_path, json_summary=False)
    assert bad.rc != 0 and "power of two" in bad.stderr and "Traceback" not in bad.stderr
