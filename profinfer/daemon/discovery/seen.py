"""What the agent remembers of the processes it looked at, so that a scan looks again only
at what may have changed: each keyed by (pid, start time) and dropped with its process."""
from __future__ import annotations

from profinfer.daemon.discovery.tenants import TenantShares

EXECUTABLES_SEEN_LIMIT = 4096       # executables remembered (does it define an engine's marker)


class SeenProcesses:
    def __init__(self):
        self.not_engines: dict[tuple[int, int], int] = {}       # (pid, start) -> vsize looked at
        self.cuda_checked: dict[tuple[int, int], int] = {}      # watched, no runtime: vsize looked at
        self.failed: dict[tuple[int, int], tuple[float, float]] = {}   # -> (next try, backoff)
        self.executables_seen: dict[tuple, bool] = {}
        self.loader_seen: set[tuple[int, int]] = set()       # (pid, start): its loader hooked
        self.loader_pending: set[int] = set()      # its loader still being read: hooked later
        self.over_cap: set[tuple[int, int]] = set()    # (pid, start): found, left out (the cap)
        self.cap_said = False              # the cap said in the log since there was room last
        self.tenants = TenantShares()      # whose each process is, and the per-tenant cap

    def keep_alive(self, alive: set[int]) -> None:
        """Forget the processes not in `alive` (their pids may come back as others), and
        the executables looked at once there are too many."""
        self.not_engines = {k: v for k, v in self.not_engines.items() if k[0] in alive}
        self.cuda_checked = {k: v for k, v in self.cuda_checked.items() if k[0] in alive}
        self.failed = {k: v for k, v in self.failed.items() if k[0] in alive}
        self.loader_seen = {k for k in self.loader_seen if k[0] in alive}
        self.over_cap = {k for k in self.over_cap if k[0] in alive}
        self.tenants.keep_alive(alive)
        if len(self.executables_seen) > EXECUTABLES_SEEN_LIMIT:
            self.executables_seen.clear()
