"""A bench's target process: started, waited for until it prints READY, and then each line
it prints with a tag (its own timings) read into a list as it comes."""
from __future__ import annotations

import subprocess
import threading


def start(cmd: list[str], tag: str) -> tuple[subprocess.Popen, list[tuple[int, ...]]]:
    """The process, and the list its `tag` lines' numbers are appended to (as ints)."""
    target = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    for line in target.stdout:
        if line.strip() == "READY":
            break
    rows: list[tuple[int, ...]] = []

    def read() -> None:
        for line in target.stdout:
            if line.startswith(tag):
                rows.append(tuple(int(v) for v in line.split()[1:]))

    threading.Thread(target=read, daemon=True).start()
    return target, rows
