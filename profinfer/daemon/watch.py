"""A watched process: what serves it (its build's shared probes, its own op level, the
shared cuda level), what its probes cost it, and its identity."""
from __future__ import annotations

from dataclasses import dataclass, field

from profinfer.core.profile.model import Step, TokenCall
from profinfer.core.plugin.packs import Pack
from profinfer.core.profile.stats import SequenceTracker
from profinfer.daemon.discovery.identity import Identity
from profinfer.daemon.shared import SharedProbes


@dataclass
class Watch:
    identity: Identity
    collector: object                   # its own op-level probes, or None
    levels: set[str]
    started_at: float
    pack: Pack | None = None
    files: list = field(default_factory=list)
    group: SharedProbes | None = None   # its build's shared probes (token, graph)
    cuda: bool = False                  # served by the shared cuda level (it maps a CUDA runtime)
    # (t, its CPU ns, its probes' cost ns by level, watching CPU ns, its callers' CPU ns, its
    # decode calls or steps); None: a new window
    cost_mark: tuple[float, int, dict[str, float], int, int | None, int | None] | None = None
    share: float | None = None          # what the probes cost it, as a share of its CPU time
    shares: dict[str, float] = field(default_factory=dict)   # the same, by level (and "daemon")
    idle: bool = False                  # it did next to nothing in the last window (Governor._quiet)
    known_shares: dict[str, float] = field(default_factory=dict)   # each level's, when it last had it
    op_pending: bool = False            # its op level waits for its files to be read
    calm_since: float | None = None     # under the budget with room since
    step_up_wait_s: float = 0.0
    stepped_up: bool = False            # the last change was a step up
    tracker: SequenceTracker = field(default_factory=lambda: SequenceTracker(keep=False))
    last_step: TokenCall | None = None  # its engine's last step, timed at the next (vLLM)
    exited_at: float | None = None      # monotonic
    lost_seen: int = 0
    programs: dict[str, tuple[int, int]] = field(default_factory=dict)   # last kernel counts
    model_checked: float = 0.0
    errors: int = 0
    pidfd: int = -1                     # readable once the process has exited
    capabilities: frozenset[str] = frozenset()   # its engine plugin's
    # the threads that make its engine's calls (decode calls, steps): its floor's and graph's
    # probes trap in them, and are charged against their time
    callers: set[int] = field(default_factory=set)


def step_call(step: Step) -> TokenCall:
    """An engine step as a forward call: its prompt tokens and decoding sequences' tokens."""
    return TokenCall(step.tid, step.start_ns, step.end_ns, step.n_tokens, prefill=step.prefill_seqs > 0,
                     decode_tokens=step.decode_seqs)
