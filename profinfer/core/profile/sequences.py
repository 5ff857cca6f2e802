"""Sequences and their latency, from an engine's decode calls (TokenCall) in start order.

- tokens: each token of a batch is a prompt (prefill) or a decode token (model.split_batch:
  per sequence where the batch's sequences were read, else by the batch's size).
- sequence: followed by its id where the batches' sequences were read, else the calls form one
  stream. A prompt run of a sequence that has decoded, or starts at position 0, or at or below
  the sequence's last position (its id and positions known: a server's slot reused with a
  cached prefix, after a request cancelled mid-prompt or one that generated a single token),
  starts a new one; consecutive prompt runs are its prompt chain (chunked prompt). Decode
  tokens before any prompt form a sequence without prefill (attached mid-generation). A
  decoding run below the last position is not taken for a new sequence: a context shift makes
  those too (a server's cached re-sent prompt looks the same; its request marks tell them
  apart: docs/requests.md).
- A call the engine refused (llama_decode's return not 0: the KV cache full) is no one's: its
  tokens come again. Speculative decoding (a draft context's calls on the same sequence ids,
  verify batches of several tokens) is not told apart: its sequences are wrong.
- TTFT = end of the call that completed the prompt chain - start of its first call; feed()
  says it at the sequence's first decode, or, for one that never decoded (one token
  generated, an immediate EOS, an embedding), when a new prompt replaces it.
- TPOT = (end of the last decode call - end of the prefill chain) / decode tokens; for a
  sequence without prefill the start of its first decode call stands for the prefill end.

The report reads a recording's sequences at once (sequences()); the daemon feeds a
SequenceTracker call by call, for days.
"""
from __future__ import annotations

from dataclasses import dataclass

from profinfer.core.profile.model import TokenCall, decoding_run


@dataclass(slots=True)
class SequenceStats:
    start_ns: int
    seq: int | None = None        # the engine's sequence id, where batches were read
    prefill_calls: int = 0
    prefill_tokens: int = 0
    prefill_end_ns: int | None = None
    decode_calls: int = 0
    decode_tokens: int = 0
    end_ns: int | None = None     # end of the last decode call
    last_pos: int | None = None   # the last position it ran at, where the batches' were read

    @property
    def ttft_ns(self) -> int | None:
        return None if self.prefill_end_ns is None else self.prefill_end_ns - self.start_ns

    @property
    def tpot_ns(self) -> float | None:
        if not self.decode_tokens or self.end_ns is None:
            return None
        anchor = self.prefill_end_ns if self.prefill_end_ns is not None else self.start_ns
        return (self.end_ns - anchor) / self.decode_tokens



def _token_runs(t: TokenCall):
    """(sequence key, first position or None, tokens, decoding) for each run of a call."""
    if not t.runs:
        yield None, None, t.n_tokens, not t.prefill
        return
    for seq, pos0, n in t.runs:
        yield seq, pos0, n, decoding_run(pos0, n)


class SequenceTracker:
    """Each sequence's prompt and generation, from decode calls fed in start order. feed()
    also says what each call showed: the time to first token of a sequence whose generation
    it began, and the time per output token of each sequence it continued. With keep=False
    (a daemon watching for days) a sequence is forgotten once a new prompt replaces it."""

    def __init__(self, keep: bool = True):
        self.keep = keep
        self.seqs: list[SequenceStats] = []
        self.current: dict[int | None, SequenceStats] = {}

    def feed(self, t: TokenCall) -> tuple[list[int], list[tuple[float, int]]]:
        """(TTFTs in ns, (ns per output token, tokens) per continued sequence) of this call."""
        ttfts, tpots = [], []
        if t.ret != 0:          # refused (the KV cache full): its tokens are submitted again
            return ttfts, tpots
        for key, pos0, n, decoding in _token_runs(t):
            if n <= 0:          # an empty batch (llama_decode refuses it): no tokens
                continue
            cur = self.current.get(key)
            if decoding:
                if cur is None:
                    cur = self.current[key] = self._new(t.start_ns, key)
                if not cur.decode_calls and cur.ttft_ns is not None:
                    ttfts.append(cur.ttft_ns)
                if pos0 is not None and cur.last_pos is not None and pos0 <= cur.last_pos:
                    pass    # back below its last position (a context shift, a slot's cached re-sent
                            # prompt): the time since its last call may be idle, not a token's
                else:
                    anchor = cur.end_ns or cur.prefill_end_ns or t.start_ns
                    tpots.append(((t.end_ns - anchor) / n, n))
                cur.decode_calls += 1
                cur.decode_tokens += n
                cur.end_ns = t.end_ns
                cur.last_pos = None if pos0 is None else pos0 + n - 1
                continue
            if cur is None or cur.decode_calls or (pos0 == 0 and cur.prefill_calls) or (
                    pos0 is not None and cur.last_pos is not None and pos0 <= cur.last_pos):
                if cur is not None and not cur.decode_calls and cur.ttft_ns is not None:
                    ttfts.append(cur.ttft_ns)      # it never decoded: its first token was its prompt's
                cur = self.current[key] = self._new(t.start_ns, key)   # a new prompt
            cur.prefill_calls += 1
            cur.prefill_tokens += n
            cur.prefill_end_ns = t.end_ns
            cur.last_pos = None if pos0 is None else pos0 + n - 1
        return ttfts, tpots

    def _new(self, start_ns: int, key) -> SequenceStats:
        s = SequenceStats(start_ns, key)
        if self.keep:
            self.seqs.append(s)
        return s


def sequences(tokens: list[TokenCall]) -> list[SequenceStats]:
    tracker = SequenceTracker()
    for t in sorted(tokens, key=lambda t: (t.start_ns, t.tid)):
        tracker.feed(t)
    return tracker.seqs
