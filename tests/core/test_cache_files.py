"""Files read from the cache ($PROFINFER_CACHE, ~/.cache/profinfer) by a root agent, under
`sudo -E` a user's: what a user could have put there (a link in place of the cache, a planted
file) neither steers what the agent changes nor what it believes.

- A cache root that is a user's link to a shared sticky directory (/tmp-like): the
  directory's mode is left as it was (it was made 1755 by following the link), and the cache
  is refused in one warning line.
- A struct layout planted in the cache under the very name the agent would look for: not
  used, in a cache a user owns, in a file a user owns, or behind a link; the layout comes
  from the DWARF. Truth: offsetof() in a program compiled with the library's own struct."""
from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from profinfer.core.target import dwarf
from test_dwarf_cache import MEMBERS, _build

NOBODY = 65534
REPO = Path(__file__).resolve().parents[2]


def _writable_dir(cache: Path, sub: str) -> tuple[str, str]:
    """buildcache.writable_dir(sub) in a fresh process: (what it returned, its stderr)."""
    done = subprocess.run([sys.executable, "-c", "import sys; from profinfer.core.target import buildcache; "
                           f"print(buildcache.writable_dir({sub!r}))"],
                          cwd=REPO, env={**os.environ, "PROFINFER_CACHE": str(cache)},
                          capture_output=True, text=True, timeout=60, check=True)
    return done.stdout.strip(), done.stderr


def test_a_link_to_a_shared_directory_is_not_followed_to_change_it(tmp_path):
    shared = tmp_path / "shared"          # as /tmp: root's, anyone may write, sticky
    shared.mkdir()
    shared.chmod(0o1777)
    link = tmp_path / "home-cache"        # the user's ~/.cache/profinfer
    os.symlink(shared, link)
    os.lchown(link, NOBODY, NOBODY)
    got, err = _writable_dir(link, "layouts")
    assert stat.S_IMODE(shared.stat().st_mode) == 0o1777
    assert got == "None"
    said = [l for l in err.splitlines() if "not using what is in" in l]
    assert len(said) == 1 and f"owned by uid {NOBODY}" in said[0], err
    # the shared directory named itself: still never closed (it is not a cache of ours)
    got, err = _writable_dir(shared, "layouts")
    assert stat.S_IMODE(shared.stat().st_mode) == 0o1777, err


@pytest.fixture
def layouts(tmp_path, monkeypatch):
    """(library, its true offsets, the forged offsets, the layout cache's file name)."""
    forged_lib, forged_truth = _build(tmp_path, "forged")
    real_lib, real_truth = _build(tmp_path, "real")
    assert forged_truth != real_truth
    monkeypatch.setenv("PROFINFER_CACHE", str(tmp_path / "scratch"))
    monkeypatch.setattr(dwarf, "_in_memory", {})
    forged = dwarf.struct_layout(forged_lib, "ggml_tensor")       # a layout as the cache keeps it
    name = f"{dwarf.dwarf_digest(real_lib)}.ggml_tensor.v2.json"
    return real_lib, real_truth, forged, name


def _plant(path: Path, layout: dict, owner: int | None = None) -> None:
    import json
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(layout))
    if owner is not None:
        os.chown(path, owner, owner)


def _layout(lib: str, cache: Path, monkeypatch) -> dict[str, int]:
    monkeypatch.setenv("PROFINFER_CACHE", str(cache))
    monkeypatch.setattr(dwarf, "_in_memory", {})
    found = dwarf.struct_layout(lib, "ggml_tensor")
    return {m: found["members"][m] for m in MEMBERS}


def test_a_planted_layout_in_a_users_cache_is_not_used(layouts, tmp_path, monkeypatch):
    lib, truth, forged, name = layouts
    cache = tmp_path / "user-cache"
    _plant(cache / "layouts" / name, forged, NOBODY)
    for p in (cache / "layouts", cache):
        os.chown(p, NOBODY, NOBODY)
    assert _layout(lib, cache, monkeypatch) == truth


def test_a_planted_layout_file_or_link_is_not_used(layouts, tmp_path, monkeypatch):
    lib, truth, forged, name = layouts
    cache = tmp_path / "cache"                      # root's own
    _plant(cache / "layouts" / name, forged, NOBODY)          # a file a user owns
    assert _layout(lib, cache, monkeypatch) == truth
    os.unlink(cache / "layouts" / name)
    elsewhere = tmp_path / "elsewhere.json"                    # root's file, behind a link
    _plant(elsewhere, forged)
    os.symlink(elsewhere, cache / "layouts" / name)
    assert _layout(lib, cache, monkeypatch) == truth
    os.unlink(cache / "layouts" / name)
    _plant(cache / "layouts" / name, forged)                  # root's own file: used as cached
    assert _layout(lib, cache, monkeypatch) == {m: forged["members"][m] for m in MEMBERS}


def test_planted_measurements_are_not_believed(tmp_path, monkeypatch):
    """roofs.json (calibrate) and probecost.json, planted with a checked entry for this very
    machine in a user's cache, or behind a link: not used (measured again when needed); the
    same file written by root is used, as calibrate wrote it."""
    import json
    from profinfer.core.calibration import machine_roofs, probecost
    prefix = f"{machine_roofs.cpu_model()}|{os.cpu_count()} cpus|"
    planted = {"roofs.json": {prefix + "1 threads": {"check": "planted", "fma_gflops": 1e9, "read_gbps": 1e9}},
               "probecost.json": {probecost._key(): {"check": "planted", "emulated_ns": 0}}}
    read = {"roofs.json": lambda: machine_roofs.cached(1), "probecost.json": probecost.cached}

    def plant(cache: Path, owner: int | None, link: bool = False) -> None:
        cache.mkdir()
        for name, content in planted.items():
            target = tmp_path / f"{cache.name}-{name}" if link else cache / name
            target.write_text(json.dumps(content))
            if link:
                os.symlink(target, cache / name)
            if owner is not None:
                os.chown(target, owner, owner)
                os.chown(cache, owner, owner)
        monkeypatch.setenv("PROFINFER_CACHE", str(cache))

    plant(tmp_path / "user", NOBODY)
    assert [read[n]() for n in planted] == [None, None]
    plant(tmp_path / "linked", None, link=True)
    assert [read[n]() for n in planted] == [None, None]
    plant(tmp_path / "root", None)                       # root's own: believed
    assert [read[n]()["check"] for n in planted] == ["planted", "planted"]
