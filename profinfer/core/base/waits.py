"""The daemon's waits (PROFINFER_*_S, declared in config.SETTINGS), read once, when the daemon
imports this module: a bad value stops the daemon in one line (ProfinferError), and no other
command, which never imports it."""
from __future__ import annotations

from profinfer.core.base.config import env_seconds

# A watched process's series are kept this long after it exits: a last scrape sees them.
SERIES_TTL_S = env_seconds("PROFINFER_SERIES_TTL_S")
# The daemon's loop not seen this long: /healthz answers 503 (a liveness probe restarts it).
# (At least 5 s: a loop turn can take a scan and a wait for the parse worker.)
STALL_S = env_seconds("PROFINFER_STALL_S", minimum=5)
# A level taken away by the governor comes back after this long with room (doubling each time
# a step up went over again).
STEP_UP_S = env_seconds("PROFINFER_STEP_UP_S", minimum=1)
# Another live daemon's process held at its loader this long: that daemon is frozen (its own
# watchdog continues its holds after 6 s), and any daemon on the node continues it. (At least
# 7 s: past that watchdog.)
HOLD_STUCK_S = env_seconds("PROFINFER_HOLD_STUCK_S", minimum=7)
# A process held at its loader this long is continued by the kernel itself (Linux 6.13), the
# daemon that holds it stopped, frozen or stuck. (At least 3 s: past the daemon's own
# watchdog, 2 s, for a busy daemon.)
HOLD_DEADLINE_S = env_seconds("PROFINFER_HOLD_DEADLINE_S", minimum=3)
# A reading of a tenant's file (its symbols, its DWARF) still running after this long is killed,
# and the file is not read again.
PARSE_DEADLINE_S = env_seconds("PROFINFER_PARSE_DEADLINE_S", minimum=1)   # parsing.DEADLINE_S: the same
# An HTTP request's head and body must arrive whole within this (a byte every few seconds
# gets nowhere): 408 and closed.
REQUEST_DEADLINE_S = env_seconds("PROFINFER_REQUEST_DEADLINE_S", minimum=1)
# NVML not answering for this long (a GPU fallen off the bus, its driver waiting): GPU
# metrics off until it answers again.
NVML_STALL_S = env_seconds("PROFINFER_NVML_STALL_S", minimum=1)
# A watched process that has made no engine call (no decode call, no step) this long gives
# its place up to a newly found one when the watch cap is reached.
WATCH_GRACE_S = env_seconds("PROFINFER_WATCH_GRACE_S", minimum=1)
# The flight recorder's baseline sample period.
BASELINE_SAMPLE_S = env_seconds("PROFINFER_BASELINE_SAMPLE_S", minimum=1)
