"""BPF objects are loaded as root from the cache ($PROFINFER_CACHE, ~/.cache/profinfer) and
from $PROFINFER_BPF_PREBUILT. Under `sudo -E` these are a user's: an object someone other than
root could have put there is refused, said once per directory, and built again privately;
the daemon watches as before. A cache only root can write is used as it is, nothing rebuilt."""
from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import pytest

from daemon_helpers import Daemon, cudart_tenant, kill_started
from profinfer.levels.cuda import workload

NOBODY = 65534
# every object name the warm cache holds (the current sources' among them)
KNOWN = sorted(p.name for p in (Path.home() / ".cache" / "profinfer" / "bpf").glob("*.o"))


@pytest.fixture(autouse=True)
def _no_workload_left():
    yield
    kill_started()


def _plant(directory: Path, owner: int | None = None) -> bytes:
    """Under every known object name, a file that is no BPF object (loading it would fail)."""
    junk = b"\x7fELF planted, not an object\n"
    directory.mkdir(parents=True, exist_ok=True)
    for name in KNOWN:
        (directory / name).write_bytes(junk)
        if owner is not None:
            os.chown(directory / name, owner, owner)
    return junk


def _watched_at_cuda(d: Daemon, cudart: Path) -> str:
    """A tenant watched at the cuda level; the daemon stopped: its log."""
    proc = cudart_tenant(cudart)
    deadline = time.monotonic() + 60         # a bound: its objects may be built first
    info = d.watched(proc.pid, timeout=60)
    while "cuda" not in info["levels"] and time.monotonic() < deadline:
        time.sleep(0.1)
        info = d.watched(proc.pid)
    assert "cuda" in info["levels"], d.text()
    proc.stdin.close()
    proc.wait(timeout=30)
    text = d.text()
    d.stop()
    return text


def _objects(directory: Path) -> dict[str, tuple[int, int]]:
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in directory.glob("*.o")}


def test_planted_objects_refused_and_built_privately(tmp_path):
    assert len(KNOWN) >= 7, "the cache is not warm: run setup.sh"
    cudart = workload.ensure_cudart12()
    cache = tmp_path / "user-cache"          # a user's home cache, under sudo -E
    junk = _plant(cache / "bpf", NOBODY)
    for p in (cache / "bpf", cache):
        os.chown(p, NOBODY, NOBODY)
    prebuilt = tmp_path / "prebuilt"         # root's, but anyone may write into it
    _plant(prebuilt)
    prebuilt.chmod(0o777)
    d = Daemon(tmp_path, env={**os.environ, "PROFINFER_CACHE": str(cache), "PROFINFER_BPF_PREBUILT": str(prebuilt)})
    text = _watched_at_cuda(d, cudart)
    lines = text.splitlines()
    for where, why in ((prebuilt, "writable by others"), (cache / "bpf", f"owned by uid {NOBODY}")):
        said = [l for l in lines if f"not using what is in {where}:" in l]
        assert len(said) == 1 and why in said[0], text
    # nothing of theirs used, nor anything of ours left in their directories
    for directory in (cache / "bpf", prebuilt):
        assert sorted(p.name for p in directory.iterdir()) == KNOWN
        assert all(p.read_bytes() == junk for p in directory.iterdir())
    assert "Traceback" not in text


def test_a_cache_only_root_can_write_is_used_without_rebuilding(tmp_path):
    cudart = workload.ensure_cudart12()
    cache = tmp_path / "cache"
    cache.mkdir()
    cache.chmod(0o777)            # as a Kubernetes emptyDir comes: the daemon's own, closed first
    env = {**os.environ, "PROFINFER_CACHE": str(cache)}
    env.pop("PROFINFER_BPF_PREBUILT", None)
    first = _watched_at_cuda(Daemon(tmp_path, env=env), cudart)
    assert stat.S_IMODE(cache.stat().st_mode) == 0o755
    built = _objects(cache / "bpf")
    assert built, first
    (tmp_path / "again").mkdir()
    again = _watched_at_cuda(Daemon(tmp_path / "again", env=env), cudart)
    assert _objects(cache / "bpf") == built         # the same files: loaded, not built again
    assert "not using" not in first + again
