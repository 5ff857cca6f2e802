"""The import rules of docs/architecture.md, checked on every module's imports (read with ast,
imports inside functions included):

- the core imports no engine or level;
- the exporters, the viewers and the daemon import no engine or level (they reach them
  through profinfer.core.registry);
- an engine imports only the core, the levels and itself (never another engine);
- a level imports only the core and itself;
- no arrow runs back up: the core, the engines and the levels never import the application
  (exporters, viewers, daemon, cli, outputs, doctor);
- the core is in rooms, each importing only the rooms below it: base, profile, target, ebpf,
  calibration, diff, plugin, then the core's own top (the session, the follower, the
  pricing); a core module sits in a room or is one of the top's; a room holds at most 15
  modules and says in its __init__.py what it is for; no core module is over 500 lines;
- no folder of the package holds over 15 modules, no module is over 500 lines, and the
  daemon's Agent (its loop and status) is under 400;
- no import cycles among modules;
- only a plugin reads its records: outside a plugin's folder no code compares a record's
  `what` with a kind its pack declares, or names a function its pack probes (the daemon
  hands a level's records to the level's daemon_metrics);
- the tests mirror the code: each folder of tests is a folder of profinfer/ (or a tier:
  soak, gpu), and an engine's internals are imported only by the tests in its own folder
  (tests/engines/<name>/), its bundled workload excepted.

Each rule has a negative case: a small package tree written to tmp_path with one breach of
that rule, which the checker must report, and a clean tree, which it must not."""
from __future__ import annotations

import ast
import textwrap
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TOY_ENGINE = ROOT / "tests" / "toyengine"

APPLICATION = ("exporters", "viewers", "daemon", "cli", "outputs", "doctor")
# the core's rooms, lowest first; the core's top (these modules, directly in core/) above them
ROOMS = ("base", "profile", "target", "ebpf", "calibration", "diff", "plugin")
CORE_TOP = ("session", "follow", "pricing")
THROUGH_REGISTRY = ("exporters", "viewers", "daemon")


# ---- the checker ----

def module_name(path: Path, top: Path) -> str:
    """`profinfer/core/x.py` -> `profinfer.core.x`; a package's __init__.py -> the package."""
    parts = list(path.relative_to(top.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(name: str, modules: set[str]) -> str:
    """The module an imported name lives in: the name itself when it is a module, else its
    longest prefix that is (`from pkg.mod import func` -> pkg.mod)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name


def imports_of(path: Path, module: str, is_package: bool, modules: set[str]) -> list[tuple[str, int]]:
    """(imported module of the tree, line) for every import in the file, at any depth."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if is_package else module.rpartition(".")[0]
    found: list[tuple[str, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            # `from pkg import mod` imports the module pkg.mod when there is one
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                     for a in node.names]
        else:
            continue
        for n in names:
            target = _resolve(n, modules)
            if target and target != module and (target, node.lineno) not in found:
                found.append((target, node.lineno))
    return found


def import_graph(tops: list[Path]) -> dict[str, list[tuple[str, int, str]]]:
    """module -> [(imported module, line, file)] for every .py file under the package
    folders `tops` (each a top-level package, e.g. profinfer/ or tests/toyengine/)."""
    files = {}
    for top in tops:
        for path in sorted(top.rglob("*.py")):
            files[module_name(path, top)] = path
    modules = set(files)
    return {m: [(t, line, str(p)) for t, line in imports_of(p, m, p.name == "__init__.py", modules)]
            for m, p in files.items()}


def part_of(module: str, project: str = "profinfer") -> tuple[str, str]:
    """(part, the plugin or module it is): ("core", ""), ("engine", "vllm"), ("level",
    "cuda"), ("app", "daemon"); a top-level package other than the project's is an engine
    kept outside the tree (PROFINFER_PLUGINS): ("engine", its name)."""
    parts = module.split(".")
    if parts[0] != project:
        return "engine", parts[0]
    if len(parts) == 1:
        return "app", ""
    if parts[1] == "core":
        return "core", ""
    if parts[1] in ("engines", "levels"):
        kind = "engine" if parts[1] == "engines" else "level"
        return kind, parts[2] if len(parts) > 2 else ""
    return "app", parts[1]


def room_of(module: str) -> str | None:
    """The core room a core module is in ("top" for the session and the follower, None for a
    module that is in none)."""
    parts = module.split(".")
    if len(parts) < 3:
        return "top"                    # the core package itself
    if parts[2] in ROOMS:
        return parts[2]
    return "top" if parts[2] in CORE_TOP and len(parts) == 3 else None


def _rank(room: str) -> int:
    return ROOMS.index(room) if room in ROOMS else len(ROOMS)


def breaches(graph: dict[str, list[tuple[str, int, str]]], project: str = "profinfer") -> list[str]:
    """Every import that breaks a rule, as "file:line: module imports target (rule)"."""
    out = []
    for module, targets in sorted(graph.items()):
        part, name = part_of(module, project)
        room = room_of(module) if part == "core" else None
        if part == "core" and room is None:
            out.append(f"{module}: a core module sits in a room ({', '.join(ROOMS)}) or is one of the "
                       f"core's top ({', '.join(CORE_TOP)})")
        for target, line, path in targets:
            tpart, tname = part_of(target, project)
            why = None
            troom = room_of(target) if tpart == "core" else None
            if room and troom and _rank(troom) > _rank(room):
                above = f"room {troom}" if troom in ROOMS else "the core's top"
                why = f"room {room} imports {above} above it"
            elif part == "core" and tpart in ("engine", "level"):
                why = f"the core imports no {tpart}"
            elif part == "app" and name in THROUGH_REGISTRY and tpart in ("engine", "level"):
                why = f"the {name} must reach {tpart}s through profinfer.core.registry"
            elif part == "engine" and tpart == "engine" and tname and tname != name:
                why = "an engine imports no other engine"
            elif part == "level" and tpart in ("engine", "level") and tname and tname != name:
                why = "a level imports only the core"
            elif part in ("core", "engine", "level") and tpart == "app":
                why = f"no arrow back up: the {part} imports no application module"
            if why:
                out.append(f"{path}:{line}: {module} imports {target} ({why})")
    out.extend(f"import cycle: {' -> '.join(c)}" for c in cycles(graph))
    return out


def cycles(graph: dict[str, list[tuple[str, int, str]]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan)."""
    edges = {m: sorted({t for t, _, _ in ts if t in graph}) for m, ts in graph.items()}
    index, low, stack, on_stack, comps = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return [_cycle_in(comp, edges) for comp in comps]


def _cycle_in(comp: list[str], edges: dict[str, list[str]]) -> list[str]:
    """A shortest closed path through the component, from its first module back to it."""
    start, inside = comp[0], set(comp)
    came_from, queue = {start: None}, [start]
    for v in queue:                       # breadth first: the queue grows as it is read
        if start in edges[v]:
            path = [v]
            while came_from[path[-1]] is not None:
                path.append(came_from[path[-1]])
            return path[::-1] + [start]
        for w in edges[v]:
            if w in inside and w not in came_from:
                came_from[w] = v
                queue.append(w)
    raise AssertionError(f"no cycle through {start}")   # a component always has one


# ---- the project ----

def test_the_project_keeps_the_rules():
    tops = [ROOT / "profinfer"] + ([TOY_ENGINE] if TOY_ENGINE.is_dir() else [])
    found = breaches(import_graph(tops))
    assert not found, f"{len(found)} imports break docs/architecture.md:\n" + "\n".join(found)


def test_the_checker_sees_the_project():
    """The graph is the real one: the registry is imported, and an import made inside a
    function (cli imports the session only in its commands) is seen."""
    graph = import_graph([ROOT / "profinfer"])
    assert len(graph) > 80
    users = {m for m, ts in graph.items() if any(t == "profinfer.core.base.registry" for t, _, _ in ts)}
    assert "profinfer.engines.vllm" in users and "profinfer.levels.cuda" in users
    cli_targets = {t for t, _, _ in graph["profinfer.cli"]}
    assert "profinfer.core.session" in cli_targets


# ---- the checker catches each kind of breach ----

CLEAN = {
    "pkg/__init__.py": "",
    "pkg/core/__init__.py": "",
    "pkg/core/base/__init__.py": "",
    "pkg/core/base/registry.py": "import importlib\n",
    "pkg/core/profile/__init__.py": "",
    "pkg/core/profile/model.py": "from dataclasses import dataclass\n",
    "pkg/core/profile/stats.py": "from pkg.core.profile import model\nfrom pkg.core.base import registry\n",
    "pkg/core/session.py": "from pkg.core.profile import model\nfrom pkg.core.base import registry\n",
    "pkg/engines/__init__.py": "",
    "pkg/engines/alpha/__init__.py": "from pkg.core.base.registry import importlib\n",
    "pkg/engines/alpha/collector.py": ("from pkg.core.profile import model\nfrom pkg.levels.cuda import names\n"
                                       "from . import stats\n"),
    "pkg/engines/alpha/stats.py": "from pkg.core.profile.model import dataclass\n",
    "pkg/engines/beta/__init__.py": "from pkg.core.base import registry\n",
    "pkg/levels/__init__.py": "",
    "pkg/levels/cuda/__init__.py": "from pkg.core.base import registry\n",
    "pkg/levels/cuda/names.py": "from pkg.core.profile import model\n",
    "pkg/levels/sched/__init__.py": "from pkg.core.base import registry\n",
    "pkg/exporters/__init__.py": "",
    "pkg/exporters/perfetto.py": "from pkg.core.profile import model\nfrom pkg.core.base import registry\n",
    "pkg/viewers/__init__.py": "",
    "pkg/viewers/table.py": "from pkg.core.base.registry import importlib\n",
    "pkg/daemon/__init__.py": "",
    "pkg/daemon/agent.py": "from pkg.core import session\n",
    "pkg/outputs.py": "from pkg.exporters import perfetto\n",
    "pkg/cli.py": "from pkg import outputs\nfrom pkg.engines.alpha import collector\n",
}

# one breach each: (file, the line added, what the report must say)
BREACHES = {
    "core imports an engine": ("pkg/core/session.py", "from pkg.engines.alpha import stats",
                               "the core imports no engine"),
    "core imports a level, inside a function": (
        "pkg/core/session.py", "def f():\n    import pkg.levels.cuda.names", "the core imports no level"),
    "exporter imports an engine": ("pkg/exporters/perfetto.py", "from pkg.engines.beta import *",
                                   "the exporters must reach engines through"),
    "viewer imports a level": ("pkg/viewers/table.py", "from pkg.levels.cuda.names import x",
                               "the viewers must reach levels through"),
    "daemon imports an engine's module": ("pkg/daemon/agent.py", "from pkg.engines.alpha.stats import y",
                                          "the daemon must reach engines through"),
    "engine imports another engine": ("pkg/engines/alpha/stats.py", "from pkg.engines.beta import z",
                                      "an engine imports no other engine"),
    "level imports another level": ("pkg/levels/cuda/names.py", "from pkg.levels.sched import q",
                                    "a level imports only the core"),
    "exporter imports the engines' package": ("pkg/exporters/perfetto.py", "import pkg.engines",
                                              "the exporters must reach engines through"),
    "level imports an engine": ("pkg/levels/cuda/names.py", "from pkg.engines import alpha",
                                "a level imports only the core"),
    "core imports the application": ("pkg/core/session.py", "from pkg.viewers import table",
                                     "no arrow back up: the core imports no application"),
    "engine imports the application": ("pkg/engines/alpha/collector.py", "from ...viewers import table",
                                       "no arrow back up: the engine imports no application"),
    "a cycle through a lazy import": ("pkg/core/profile/model.py", "def g():\n    from pkg.core.profile import stats",
                                      "import cycle: pkg.core.profile.model -> pkg.core.profile.stats -> "
                                      "pkg.core.profile.model"),
    "a room imports a room above it": ("pkg/core/base/registry.py", "from pkg.core.profile.model import dataclass",
                                       "room base imports room profile above it"),
    "a room imports the core's top, inside a function": (
        "pkg/core/profile/stats.py", "def h():\n    from pkg.core import session",
        "room profile imports the core's top above it"),
    "a core module in no room": ("pkg/core/loose.py", "from pkg.core.base import registry",
                                 "a core module sits in a room"),
}


def _tree(tmp_path: Path, change: tuple[str, str] | None = None) -> list[str]:
    for rel, text in CLEAN.items():
        f = tmp_path / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        if change and change[0] == rel:
            text += textwrap.dedent(change[1]) + "\n"
        f.write_text(text)
    if change and change[0] not in CLEAN:      # a module of its own
        (tmp_path / change[0]).write_text(textwrap.dedent(change[1]) + "\n")
    return breaches(import_graph([tmp_path / "pkg"]), project="pkg")


def test_a_clean_tree_has_no_breach(tmp_path):
    assert _tree(tmp_path) == []


@pytest.mark.parametrize("kind", sorted(BREACHES))
def test_the_checker_catches(tmp_path, kind):
    rel, line, says = BREACHES[kind]
    found = _tree(tmp_path, (rel, line))
    assert len(found) == 1 and says in found[0], found


def test_an_outside_engine_is_an_engine(tmp_path):
    """A plugin kept outside the tree (PROFINFER_PLUGINS) is held to an engine's rules."""
    _tree(tmp_path)
    (tmp_path / "toy").mkdir()
    (tmp_path / "toy" / "__init__.py").write_text("from pkg.core.base import registry\n"
                                                  "from pkg.viewers import table\n")
    found = breaches(import_graph([tmp_path / "pkg", tmp_path / "toy"]), project="pkg")
    assert len(found) == 1 and "toy imports pkg.viewers.table" in found[0], found


# ---- only a plugin reads its records ----

def pack_vocabulary(top: Path) -> dict[str, tuple[set[str], set[str]]]:
    """Each plugin folder under top (one with a pack.toml): the record kinds its pack declares
    (each function's `what`) and the functions it probes (a level's functions' names, an
    engine's probes' functions)."""
    found = {}
    for pack in sorted(top.glob("*/*/pack.toml")):
        spec = tomllib.loads(pack.read_text())
        functions = spec.get("function", [])
        probes = spec.get("probe", [])
        found[str(pack.parent.relative_to(top))] = ({f["what"] for f in functions if "what" in f},
                                                    {n for f in functions for n in f.get("names", [])}
                                                    | {p["function"] for p in probes if "function" in p})
    return found


def _docstrings(tree: ast.AST) -> set[int]:
    return {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}


def record_readers(top: Path) -> list[str]:
    """Code outside a plugin's folder that tests the plugin's record kinds (x.what == "launch",
    x.what in ("copy", ...)) or names a function its pack probes."""
    vocab = pack_vocabulary(top)
    found = []
    for path in sorted(top.rglob("*.py")):
        rel = path.relative_to(top)
        others = {folder: v for folder, v in vocab.items() if not str(rel).startswith(folder + "/")}
        kinds = {k: f for f, (ks, _) in others.items() for k in ks}
        functions = {n: f for f, (_, ns) in others.items() for n in ns}
        tree = ast.parse(path.read_text(), str(path))
        docs = _docstrings(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
                if not any(isinstance(x, ast.Attribute) and x.attr == "what" for x in sides):
                    continue
                for x in sides:
                    values = x.elts if isinstance(x, (ast.Tuple, ast.List, ast.Set)) else [x]
                    for v in values:
                        if isinstance(v, ast.Constant) and v.value in kinds:
                            found.append(f"{rel}:{node.lineno} tests {kinds[v.value]}'s record kind {v.value!r}")
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
                words = node.value.split()
                for name in sorted(functions):
                    if any(w.startswith(name) for w in words):
                        found.append(f"{rel}:{node.lineno} names {functions[name]}'s function {name}")
                        break
    return found


def test_only_a_plugin_reads_its_records():
    found = record_readers(ROOT / "profinfer")
    assert not found, "\n".join(found)


READERS_CLEAN = {
    "pkg/levels/gpu/pack.toml": '[[function]]\nnames = ["gpuLaunch", "gpuAlloc"]\nwhat = "launch"\n',
    "pkg/levels/gpu/metrics.py": 'def count(c):\n    return c.what == "launch" and c.api.startswith("gpuAlloc")\n',
    "pkg/daemon/agent.py": '"""Hands gpuLaunch records on."""\ndef seen(ev):\n    return ev.what == "exec"\n',
    "pkg/engines/toy/pack.toml": '[[probe]]\nfunction = "toy_decode"\n',
}
READERS_BREACHES = {
    "a kind compared": ('pkg/daemon/agent.py', 'def kernels(g):\n    return [c for c in g if c.what == "launch"]'),
    "a kind in a tuple": ('pkg/daemon/agent.py', 'def kernels(g):\n    return [c for c in g if c.what in ("exec", "launch")]'),
    "a probed function named": ('pkg/core/session.py', 'def live(c):\n    return c.api.startswith("gpuAlloc")'),
    "an engine's probed function named": ('pkg/daemon/agent.py', 'STEP = "toy_decode"'),
}


def _readers_tree(tmp_path: Path, change: tuple[str, str] | None = None) -> list[str]:
    for rel, text in READERS_CLEAN.items():
        f = tmp_path / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text + ("\n" + change[1] + "\n" if change and change[0] == rel else ""))
    if change and change[0] not in READERS_CLEAN:
        (tmp_path / change[0]).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / change[0]).write_text(change[1] + "\n")
    return record_readers(tmp_path / "pkg")


def test_the_record_reader_check_catches(tmp_path):
    assert _readers_tree(tmp_path / "clean") == []
    for kind, change in READERS_BREACHES.items():
        found = _readers_tree(tmp_path / kind.replace(" ", "_"), change)
        assert len(found) == 1, (kind, found)


# ---- the core's rooms stay small and say what they are for ----

MAX_ROOM_MODULES = 15
MAX_CORE_MODULE_LINES = 500


def room_findings(core: Path) -> list[str]:
    """Each room of `core` with more than MAX_ROOM_MODULES modules (its sub-packages' too) or
    without a docstring in its __init__.py, and each core module over MAX_CORE_MODULE_LINES."""
    out = []
    for room in ROOMS:
        folder = core / room
        if not folder.is_dir():
            continue
        modules = [f for f in folder.rglob("*.py") if f.name != "__init__.py"]
        if len(modules) > MAX_ROOM_MODULES:
            out.append(f"core/{room}: {len(modules)} modules (at most {MAX_ROOM_MODULES})")
        init = folder / "__init__.py"
        if not init.is_file() or ast.get_docstring(ast.parse(init.read_text())) is None:
            out.append(f"core/{room}: its __init__.py says nothing of what the room is for")
    for f in sorted(core.rglob("*.py")):
        n = len(f.read_text().splitlines())
        if n > MAX_CORE_MODULE_LINES:
            out.append(f"{f.relative_to(core.parent)}: {n} lines (at most {MAX_CORE_MODULE_LINES})")
    return out


def test_the_core_rooms_are_small_and_say_what_they_are_for():
    found = room_findings(ROOT / "profinfer" / "core")
    assert not found, "\n".join(found)


def _rooms_tree(tmp_path: Path) -> Path:
    core = tmp_path / "core"
    for room in ROOMS:
        (core / room).mkdir(parents=True)
        (core / room / "__init__.py").write_text(f'"""The {room} room."""\n')
        (core / room / "a.py").write_text("x = 1\n" * MAX_CORE_MODULE_LINES)
    return core


@pytest.mark.parametrize("breach", ["sixteen modules", "no docstring", "a long module"])
def test_the_room_checks_catch(tmp_path, breach):
    core = _rooms_tree(tmp_path)
    assert room_findings(core) == []
    if breach == "sixteen modules":
        (core / "target" / "arch").mkdir()
        for i in range(MAX_ROOM_MODULES):        # 15 more, one room down: 16
            (core / "target" / "arch" / f"m{i}.py").write_text("")
        says = "core/target: 16 modules"
    elif breach == "no docstring":
        (core / "ebpf" / "__init__.py").write_text("# rooms\n")
        says = "core/ebpf: its __init__.py says nothing"
    else:
        (core / "diff" / "a.py").write_text("x = 1\n" * (MAX_CORE_MODULE_LINES + 1))
        says = f"core/diff/a.py: {MAX_CORE_MODULE_LINES + 1} lines"
    found = room_findings(core)
    assert len(found) == 1 and says in found[0], found



# ---- every folder and module of the package stays small; the agent is its loop ----

MAX_FOLDER_MODULES = 15         # .py files directly in a folder, its __init__.py included
MAX_MODULE_LINES = 500
MAX_AGENT_LINES = 400
AGENT = ("daemon/agent.py", "Agent")


def size_findings(package: Path) -> list[str]:
    """Each folder of `package` with more than MAX_FOLDER_MODULES modules, each module over
    MAX_MODULE_LINES lines, and the daemon's Agent class over MAX_AGENT_LINES."""
    out = []
    for folder in sorted([package, *(d for d in package.rglob("*") if d.is_dir())]):
        modules = list(folder.glob("*.py"))
        if len(modules) > MAX_FOLDER_MODULES:
            out.append(f"{folder.relative_to(package.parent)}: {len(modules)} modules (at most {MAX_FOLDER_MODULES})")
    for f in sorted(package.rglob("*.py")):
        n = len(f.read_text().splitlines())
        if n > MAX_MODULE_LINES:
            out.append(f"{f.relative_to(package.parent)}: {n} lines (at most {MAX_MODULE_LINES})")
    agent = package / AGENT[0]
    for node in ast.parse(agent.read_text()).body if agent.is_file() else []:
        if isinstance(node, ast.ClassDef) and node.name == AGENT[1]:
            n = node.end_lineno - node.lineno + 1
            if n > MAX_AGENT_LINES:
                out.append(f"{agent.relative_to(package.parent)}: {AGENT[1]} is {n} lines (at most {MAX_AGENT_LINES})")
    return out


def test_every_folder_and_module_is_small():
    found = size_findings(ROOT / "profinfer")
    assert not found, "\n".join(found)
    agent = ast.parse((ROOT / "profinfer" / AGENT[0]).read_text())      # the bound still finds what it bounds
    assert any(isinstance(n, ast.ClassDef) and n.name == AGENT[1] for n in agent.body), AGENT


@pytest.mark.parametrize("breach", ["sixteen modules", "a long module", "a long agent"])
def test_the_size_checks_catch(tmp_path, breach):
    package = tmp_path / "pkg"
    (package / "daemon").mkdir(parents=True)
    for i in range(MAX_FOLDER_MODULES - 1):          # with the agent: 15
        (package / "daemon" / f"m{i}.py").write_text("x = 1\n" * MAX_MODULE_LINES)
    (package / "daemon" / "agent.py").write_text(
        "class Agent:\n" + "    x = 1\n" * (MAX_AGENT_LINES - 1) + "\n\ndef after():\n    pass\n")
    assert size_findings(package) == []
    if breach == "sixteen modules":
        (package / "daemon" / "__init__.py").write_text("")
        says = "pkg/daemon: 16 modules"
    elif breach == "a long module":
        (package / "daemon" / "m3.py").write_text("x = 1\n" * (MAX_MODULE_LINES + 1))
        says = f"pkg/daemon/m3.py: {MAX_MODULE_LINES + 1} lines"
    else:
        (package / "daemon" / "agent.py").write_text("class Agent:\n" + "    x = 1\n" * MAX_AGENT_LINES)
        says = f"pkg/daemon/agent.py: Agent is {MAX_AGENT_LINES + 1} lines"
    found = size_findings(package)
    assert len(found) == 1 and says in found[0], found

# ---- the tests mirror the code ----

TESTS = ROOT / "tests"
TIERS = ("soak", "gpu")          # tests/<tier>/: chosen by name (conftest.py's markers)
TEST_HELPERS = ("helpers", "golden", "toyengine")     # folders of the tests' own, no test modules mirrored


def folders_off_the_code(root: Path = ROOT) -> list[str]:
    """Each folder of test modules under tests/ that mirrors no folder of profinfer/ (and is
    no tier): where a test of that part of the code would be looked for, it is not."""
    tests = root / "tests"
    out = []
    for path in sorted(tests.rglob("test_*.py")):
        folder = path.parent.relative_to(tests)
        if folder.parts and folder.parts[0] in TIERS + TEST_HELPERS:
            continue
        if not (root / "profinfer" / folder).is_dir():
            out.append(f"{path.relative_to(root)}: tests/{folder} mirrors no profinfer/{folder}")
    return out


def engine_internals_outside(root: Path = ROOT) -> list[str]:
    """Every import of an engine's modules by a test outside tests/engines/<that engine>/,
    but of its bundled workload (the session's fixtures build it): a test of an engine's
    internals belongs with that engine's tests."""
    tests, out = root / "tests", []
    for path in sorted(tests.rglob("*.py")):
        rel = path.relative_to(tests).parts
        owner = rel[1] if len(rel) > 2 and rel[0] == "engines" else None
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            for name in names:
                parts = name.split(".")
                if parts[:2] == ["profinfer", "engines"] and len(parts) > 2 and parts[2] != owner \
                        and parts[3:4] != ["workload"]:
                    out.append(f"tests/{'/'.join(rel)}:{node.lineno}: imports {name} "
                               f"(an engine's internals are tested in tests/engines/{parts[2]}/)")
    return out


def test_the_tests_mirror_the_code():
    assert not folders_off_the_code(), folders_off_the_code()
    found = engine_internals_outside()
    assert not found, "\n".join(found)


def test_the_test_layout_checks_catch(tmp_path):
    """Negative cases: a test folder with no code folder, and a test of one engine's
    internals kept outside that engine's test folder, are each reported; a workload import
    and an engine's test in its own folder are not."""
    (tmp_path / "profinfer" / "engines" / "alpha").mkdir(parents=True)
    (tmp_path / "profinfer" / "core").mkdir()
    for rel, text in {"tests/core/test_a.py": "from profinfer.engines.alpha import workload\n",
                      "tests/engines/alpha/test_b.py": "from profinfer.engines.alpha.collector import C\n",
                      "tests/soak/test_c.py": "",
                      "tests/reports/test_d.py": "",
                      "tests/daemon2/test_e.py": "import profinfer.engines.alpha.stats\n"}.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    assert folders_off_the_code(tmp_path) == [
        "tests/daemon2/test_e.py: tests/daemon2 mirrors no profinfer/daemon2",
        "tests/reports/test_d.py: tests/reports mirrors no profinfer/reports"]
    found = engine_internals_outside(tmp_path)
    assert len(found) == 1 and found[0].startswith("tests/daemon2/test_e.py:1: imports profinfer.engines.alpha.stats"), found
