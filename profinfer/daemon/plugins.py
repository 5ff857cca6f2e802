"""What the daemon asks of the engines and levels, through what their plugins declare
(core/base/registry.py): the features their collectors offer, and their per-process caches."""
from __future__ import annotations

from profinfer.core.base import registry
from profinfer.core.plugin.packs import Pack


def capabilities(pack: Pack) -> frozenset[str]:
    """What the daemon may ask the pack's collector for ("tokens_by_process",
    "steps_by_process", "graph_totals", "op_totals", "records_by_process"), as its plugin
    declares."""
    plugin = registry.plugin_of_pack(pack)
    return plugin.capabilities if plugin is not None else frozenset()


def plugin_name(pack: Pack) -> str:
    """The name of the plugin the pack belongs to ("" for none)."""
    plugin = registry.plugin_of_pack(pack)
    return plugin.name if plugin is not None else ""


def process_caches() -> list:
    """The plugins' caches of what was read per process (modules with forget_process(pid)
    and cache_sizes())."""
    return [p.part("process_caches") for p in registry.plugins() if p.process_caches]
