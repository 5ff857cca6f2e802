"""The collectors' shape: the attach sequence exists once, in the base class every
collector derives from; no collector carries more than ~25 instance attributes (its own and
its bases' together: an instance holds both), no other class there more than ~25 of its own,
and no function there is longer than ~80 lines. Read from the source, so a collector that
grows past either bound, or writes its own attach, fails here."""
from __future__ import annotations

import ast
import importlib.util
import inspect
import sys
import textwrap
from pathlib import Path

import pytest

from profinfer.core.plugin.collector import Collector
from profinfer.core.plugin.packs import load_pack, pack_names

sys.path.insert(0, str(Path(__file__).resolve().parent))     # the toy engine, kept in tests/
from toyengine.collector import ToyCollector  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent / "profinfer"
MODULES = ["core/plugin/collector.py", "core/ebpf/transport.py",
           "engines/llamacpp/collector.py", "engines/llamacpp/probes/probeplan.py",
           "engines/llamacpp/decode/records.py", "engines/llamacpp/decode/backends.py",
           "engines/llamacpp/decode/totals.py", "engines/vllm/collector.py", "engines/vllm/decode/calls.py",
           "engines/vllm/probes/probeplan.py", "engines/vllm/probes/probecost.py",
           "levels/cuda/collector.py", "levels/sched/probe.py"]
# the session and the daemon's agent, held to the same bounds
DRIVERS = ["core/session.py", "core/plugin/packfinder.py", "core/calibration/cputime.py",
           "daemon/agent.py", "daemon/attach.py", "daemon/drain.py", "daemon/node.py",
           "daemon/discovery/finder.py", "daemon/governor.py", "daemon/watch.py", "daemon/discovery/seen.py"]
# the base, each bundled plug-in's collector as its pack names it (llama.cpp's, vLLM's, the
# cuda level's: found through the registry, as the session finds them), and the toy engine's
COLLECTORS = [Collector, *(load_pack(name).collector_class() for name in pack_names()), ToyCollector]
MAX_ATTRIBUTES, MAX_LINES = 25, 80


def attributes(cls: ast.ClassDef) -> set[str]:
    """Instance attributes a class's own methods set (self.X = ..., self.X: T = ...)."""
    out = set()
    for node in ast.walk(cls):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
        for t in targets:
            for el in (t.elts if isinstance(t, ast.Tuple) else [t]):
                if isinstance(el, ast.Attribute) and isinstance(el.value, ast.Name) and el.value.id == "self":
                    out.add(el.attr)
    return out


def carried(cls: type) -> set[str]:
    """Instance attributes an instance of cls carries: those the methods of every class in its
    MRO set (a property is not one)."""
    out = set()
    for klass in cls.__mro__:
        if klass is object:
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        out |= attributes(tree.body[0])
    return out


def shapes(source: str):
    tree = ast.parse(source)
    classes = {c.name: attributes(c) for c in ast.walk(tree) if isinstance(c, ast.ClassDef)}
    functions = {f.name: f.end_lineno - f.lineno + 1 for f in ast.walk(tree)
                 if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}
    return classes, functions


@pytest.mark.parametrize("module", MODULES + DRIVERS)
def test_collector_classes_and_functions_stay_small(module):
    classes, functions = shapes((ROOT / module).read_text())
    big = {name: len(a) for name, a in classes.items() if len(a) > MAX_ATTRIBUTES}
    long = {name: n for name, n in functions.items() if n > MAX_LINES}
    assert not big, f"{module}: classes with more than {MAX_ATTRIBUTES} attributes: {big}"
    assert not long, f"{module}: functions longer than {MAX_LINES} lines: {long}"


@pytest.mark.parametrize("cls", COLLECTORS, ids=lambda c: f"{c.__module__}.{c.__name__}")
def test_a_collector_carries_few_attributes(cls):
    names = carried(cls)
    assert len(names) <= MAX_ATTRIBUTES, \
        f"{cls.__name__} carries {len(names)} attributes through its MRO: {sorted(names)}"


def test_the_attach_sequence_exists_once():
    bundled = COLLECTORS[1:-1]
    assert len(bundled) >= 3, bundled          # llama.cpp's, vLLM's, the cuda level's at least
    for cls in bundled:
        assert issubclass(cls, Collector)
        # a subclass may do more after it (vLLM's server metrics window), never the sequence
        if "attach" in cls.__dict__:
            assert "super().attach()" in inspect.getsource(cls.attach), cls
    sources = {m: (ROOT / m).read_text() for m in MODULES
               if m not in ("core/plugin/collector.py", "core/ebpf/transport.py")}
    for module, text in sources.items():
        for needle in ("enable_run_time_stats(", "EventTransport(", "reuse_map(\"followed\"",
                       "attach_failed("):
            assert needle not in text, f"{module} repeats the attach sequence ({needle})"


def test_a_class_past_the_bound_is_caught():
    """The check itself: a class that sets too many attributes, a function too long."""
    fields = "\n".join(f"        self.a{i} = {i}" for i in range(MAX_ATTRIBUTES + 1))
    body = "\n".join("    x = 1" for _ in range(MAX_LINES))
    classes, functions = shapes(f"class Big:\n    def __init__(self):\n{fields}\n\n"
                                f"def long():\n{body}\n")
    assert len(classes["Big"]) == MAX_ATTRIBUTES + 1
    assert functions["long"] == MAX_LINES + 1


def test_attributes_are_counted_through_the_bases(tmp_path):
    """The MRO count itself: a base and a subclass each within the bound alone, past it
    together, and a property (read-only) that is not counted."""
    half = MAX_ATTRIBUTES // 2 + 1
    base = "\n".join(f"        self.b{i} = {i}" for i in range(half))
    sub = "\n".join(f"        self.s{i} = {i}" for i in range(half))
    path = tmp_path / "shape_probe.py"
    path.write_text(f"class Base:\n    def __init__(self):\n{base}\n\n"
                    f"    @property\n    def p(self):\n        return self.b0\n\n\n"
                    f"class Sub(Base):\n    def __init__(self):\n        super().__init__()\n{sub}\n")
    spec = importlib.util.spec_from_file_location("shape_probe", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["shape_probe"] = module
    try:
        spec.loader.exec_module(module)
        assert len(carried(module.Base)) == half <= MAX_ATTRIBUTES
        assert len(shapes(path.read_text())[0]["Sub"]) == half <= MAX_ATTRIBUTES
        assert len(carried(module.Sub)) == 2 * half > MAX_ATTRIBUTES
        assert "p" not in carried(module.Sub)
    finally:
        del sys.modules["shape_probe"]
