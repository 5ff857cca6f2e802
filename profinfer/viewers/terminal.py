"""The console reports print to: a terminal's own width, or no width limit off a terminal."""
from __future__ import annotations

import sys

from rich.console import Console

# Off a terminal rich assumes 80 columns (or $COLUMNS) and cuts cells to fit with "…"; a file
# or a pipe has no width, and a report cut short there is wrong, so nothing is cut.
UNLIMITED_WIDTH = 1 << 20


def report_console() -> Console:
    try:
        on_terminal = sys.stdout.isatty()
    except (AttributeError, ValueError):   # stdout replaced or closed
        on_terminal = False
    return Console() if on_terminal else Console(width=UNLIMITED_WIDTH)
