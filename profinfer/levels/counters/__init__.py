"""perf counters read at each op's start and end (--counters)."""
from profinfer.core.base.registry import Level

PLUGIN = Level("counters", __name__, title="perf counters", timeline="timeline", report="report")
