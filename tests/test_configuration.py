"""Configuration in one place: every PROFINFER_* setting is read from the environment by
profinfer/core/base/config.py alone, docs/configuration.md lists exactly the settings it
declares, and `profinfer doctor` shows the ones in effect (a secret as set, never its value)."""
from __future__ import annotations

import ast
import os
import re
import subprocess
from pathlib import Path

from conftest import PROFINFER

from profinfer.core.base import config

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "profinfer" / "core" / "base" / "config.py"


def _is_environ(node: ast.AST) -> bool:
    """os.environ or environ (imported from os)."""
    return (isinstance(node, ast.Attribute) and node.attr == "environ") or \
        (isinstance(node, ast.Name) and node.id == "environ")


def environment_reads(path: Path) -> list[str]:
    """Each read of a PROFINFER_* variable from the environment in `path`, as "file:line NAME":
    os.environ.get(K), os.environ[K], os.getenv(K), with K a literal or a module-level name
    bound to one."""
    tree = ast.parse(path.read_text())
    names = {t.id: n.value.value for n in tree.body if isinstance(n, ast.Assign)
             and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)
             for t in n.targets if isinstance(t, ast.Name)}

    def key(node: ast.AST) -> str | None:
        value = node.value if isinstance(node, ast.Constant) else names.get(getattr(node, "id", None))
        return value if isinstance(value, str) and value.startswith("PROFINFER_") else None

    found = []
    for node in ast.walk(tree):
        k = None
        if isinstance(node, ast.Call) and node.args:
            f = node.func
            if isinstance(f, ast.Attribute) and (f.attr == "get" and _is_environ(f.value) or f.attr == "getenv"):
                k = key(node.args[0])
        elif isinstance(node, ast.Subscript) and _is_environ(node.value) and isinstance(node.ctx, ast.Load):
            k = key(node.slice)
        if k:
            found.append(f"{path.name}:{node.lineno} {k}")
    return found


def test_only_config_reads_the_settings():
    found = [r for f in sorted((ROOT / "profinfer").rglob("*.py")) if f != CONFIG
             for r in environment_reads(f)]
    assert not found, "read outside profinfer/core/base/config.py: " + ", ".join(found)


def test_the_checker_sees_each_way_of_reading(tmp_path):
    f = tmp_path / "m.py"
    f.write_text('import os\nfrom os import environ\nNAME = "PROFINFER_B"\n'
                 'a = os.environ.get("PROFINFER_A")\nb = os.environ[NAME]\n'
                 'c = os.getenv("PROFINFER_C", "x")\nd = environ.get("PROFINFER_D")\n'
                 'e = os.environ.get("HOME")\nos.environ.pop("PROFINFER_E", None)\n')
    assert [r.split()[1] for r in environment_reads(f)] == ["PROFINFER_A", "PROFINFER_B", "PROFINFER_C",
                                                           "PROFINFER_D"]


def test_the_docs_list_every_setting():
    text = (ROOT / "docs" / "configuration.md").read_text()
    product = text.split("## The set-up's and the tests' own")[0]
    listed = set(re.findall(r"^\| `(PROFINFER_[A-Z_]+)`", product, re.M))
    assert listed == set(config.SETTINGS), (sorted(listed ^ set(config.SETTINGS)))


def test_doctor_shows_the_settings_in_effect():
    env = {k: v for k, v in os.environ.items() if not k.startswith("PROFINFER_")}
    env.update(PROFINFER_OP_DESIGN="two-probe", PROFINFER_TOKEN="a-secret-of-ours", COLUMNS="400")
    out = subprocess.run(PROFINFER + ["doctor", "--no-workloads"], env=env, capture_output=True,
                         text=True, timeout=120).stdout
    row = next(line for line in out.splitlines() if "settings" in line)
    assert "PROFINFER_OP_DESIGN=two-probe" in row and "PROFINFER_TOKEN=set" in row, row
    assert "a-secret-of-ours" not in out
    env.pop("PROFINFER_OP_DESIGN"), env.pop("PROFINFER_TOKEN")
    out = subprocess.run(PROFINFER + ["doctor", "--no-workloads"], env=env, capture_output=True,
                         text=True, timeout=120).stdout
    assert "no PROFINFER_* setting" in out, out
