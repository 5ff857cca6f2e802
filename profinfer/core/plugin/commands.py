"""What a plugin's `commands` module contributes to the command line.

A commands module (Plugin.commands, e.g. profinfer/engines/llamacpp/commands.py) may define:
- `DEMO`: a Demo, the bundled workload `profinfer demo --engine NAME` builds and records;
- `add_commands(group, services)`: adds its own click commands to the `profinfer` group,
  with the Services the command line lends them.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

from profinfer.core.base import registry
from profinfer.core.profile.model import Profile


@dataclass(frozen=True)
class Demo:
    name: str                 # --engine's choice
    describe: str             # what it runs, for --engine's help
    # (model, tokens to generate, threads) -> the command to record and its environment
    # (None: profinfer's own); builds and downloads what it needs once, cached.
    command: Callable[[str, int, int], tuple[list[str], dict[str, str] | None]]
    models: tuple[str, ...] = ()     # --model's choices, where it takes one (the first: default)
    model_help: str = ""             # a phrase of --model's help
    # whether what it runs is built and downloaded already (doctor runs only such a demo;
    # None: not known, run it)
    ready: Callable[[], bool] | None = None


@dataclass(frozen=True)
class Services:
    """What the command line lends the commands a plugin adds."""
    load_trace: Callable[[str], Profile]     # a saved trace, or one line of error and exit
    console: Callable[[], object]            # the rich Console reports print to
    warn: Callable[[str], None]              # "profinfer: warning: ..." on stderr
    note: Callable[[str], None]              # "profinfer: ..." on stderr
    check_output: Callable[[str, str], None]  # (option, path): one line of error and exit unless
                                              # it can be written (before any work)


def commands_modules() -> list[ModuleType]:
    """Each registered plugin's commands module, by plugin name."""
    return [p.part("commands") for p in registry.plugins() if p.commands]


def demos() -> list[Demo]:
    return [m.DEMO for m in commands_modules() if getattr(m, "DEMO", None) is not None]
