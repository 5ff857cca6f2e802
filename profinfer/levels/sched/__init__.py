"""The sched level: context switches and wakeups of the target's threads."""
from profinfer.core.registry import Level

PLUGIN = Level("sched", __name__, title="scheduler", timeline="timeline")
