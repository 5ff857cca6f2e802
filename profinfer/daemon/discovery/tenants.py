"""Who a process belongs to, for the watch cap: its pod (the pod uid in its cgroup path, as
the kernel writes it), else its root directory (a container's, by device and inode), else the
host. A tenant that starts many processes named like an engine takes at most its share of
the cap (--max-per-tenant), and what is left out is counted by tenant."""
from __future__ import annotations

import os

from profinfer.daemon.discovery.identity import cgroup_path, pod_uid_of

HOST = "host"
# tenants whose left-out processes are counted by name; the rest together, under OTHERS
MAX_COUNTED = 256
OTHERS = "others"


def _root_id(pid: int | str) -> tuple[int, int] | None:
    try:
        st = os.stat(f"/proc/{pid}/root")
    except OSError:
        return None
    return st.st_dev, st.st_ino


def tenant_of(pid: int, root: tuple[int, int] | None = None) -> str:
    """"pod UID", "root DEV:INO" (a root of its own), or "host" (the node's root, as PID 1
    sees it; ours where that cannot be read). `root`: the process's root, where read."""
    uid = pod_uid_of(cgroup_path(pid))
    if uid:
        return f"pod {uid}"
    root = root or _root_id(pid)
    if root is None or root == (_root_id(1) or _root_id("self")):
        return HOST
    return f"root {root[0]}:{root[1]}"


class TenantShares:
    """Each process's tenant, by (pid, start); the most of one tenant watched at once
    (`limit`); and the processes left out, counted by tenant (at most MAX_COUNTED by name)."""

    def __init__(self, limit: int = 1):
        self.limit = limit
        self.of: dict[tuple[int, int], str] = {}
        self.roots: dict[tuple[int, int], tuple[int, int] | None] = {}    # the root each was told by
        self.left_out: dict[str, int] = {}

    def tenant(self, key: tuple[int, int]) -> str:
        """Its tenant (key: (pid, start)), read again where its root changed since: a
        container's first process starts in the host's root and pivots into its own before
        it execs the workload, under the same PID."""
        root = _root_id(key[0])
        if key not in self.of or (root is not None and self.roots.get(key) != root):   # None: gone or unreadable
            self.of[key] = tenant_of(key[0], root)
            self.roots[key] = root
        return self.of[key]

    def count_left_out(self, tenant: str) -> None:
        if tenant not in self.left_out and len(self.left_out) >= MAX_COUNTED:
            tenant = OTHERS
        self.left_out[tenant] = self.left_out.get(tenant, 0) + 1

    def keep_alive(self, alive: set[int]) -> None:
        self.of = {k: v for k, v in self.of.items() if k[0] in alive}
        self.roots = {k: v for k, v in self.roots.items() if k[0] in alive}
