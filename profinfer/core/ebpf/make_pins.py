"""Make the node's pinned maps (core/ebpf/followed.py, core/ebpf/held.py), or find them made: a service
manager's privileged step before a sandboxed daemon, which opens them but cannot pin them
where /sys/fs/bpf is read-only to it (systemd's ProtectKernelTunables). Says why not, and
exits 0 all the same."""
from __future__ import annotations

import os
import sys

from profinfer.core.ebpf import held, followed


def main() -> int:
    said: list[str] = []
    for fd in (followed.open_shared(said.append), held.open_shared(said.append)):
        if fd is not None:
            os.close(fd)
    # the daemon cannot unpin another version's spent map where bpffs is read-only to it
    said += [f"unpinned {pin}: another version's map of held processes, empty" for pin in held.unpin_spent()]
    for line in said:
        print(f"profinfer: {line}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
