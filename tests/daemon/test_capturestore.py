"""The flight recorder's store of kept captures after its process was killed mid-write: the
next start lists the whole captures only, and leaves nothing else of a capture on disk (a
trace whose record was never written, a temporary file cut short)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from profinfer.daemon.flight.capturestore import CaptureStore

# A process that keeps one whole capture, then is killed (SIGKILL, by itself) at the moment
# named in argv[2] while it keeps a second: "between" (its trace renamed into place, its
# record not yet written), "renaming" (the trace written whole under its temporary name, not
# yet renamed).
CHILD = """
import os, signal, sys
from profinfer.daemon.flight import capturestore
store = capturestore.CaptureStore(sys.argv[1], keep=5, max_bytes=1 << 20)
store.add({"pid": 1, "fired": {"trigger": "first"}}, b"first trace")
moment = sys.argv[2]
write, replace = store._write, os.replace
def killed_writing(path, data):
    if moment == "between" and path.endswith(".json"):
        os.kill(os.getpid(), signal.SIGKILL)
    write(path, data)
def killed_renaming(src, dst):
    if moment == "renaming" and dst.endswith(".pftrace"):
        os.kill(os.getpid(), signal.SIGKILL)
    replace(src, dst)
store._write = killed_writing
capturestore.os.replace = killed_renaming
store.add({"pid": 2, "fired": {"trigger": "second"}}, b"second trace")
"""


@pytest.mark.parametrize("moment", ["between", "renaming"])
def test_a_crash_mid_write_leaves_nothing_the_next_start_keeps(tmp_path, moment):
    store_dir = tmp_path / "captures"
    child = subprocess.run([sys.executable, "-c", CHILD, str(store_dir), moment], capture_output=True,
                           text=True, timeout=60)
    assert child.returncode == -signal.SIGKILL, child.stderr
    left = sorted(os.listdir(store_dir))
    # what the crash left: the first capture whole, and the second's trace or its temporary file
    assert len(left) == 3 and any(".pftrace." in n and n.endswith(".tmp") if moment == "renaming" else
                                  n.endswith(".pftrace") and n[:-8] + ".json" not in left for n in left), left
    store = CaptureStore(str(store_dir), keep=5, max_bytes=1 << 20)
    kept = store.list()
    assert [r["fired"]["trigger"] for r in kept] == ["first"], kept
    cid = kept[0]["id"]
    assert sorted(os.listdir(store_dir)) == [f"{cid}.json", f"{cid}.pftrace"]
    assert store.trace(cid) == b"first trace"
    assert json.loads((store_dir / f"{cid}.json").read_text())["id"] == cid


def test_a_record_without_its_trace_or_unreadable_is_removed_and_other_files_stay(tmp_path):
    store_dir = tmp_path / "captures"
    store = CaptureStore(str(store_dir), keep=5, max_bytes=1 << 20)
    whole = store.add({"pid": 1}, b"kept")["id"]
    lone = store.add({"pid": 2}, b"its trace lost")["id"]
    broken = store.add({"pid": 3}, b"its record cut")["id"]
    os.unlink(store_dir / f"{lone}.pftrace")
    (store_dir / f"{broken}.json").write_text('{"id": ')
    (store_dir / "notes.txt").write_text("an operator's file")
    again = CaptureStore(str(store_dir), keep=5, max_bytes=1 << 20)
    assert [r["id"] for r in again.list()] == [whole]
    assert sorted(os.listdir(store_dir)) == sorted([f"{whole}.json", f"{whole}.pftrace", "notes.txt"])


def test_a_start_removes_the_capture_directories_a_killed_daemon_left(tmp_path):
    """A real daemon's start, its TMPDIR holding capture directories: the one a dead daemon
    (pid, start) left goes; a live daemon's, a tenant's (another owner) and a link stay."""
    from daemon_helpers import Daemon
    from profinfer.core.target import procfs
    root = tmp_path / "tmp"
    root.mkdir()
    dead = subprocess.Popen(["true"])
    dead.wait()
    left = root / f"profinfer-capture-{dead.pid}-{procfs.process_stat(os.getpid())[0]}-abc123"
    (left / "t.pftrace").parent.mkdir()
    (left / "t.pftrace").write_bytes(b"half a trace")
    live = root / f"profinfer-capture-{os.getpid()}-{procfs.process_stat(os.getpid())[0]}-def456"
    live.mkdir()
    tenants = root / f"profinfer-capture-{dead.pid}-1-0a0b0c"
    tenants.mkdir()
    os.chown(tenants, 65534, 65534)
    link = root / f"profinfer-capture-{dead.pid}-2-0d0e0f"
    link.symlink_to(live)
    d = Daemon(tmp_path, env={**os.environ, "TMPDIR": str(root)})
    try:
        text = d.text()
    finally:
        d.stop()
    assert sorted(p.name for p in root.iterdir()) == sorted([live.name, tenants.name, link.name])
    assert f"removed {left}: a capture's temporary directory its daemon (PID {dead.pid}) left" in text, text


def test_the_newest_are_kept_under_the_count_and_the_byte_cap(tmp_path):
    """keep=2 and a 100-byte cap: a third capture drops the oldest, one that takes the total
    over the cap drops the oldest until it fits, one over the cap alone is refused; the files
    on disk are the records listed, each with its trace, and a new store lists the same."""
    from profinfer.core.base.errors import ProfinferError
    store = CaptureStore(str(tmp_path), keep=2, max_bytes=100)
    ids = [store.add({"pid": i}, b"x" * 30)["id"] for i in range(3)]
    assert [r["id"] for r in store.list()] == ids[1:]
    big = store.add({"pid": 3}, b"y" * 80)["id"]            # 30 + 80 > 100: the 30 goes
    assert [r["id"] for r in store.list()] == [big]
    with pytest.raises(ProfinferError, match="over the captures' cap"):
        store.add({"pid": 4}, b"z" * 101)
    assert sorted(os.listdir(tmp_path)) == [f"{big}.json", f"{big}.pftrace"]
    assert store.trace(big) == b"y" * 80 and store.trace(ids[0]) is None
    assert [r["id"] for r in CaptureStore(str(tmp_path), keep=2, max_bytes=100).list()] == [big]


def test_one_tenants_incidents_evict_its_own_captures_not_anothers(tmp_path):
    """keep=3: tenant B's one capture, then tenant A's flood of five: A's oldest go, B's
    stays (the oldest of the tenant with the most is evicted); with the tenants even, the
    oldest of all goes; the files on disk are the records listed."""
    store = CaptureStore(str(tmp_path), keep=3, max_bytes=1 << 20)
    b = store.add({"pid": 1, "tenant": "pod b"}, b"b")["id"]
    a = [store.add({"pid": 2, "tenant": "pod a"}, b"a%d" % i)["id"] for i in range(5)]
    assert [r["id"] for r in store.list()] == [b, a[3], a[4]]
    c = store.add({"pid": 3, "tenant": "pod c"}, b"c")["id"]      # a has 2, b and c 1: a's oldest
    assert [r["id"] for r in store.list()] == [b, a[4], c]
    d = store.add({"pid": 4, "tenant": "pod d"}, b"d")["id"]      # all even: the oldest of all
    assert [r["id"] for r in store.list()] == [a[4], c, d]
    assert sorted(os.listdir(tmp_path)) == sorted(f"{i}.{ext}" for i in (a[4], c, d) for ext in ("json", "pftrace"))


def test_past_the_byte_cap_the_tenant_with_the_most_bytes_loses_its_oldest(tmp_path):
    """A 100-byte cap, keep=10: tenant A keeps one 60-byte trace, tenant B three of 10. B's
    fourth (10 more: 100 is the cap) fits; a fifth takes the total over: A's 60 bytes go, not
    B's oldest (B has more captures, A more bytes); by count B would have lost one and still
    been over."""
    store = CaptureStore(str(tmp_path), keep=10, max_bytes=100)
    a = store.add({"pid": 1, "tenant": "pod a"}, b"a" * 60)["id"]
    b = [store.add({"pid": 2, "tenant": "pod b"}, b"b" * 10)["id"] for _ in range(4)]
    assert [r["id"] for r in store.list()] == [a, *b]
    b.append(store.add({"pid": 2, "tenant": "pod b"}, b"b" * 10)["id"])
    assert [r["id"] for r in store.list()] == b


def test_a_tenant_holds_one_of_the_triggered_capture_places():
    """Two places: tenant A's trigger holds one; A's next trigger is refused (429, saying
    why), B's takes the other; an operator's capture (no tenant) is refused only for the
    places being full."""
    from profinfer.daemon.flight.captures import BadRequest, Captures
    captures = Captures(agent=None, note=lambda msg: None)
    with captures._place(101, 0.0, "pod a"):
        with pytest.raises(BadRequest) as refused:
            with captures._place(102, 0.0, "pod a"):
                pass
        assert refused.value.status == 429 and "pod a" in str(refused.value)
        with captures._place(201, 0.0, "pod b"):
            with pytest.raises(BadRequest, match="captures are running"):
                with captures._place(301, 0.0):
                    pass
        with captures._place(301, 0.0):
            pass
    assert captures.running == {} and captures.tenants == {}


def test_the_capture_just_kept_never_goes(tmp_path):
    """A 100-byte cap: tenant A's 90-byte capture is bigger than all tenant B keeps (two of
    30): B's go, not A's new one (which add() said was kept)."""
    store = CaptureStore(str(tmp_path), keep=10, max_bytes=100)
    [store.add({"pid": 2, "tenant": "pod b"}, b"b" * 30) for _ in range(2)]
    a = store.add({"pid": 1, "tenant": "pod a"}, b"a" * 90)["id"]
    assert [r["id"] for r in store.list()] == [a] and store.trace(a) == b"a" * 90
