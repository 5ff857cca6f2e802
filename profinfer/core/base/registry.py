"""The engines and levels profinfer knows, each a package that declares one Plugin.

They are found through the entry point group "profinfer.plugins" (pyproject.toml: one line per
plugin) and, for a plugin that lives outside this distribution, the environment variable
PROFINFER_PLUGINS (module names, comma-separated). The core, the exporters, the viewers and the
daemon reach an engine or a level only through what its Plugin declares here.

A plugin's folder holds, by convention: `pack.toml` (its probe pack, when it probes
functions), `bpf/` (its BPF programs and headers), and its own modules.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import metadata, resources
from importlib.resources.abc import Traversable

from profinfer.core.base import config
from profinfer.core.base.errors import ProfinferError

GROUP = "profinfer.plugins"
PLUGINS_ENV = "PROFINFER_PLUGINS"
CORE_BPF = "profinfer.core.ebpf"     # its bpf/ holds the headers every program shares


@dataclass(frozen=True)
class Plugin:
    """What an engine or a level contributes. `name` is its pack's name where it has one."""
    name: str
    module: str                                      # the package that declares it
    title: str = ""                                  # for people: "llama.cpp", "CUDA"
    # Its probes' program and decoder (where its pack probes functions): the BPF source in
    # its bpf/, and its collector class in a module of its package ("collector:CudaCollector").
    # Its pack.toml holds only what is read from the binaries (libraries, marker, probes).
    bpf: str | None = None
    collector: str | None = None
    # What the daemon may ask its collector for, e.g. "tokens_by_process", "op_totals" (ops
    # counted in BPF per op type and phase, which a session without a timeline asks for too),
    # and what it should know of it: "ops_on_callers" (its op probes trap only in the threads
    # that make its token or step calls).
    capabilities: frozenset[str] = field(default_factory=frozenset)
    # Its contributions, each a module of its own package (imported only when asked for):
    report: str | None = None        # report and JSON summary sections
    timeline: str | None = None      # Perfetto tracks of its record types (write and read back)
    commands: str | None = None      # command-line commands it adds (e.g. its demo workload)
    # A module of its package with forget_process(pid) and cache_sizes(): what it keeps per
    # process across collectors (read through /proc/PID/root), which a daemon drops at each
    # process's exit and shows in /status.
    process_caches: str | None = None
    # An engine's module with trap_in_situ_ns(profile, barrier_handler_ns, cols): one probe
    # hit's trap as the engine paid it, read from a recording that does not hold it in meta.
    accounting: str | None = None
    # A plug-in's module whose METRICS (a plugin.processmetrics.ProcessMetrics) keeps what the
    # daemon shows of it per process: the daemon hands it the plug-in's records (a level's;
    # an engine's with "records_by_process", with each process's decode calls).
    daemon_metrics: str | None = None

    kind = "plugin"

    @property
    def folder(self) -> Traversable:
        return resources.files(self.module)

    @property
    def pack_file(self) -> Traversable | None:
        f = self.folder.joinpath("pack.toml")
        return f if f.is_file() else None

    @property
    def bpf_dir(self) -> Traversable | None:
        d = self.folder.joinpath("bpf")
        return d if d.is_dir() else None

    def can(self, capability: str) -> bool:
        return capability in self.capabilities

    def part(self, contribution: str):
        """The module of one contribution ("report", "timeline", "commands",
        "process_caches", "accounting", "daemon_metrics"), or None."""
        name = getattr(self, contribution)
        return importlib.import_module(f"{self.module}.{name}") if name else None


@dataclass(frozen=True)
class Engine(Plugin):
    """An inference engine: its pack finds the engine in a process and names its collector."""
    kind = "engine"


@dataclass(frozen=True)
class Level(Plugin):
    """A level added to any engine's (or to none): cuda, sched, counters."""
    kind = "level"


@lru_cache(maxsize=1)
def _installed() -> tuple[str, ...]:
    """The entry points' plugins: read once, as scanning the installed distributions is slow."""
    return tuple(ep.value for ep in sorted(metadata.entry_points(group=GROUP), key=lambda e: e.name))


def _declared() -> list[str]:
    extra = [m.strip() for m in (config.text(PLUGINS_ENV) or "").split(",") if m.strip()]
    return list(dict.fromkeys(_installed() + tuple(extra)))


def _load(spec: str) -> Plugin:
    module, _, attr = spec.partition(":")
    try:
        found = getattr(importlib.import_module(module), attr or "PLUGIN")
    except (ImportError, AttributeError, ValueError, TypeError) as e:   # the last two: "", ".relative"
        raise ProfinferError(f"plugin {spec}: cannot load it ({e})") from None
    if not isinstance(found, Plugin):
        raise ProfinferError(f"plugin {spec}: {attr or 'PLUGIN'} is not a profinfer Plugin")
    return found


@lru_cache(maxsize=None)
def _plugins(declared: tuple[str, ...]) -> tuple[Plugin, ...]:
    found: dict[str, Plugin] = {}
    for spec in declared:
        p = _load(spec)
        if p.name in found and found[p.name].module != p.module:
            raise ProfinferError(f"plugins {found[p.name].module} and {p.module} are both named {p.name}")
        found[p.name] = p
    return tuple(sorted(found.values(), key=lambda p: p.name))


def plugins() -> tuple[Plugin, ...]:
    """Every registered engine and level, by name."""
    return _plugins(tuple(_declared()))


def engines() -> tuple[Engine, ...]:
    return tuple(p for p in plugins() if isinstance(p, Engine))


def levels() -> tuple[Level, ...]:
    return tuple(p for p in plugins() if isinstance(p, Level))


def plugin(name: str) -> Plugin | None:
    return next((p for p in plugins() if p.name == name), None)


def bpf_dirs() -> list[Traversable]:
    """Where BPF sources and headers are looked for: the core's first, then each plugin's."""
    dirs = [resources.files(CORE_BPF).joinpath("bpf")]
    return dirs + [p.bpf_dir for p in plugins() if p.bpf_dir is not None]


def bpf_file(name: str) -> Traversable:
    """A BPF source or header by file name, wherever a plugin keeps it."""
    for d in bpf_dirs():
        f = d.joinpath(name)
        if f.is_file():
            return f
    raise ProfinferError(f"no BPF file {name} in the core or any plugin")


def plugin_of_pack(pack) -> Plugin | None:
    """The plugin a pack belongs to: the one whose package holds the pack's decoder (a pack
    given with --pack that names an existing collector class has no plugin of its own, and
    gets that collector's plugin, its capabilities included)."""
    module = pack.decoder.partition(":")[0]
    owners = [p for p in plugins() if module == p.module or module.startswith(p.module + ".")]
    return max(owners, key=lambda p: len(p.module), default=None)
