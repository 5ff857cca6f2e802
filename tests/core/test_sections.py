"""The report and the JSON summary are made of the plugins' sections (core.sections): a plugin
from outside profinfer, named in PROFINFER_PLUGINS, adds its own where its order puts it, and
an engine's view replaces the neutral one for the profiles it holds; profinfer's own code
names neither."""
from __future__ import annotations

import textwrap

import pytest
from rich.console import Console

from profinfer.core.profile.model import Profile
from profinfer.exporters.json_summary import summary
from profinfer.viewers.optable import render
from test_optable import profile as llama_profile

PLUGIN = """
from profinfer.core.base.registry import Engine, Level

LEVEL = Level("pi_test_level", __name__, title="a test level", report="level_report")
ENGINE = Engine("pi_test_engine", __name__, title="a test engine", report="engine_report")
"""

LEVEL_REPORT = """
from profinfer.core.plugin.sections import ReportSection, SummarySection

def _keys(profile):
    return {"test_level": {"ops": len(profile.ops)}} if profile.ops else {}

def _print(profile, console):
    if profile.ops:
        console.print(f"test level: {len(profile.ops)} ops")

SUMMARY = (SummarySection(55, _keys),)
REPORT = (ReportSection(47, _print),)
"""

ENGINE_REPORT = """
from profinfer.core.plugin.sections import ReportSection, SummarySection, View

def holds(profile):
    return profile.meta.get("engine") == "test"

VIEW = View(summary=(SummarySection(0, lambda p: {"pid": p.pid, "engine": "test"}),),
            report=(ReportSection(0, lambda p, c: c.print("the test engine's own view")),))
"""


@pytest.fixture
def test_plugins(tmp_path, monkeypatch):
    pkg = tmp_path / "pi_test_plugins"
    pkg.mkdir()
    for name, text in (("__init__", PLUGIN), ("level_report", LEVEL_REPORT), ("engine_report", ENGINE_REPORT)):
        (pkg / f"{name}.py").write_text(textwrap.dedent(text))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PROFINFER_PLUGINS", "pi_test_plugins:LEVEL,pi_test_plugins:ENGINE")


def rendered(p: Profile) -> str:
    console = Console(record=True, width=200, color_system=None)
    render(p, console)
    return console.export_text()


def test_a_plugins_sections_stand_where_their_order_puts_them(test_plugins):
    p = llama_profile()
    keys = list(summary(p))
    # after llama.cpp's analyses (40, 41) and the profiler's cost (50), before cuda's (60)
    assert keys[-1] == "test_level" and keys.index("layers") < keys.index("test_level")
    assert summary(p)["test_level"] == {"ops": 4}
    text = rendered(p)
    # after the neutral view's threads and the levels beside the ops, before the lost events
    assert text.index("Threads") < text.index("test level: 4 ops") < text.index("events were lost")


def test_without_the_plugin_its_sections_are_gone():
    p = llama_profile()
    assert "test_level" not in summary(p)
    assert "test level" not in rendered(p)


def test_an_engine_that_holds_the_profile_shows_its_own_view(test_plugins):
    p = llama_profile()
    p.tokens, p.meta["engine"] = [], "test"
    s = summary(p)
    assert s["engine"] == "test" and "decode_calls" not in s    # not the neutral view's keys
    assert s["test_level"] == {"ops": 4}                          # the levels' sections still come
    text = rendered(p)
    assert "the test engine's own view" in text and "Phases" not in text
    assert "test level: 4 ops" in text
