"""Who a process belongs to, for the watch cap: its pod (the pod uid in its cgroup path, as
the kernel writes it), else its root directory (a container's, by device and inode), else the
host. A tenant that starts many processes named like an engine takes at most its share of
the cap (--max-per-tenant), and what is left out is counted by tenant."""
from __future__ import annotations

import os

from profinfer.daemon.identity import cgroup_path, pod_uid_of

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


def tenant_of(pid: int) -> str:
    """"pod UID", "root DEV:INO" (a root of its own), or "host" (the node's root, as PID 1
    sees it; ours where that cannot be read)."""
    uid = pod_uid_of(cgroup_path(pid))
    if uid:
        return f"pod {uid}"
    root = _root_id(pid)
    if root is None or root == (_root_id(1) or _root_id("self")):
        return HOST
    return f"root {root[0]}:{root[1]}"


class LeftOut:
    """Processes left out (the cap), counted by tenant, at most MAX_COUNTED tenants by name."""

    def __init__(self):
        self.by_tenant: dict[str, int] = {}

    def count(self, tenant: str) -> None:
        if tenant not in self.by_tenant and len(self.by_tenant) >= MAX_COUNTED:
            tenant = OTHERS
        self.by_tenant[tenant] = self.by_tenant.get(tenant, 0) + 1
