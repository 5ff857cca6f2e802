"""A llama-server with parallel slots batches several sequences together: prompts beside
generations. Tokens are classified per sequence, against the server's own per-request timings."""
from __future__ import annotations

import concurrent.futures
import json
import signal
import urllib.request

import pytest

from conftest import llama_server, start_profinfer

SLOTS = 8
N_PREDICT = 24
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


@pytest.fixture
def server(llama_build, tiny_model, llama_env):
    with llama_server(llama_build, tiny_model, llama_env, SLOTS) as found:
        yield found


def _complete(url: str, i: int) -> dict:
    """One request; prompts of different lengths, so that some still read their prompt while
    others generate."""
    prompt = " ".join(WORDS[(i + j) % len(WORDS)] for j in range(8 + 9 * i))
    body = json.dumps({"prompt": prompt, "n_predict": N_PREDICT, "ignore_eos": True}).encode()
    req = urllib.request.Request(f"{url}/completion", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.load(r)


def test_concurrent_requests_against_server_timings(server, tmp_path):
    proc, url = server
    out = tmp_path / "s.json"
    p = start_profinfer(["attach", "--pid", str(proc.pid), "--quiet", "--json", str(out)])
    with concurrent.futures.ThreadPoolExecutor(SLOTS) as pool:
        replies = list(pool.map(lambda i: _complete(url, i), range(SLOTS)))
    p.send_signal(signal.SIGINT)
    p.wait(timeout=60)
    assert p.returncode == 0, p.stderr.read()
    s = json.loads(out.read_text())
    timings = {r["id_slot"]: r["timings"] for r in replies}
    assert len(timings) == SLOTS, "every request had its own slot"
    # The server samples its first token from the prompt's last batch and never decodes its
    # last one: predicted_n - 1 decode tokens per request.
    assert s["tokens"]["prefill"] == sum(t["prompt_n"] for t in timings.values())
    assert s["tokens"]["decode"] == sum(t["predicted_n"] - 1 for t in timings.values())
    assert s["phases"]["decode"]["calls"] > 0
    # without a timeline the op level counts ops per phase in BPF, from the decode call under
    # way: the phases its ops fall in are those of the calls (prompts batched with generations
    # are "mixed"), as the calls' own batches give them
    assert s["meta"]["op_level"] == "counted"
    assert {p for p, v in s["phases"].items() if v["ops"]} == {p for p, v in s["phases"].items() if v["calls"]}
    by_seq = {q["seq"]: q for q in s["sequence_latency"]}
    assert set(by_seq) == set(timings)
    for slot, t in timings.items():
        q = by_seq[slot]
        print(f"slot {slot}: prompt {q['prefill_tokens']} tokens, TTFT {q['ttft_ns'] / 1e6:.2f} ms "
              f"(server {t['prompt_ms']:.2f}); generation {(q['end_ns'] - q['prefill_end_ns']) / 1e6:.2f} ms "
              f"(server {t['predicted_ms']:.2f}); TPOT {q['tpot_ns'] / 1e6:.3f} ms "
              f"(server {t['predicted_per_token_ms']:.3f})")
        assert q["prefill_tokens"] == t["prompt_n"] and q["decode_tokens"] == t["predicted_n"] - 1
        # the server times a request's prompt from when its slot starts it to its first
        # token, and its generation from then to its last token; sampling and its HTTP work
        # between batches are in its times, not in llama_decode's
        assert q["ttft_ns"] / 1e6 == pytest.approx(t["prompt_ms"], rel=0.25, abs=5)
        assert (q["end_ns"] - q["prefill_end_ns"]) / 1e6 == pytest.approx(t["predicted_ms"], rel=0.25, abs=5)
        assert q["tpot_ns"] / 1e6 == pytest.approx(t["predicted_per_token_ms"], rel=0.25, abs=0.5)
