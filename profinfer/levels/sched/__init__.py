"""The sched level: context switches and wakeups of the target's threads."""
from profinfer.core.base.registry import Level

PLUGIN = Level("sched", __name__, title="scheduler", timeline="timeline", report="report")
