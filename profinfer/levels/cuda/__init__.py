"""The cuda level: CUDA runtime and driver calls (launches with kernel names, copies, syncs)."""
from profinfer.core.registry import Level

PLUGIN = Level("cuda", __name__, title="CUDA", timeline="timeline")
