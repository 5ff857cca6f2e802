"""Load a probe pack (a plugin's pack.toml, or a file given with --pack) and resolve it
against a target's libraries."""
from __future__ import annotations

import fnmatch
import importlib
import os
import re
import tomllib
from dataclasses import dataclass, field

from profinfer.core.target import process, procfs
from profinfer.core.base import registry
from profinfer.core.target.arch import placement
from profinfer.core.target.arch.callsites import call_sites
from profinfer.core.base.errors import ProfinferError
from profinfer.core.target.symbols import ElfInfo, Symbol, load_elf

LEVELS = ("token", "graph", "op")           # probed in the engine (the default set)
KERNEL_LEVELS = ("sched",)                  # kernel tracepoints, filtered to the target: opt-in
RUNTIME_LEVELS = ("cuda",)                  # a runtime's calls under any engine: opt-in
PACK_MAX_BYTES = 1 << 20                    # a probe pack is a page or two of TOML
MIN_DURATION_S = 0.01                       # the shortest --duration; a capture asks for no less


@dataclass
class ProbeSpec:
    level: str
    function: str | None = None
    pattern: str | None = None
    entry: str | None = None
    ret: str | None = None
    args: tuple[int, ...] = ()
    required: bool = False
    group: str | None = None             # probes of one group are alternatives: first found wins
    callers: str | None = None           # probe the calls of `function` in these functions instead
    # each match gets programs of its own: entry and return with "_<n>" added, n counting
    # the matches of every numbered probe (the collector tells them apart by n)
    numbered: bool = False
    table: dict = field(default_factory=dict)   # the probe's own keys, for its pack's collector


@dataclass
class Pack:
    name: str                  # its plugin's name, or a --pack file's name without .toml
    engine: str
    bpf: str
    libraries: list[str]
    marker: str                # a statically linked engine's executable defines it ("": none)
    decoder: str               # "module:Class": the engine's collector
    probes: list[ProbeSpec] = field(default_factory=list)
    raw: dict = field(default_factory=dict)   # the pack's own sections, for its decoder

    @property
    def level(self) -> str:
        """"": an engine; else the level the pack is (the cuda level runs beside any engine)."""
        return self.raw.get("level", "")

    def cost_rules(self) -> dict[str, dict]:
        """Roofline cost models by op ([[cost]]: roofline.call_cost)."""
        return {rule["op"]: rule for rule in self.raw.get("cost", ())}

    def collector_class(self):
        module, _, cls = self.decoder.partition(":")
        return getattr(importlib.import_module(module), cls)


def cost_rules(pack_name: str | None) -> dict[str, dict]:
    """The pack's roofline cost models by op (its pack's [[cost]] tables); {} for none."""
    if not pack_name or pack_name not in pack_names():
        return {}
    return load_pack(pack_name).cost_rules()


def pack_names() -> list[str]:
    """The bundled packs: each registered engine's or level's pack.toml, by its name."""
    return [p.name for p in registry.plugins() if p.pack_file is not None]


def load_pack(name: str) -> Pack:
    """A bundled pack by name, or a pack file (a path ending in .toml)."""
    plugin = None
    if name.endswith(".toml"):
        try:
            text = procfs.read_regular(name, PACK_MAX_BYTES).decode()
        except OSError as e:
            raise ProfinferError(f"cannot read probe pack {name}: {e.strerror}") from None
        except UnicodeDecodeError:
            raise ProfinferError(f"probe pack {name}: not TOML (not UTF-8 text)") from None
        name = os.path.basename(name).removesuffix(".toml")
    else:
        plugin = registry.plugin(name)
        if plugin is None or plugin.pack_file is None:
            raise ProfinferError(f"no probe pack named {name}: the packs are {', '.join(pack_names())}")
        text = plugin.pack_file.read_text()
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ProfinferError(f"probe pack {name}: not TOML ({e})") from None
    if plugin is not None:          # a bundled pack
        raw = _declared_by(plugin, name, raw)
    missing = [k for k in ("engine", "bpf", "libraries", "decoder") if k not in raw]
    if missing:
        raise ProfinferError(f"probe pack {name}: no {', '.join(missing)}")
    wrong = [k for k in ("engine", "bpf", "decoder") if not isinstance(raw[k], str)]
    if wrong or not isinstance(raw["libraries"], list) or not all(isinstance(x, str) for x in raw["libraries"]):
        raise ProfinferError(f"probe pack {name}: {', '.join(wrong) or 'libraries'} must be "
                             f"{'text' if wrong else 'a list of texts'}")
    probes = []
    for p in raw.get("probe", ()):
        _check_probe(name, p)
        probes.append(ProbeSpec(
            level=p["level"], function=p.get("function"), pattern=p.get("pattern"),
            entry=p.get("entry"), ret=p.get("return"), args=tuple(p.get("args", ())),
            required=p.get("required", False), group=p.get("group"), callers=p.get("callers"),
            numbered=p.get("numbered", False), table=p))
    return Pack(name, raw["engine"], raw["bpf"], raw["libraries"], raw.get("marker", ""),
                raw["decoder"], probes, raw)


PLUGIN_DECLARES = ("engine", "bpf", "decoder", "level")


def _declared_by(plugin, name: str, raw: dict) -> dict:
    """A bundled pack's keys that its plugin declares (its title, BPF program, collector, and
    being a level), added to what its pack.toml reads from the binaries; declared in both
    places is an error, as is a plugin with a pack but no program or collector."""
    twice = [k for k in PLUGIN_DECLARES if k in raw]
    if twice:
        raise ProfinferError(f"probe pack {name}: {', '.join(twice)} in its pack.toml: its plugin "
                             f"({plugin.module}.PLUGIN) declares them")
    if not plugin.bpf or not plugin.collector:
        raise ProfinferError(f"plugin {plugin.module}: a pack.toml, but no bpf or collector in its PLUGIN")
    return {**raw, "engine": plugin.title or plugin.name, "bpf": plugin.bpf,
            "decoder": f"{plugin.module}.{plugin.collector}", **({"level": plugin.name} if plugin.kind == "level" else {})}


def _check_probe(pack: str, p) -> None:
    """ProfinferError unless a [[probe]] table has a level; a function or a pattern (a regular
    expression), one of them, not empty; callers (a regular expression) only with a function;
    and its args as a list of argument numbers, 1 to 6 (those passed in registers)."""
    if not isinstance(p, dict) or not isinstance(p.get("level"), str):
        raise ProfinferError(f"probe pack {pack}: each [[probe]] is a table with a level")
    named = [k for k in ("function", "pattern") if k in p]
    if len(named) != 1 or not isinstance(p[named[0]], str) or not p[named[0]]:
        raise ProfinferError(f"probe pack {pack}: each [[probe]] names a function or a pattern, one of "
                             f"them, as text")
    if "callers" in p and (named != ["function"] or not isinstance(p["callers"], str)):
        raise ProfinferError(f"probe pack {pack}: callers (a pattern, as text) go with a function")
    for key in ("pattern", "callers"):
        try:
            if key in p:
                re.compile(p[key])
        except re.error as e:
            raise ProfinferError(f"probe pack {pack}: {key} {p[key]!r} is no regular expression ({e})") from None
    args = p.get("args", [])
    if not isinstance(args, list) or not all(type(a) is int and 1 <= a <= 6 for a in args):
        raise ProfinferError(f"probe pack {pack}: a [[probe]]'s args are a list of argument numbers, 1 to 6")


@dataclass
class ResolvedProbe:
    spec: ProbeSpec
    elf: ElfInfo
    symbol: Symbol
    place: placement.Placement
    entry_fn: str | None
    return_fn: str | None


def is_engine_library(pack: Pack, name: str) -> bool:
    """Whether a file, by its name in the target, is one of the engine's libraries (a pattern
    with a `/` is matched on the whole path, else on the file name)."""
    return any(fnmatch.fnmatch(name if "/" in pattern else os.path.basename(name), pattern)
               for pattern in pack.libraries)


def engine_libraries(pack: Pack, paths: list[str], root: str = "/",
                     names: list[str] | None = None) -> list[ElfInfo]:
    """The engine's ELF files among `paths` (host paths to open); `names` are the same files'
    paths as the target sees them (what their file names are matched on)."""
    found = []
    for path, name in zip(paths, names or paths):
        if is_engine_library(pack, name):
            found.append(load_elf(path, root))
    if not found and pack.marker:
        # A statically linked engine: the executable itself defines the marker function.
        for path in paths:
            try:
                elf = load_elf(path, root)
            except ProfinferError:
                continue
            if elf.find(pack.marker):
                found.append(elf)
                break
    return found


def copies_of_probed(pack: Pack, lib_paths: list[tuple[str, str]], probed: list[ElfInfo],
                     probed_files: set[tuple[int, int]], root: str
                     ) -> tuple[list[tuple[ElfInfo, str]], list[str]]:
    """Files a followed process maps besides those already probed: copies of a probed build,
    as (that build's ElfInfo, the copy's path to open), and the others, each with why it is
    not probed (another build than the one being profiled)."""
    copies, skipped = [], []
    for host, name in lib_paths:
        if process.file_key(host) in probed_files:
            continue
        elf = next(iter(engine_libraries(pack, [host], root, [name])), None)
        same = [e for e in probed if elf is not None and e.build_id == elf.build_id]
        if same:
            copies.append((same[0], host))
        else:
            skipped.append(f"{name}: another build than the one being profiled")
    return copies, skipped


def resolve(pack: Pack, elfs: list[ElfInfo], levels: set[str]) -> tuple[list[ResolvedProbe], list[str]]:
    """Resolve every probe of the chosen levels; returns (probes, warnings)."""
    for elf in elfs:
        placement.require_supported(elf.path)
    out: list[ResolvedProbe] = []
    warnings: list[str] = []
    numbered = 0
    groups_done: set[str] = set()
    for spec in pack.probes:
        if spec.level not in levels or spec.group in groups_done:
            continue
        matches: list[tuple[ElfInfo, Symbol]] = []
        for elf in elfs:
            if spec.function:
                sym = elf.find(spec.function)
                if sym:
                    matches.append((elf, sym))
                    break
            else:
                rx = re.compile(spec.pattern)
                matches.extend((elf, s) for n, s in sorted(elf.symbols.items()) if rx.match(n))
        if not matches and spec.group and any(
                p.group == spec.group for p in pack.probes[pack.probes.index(spec) + 1:]):
            continue  # an alternative of the same group comes next
        if matches and spec.group:
            groups_done.add(spec.group)
        if not matches:
            what = spec.function or spec.pattern
            if spec.required:
                stripped = [e.path for e in elfs if not e.has_symtab]
                hint = f" (stripped: {', '.join(stripped)})" if stripped else ""
                raise ProfinferError(f"{pack.engine}: {what} not found, the {spec.level} level "
                                     f"cannot work with this build{hint}")
            home = spec.table.get("optional_with")
            if spec.function and not (spec.table.get("optional") and not (home and any(
                    fnmatch.fnmatch(os.path.basename(e.path), home) for e in elfs))):
                # optional: absent quietly where its library (`optional_with`) is not mapped
                # (llama-server's, in llama-completion); there without it: a renamed function
                warnings.append(f"{spec.function} not found: {spec.level} level partly degraded")
            continue
        if spec.callers and not spec.ret:
            sites = [(elf, site) for elf in elfs for site in call_sites(elf, spec.callers, spec.function)]
            if sites:
                for elf, (caller, offset) in sites:
                    out.append(ResolvedProbe(spec, elf, elf.find(caller),
                                             placement.Placement(offset, True, f"call {spec.function}"),
                                             spec.entry, None))
                continue
        for elf, sym in matches:
            entry, ret = spec.entry, spec.ret
            if spec.numbered:
                entry, ret = f"{entry}_{numbered}", f"{ret}_{numbered}"
                numbered += 1
            place = placement.choose(elf.code_bytes(sym, 64), spec.args)
            out.append(ResolvedProbe(spec, elf, sym, place, entry, ret))
    return out, warnings
