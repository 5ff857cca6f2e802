"""The node's map of recorded processes (profinfer.core.ebpf.followed), in a bpffs folder of this
test's own: made root's alone, shared by whoever opens it next, a pin of another shape
replaced (the map of held processes kept aside), a folder others may enter not trusted."""
from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest

from profinfer.core.ebpf import held, libbpf, pinned, followed
from conftest import REPO



@pytest.fixture
def pin_dir():
    _, why = pinned.mount_bpffs()          # as profinfer itself does where the host has none
    assert why is None, why
    path = f"{pinned.BPFFS}/profinfer-test-{os.getpid()}"
    yield path
    for name in os.listdir(path) if os.path.isdir(path) else []:
        os.unlink(f"{path}/{name}")
    if os.path.isdir(path):
        os.rmdir(path)


def _warnings():
    said: list[str] = []
    return said, said.append


def test_made_root_only_and_shared(pin_dir):
    said, warn = _warnings()
    first = followed.open_shared(warn, pin_dir)
    second = followed.open_shared(warn, pin_dir)
    assert first is not None and second is not None and not said
    folder, pin = os.lstat(pin_dir), os.lstat(f"{pin_dir}/{followed.MAP_NAME}")
    assert stat.S_IMODE(folder.st_mode) == 0o700 and folder.st_uid == 0
    assert stat.S_IMODE(pin.st_mode) == 0o600 and pin.st_uid == 0
    followed.add(first, os.getpid())        # one map: what one descriptor adds, the other reads
    assert libbpf.map_lookup(second, os.getpid().to_bytes(4, "little"), 8) is not None
    followed.remove(second, os.getpid())
    assert libbpf.map_lookup(first, os.getpid().to_bytes(4, "little"), 8) is None
    os.close(first)
    os.close(second)


def test_a_pin_of_another_shape_is_replaced(pin_dir):
    os.mkdir(pin_dir, 0o700)
    old = libbpf.create_map(libbpf.BPF_MAP_TYPE_HASH, "recorded", 4, 4, 64)
    libbpf.pin(old, f"{pin_dir}/{followed.MAP_NAME}")
    said, warn = _warnings()
    fd = followed.open_shared(warn, pin_dir)
    assert fd is not None and len(said) == 1 and "another version" in said[0], said
    assert libbpf.map_shape(fd) != libbpf.map_shape(old)
    assert libbpf.map_shape(fd)[1:3] == (4, 8)
    os.close(fd)
    os.close(old)


def _pinned_held_map(pin_dir: str, kind: int, entry: int) -> int:
    old = libbpf.create_map(kind, "held", 4, entry, 64)
    libbpf.pin(old, f"{pin_dir}/{held.MAP_NAME}")
    return old


def test_another_versions_map_of_held_processes_is_kept_aside(pin_dir):
    """held's map of another shape whose entries begin with pi_held is replaced and kept
    pinned aside, readable; one of a layout that cannot be read (an LRU map of shorter
    entries) is replaced and unpinned, as any other pin of another shape."""
    os.mkdir(pin_dir, 0o700)
    entry = held._shape()[2]
    old = _pinned_held_map(pin_dir, libbpf.BPF_MAP_TYPE_HASH, entry + 16)
    said, warn = _warnings()
    fd = held.open_shared(warn, pin_dir)
    kept = f"{pin_dir}/{held.MAP_NAME}{pinned.REPLACED}{libbpf.map_id(old)}"
    assert fd is not None and said == [f"{pin_dir}/{held.MAP_NAME} was made by another version of "
                                       f"profinfer: replaced, kept as {kept}"], said
    assert libbpf.map_shape(fd)[2] == entry
    assert pinned.replaced_pins(held.MAP_NAME, pin_dir) == [kept]
    assert [(pin, size) for pin, _, size in held.replaced_maps(pin_dir)] == [(kept, entry + 16)]
    os.unlink(f"{pin_dir}/{held.MAP_NAME}")
    os.close(fd)
    os.unlink(kept)
    os.close(old)

    old = _pinned_held_map(pin_dir, libbpf.BPF_MAP_TYPE_LRU_HASH, 16)
    said, warn = _warnings()
    fd = held.open_shared(warn, pin_dir)
    assert fd is not None and len(said) == 1 and "cannot read" in said[0] and "kept" not in said[0], said
    assert pinned.replaced_pins(held.MAP_NAME, pin_dir) == []
    os.close(fd)
    os.close(old)


def test_a_kept_map_is_unpinned_once_empty_and_old_enough(pin_dir):
    os.mkdir(pin_dir, 0o700)
    entry = held._shape()[2]
    old = _pinned_held_map(pin_dir, libbpf.BPF_MAP_TYPE_HASH, entry + 16)
    fd = held.open_shared(lambda _: None, pin_dir)
    kept = pinned.replaced_pins(held.MAP_NAME, pin_dir)
    assert kept == [f"{pin_dir}/{held.MAP_NAME}{pinned.REPLACED}{libbpf.map_id(old)}"], kept
    libbpf.map_update(old, (1).to_bytes(4, "little"), b"\0" * (entry + 16))
    assert held.unpin_spent(pin_dir, kept_s=0) == [], "a map with an entry was unpinned"
    libbpf.map_delete(old, (1).to_bytes(4, "little"))
    assert held.unpin_spent(pin_dir, kept_s=3600) == [], "a map kept for less than kept_s was unpinned"
    assert held.unpin_spent(pin_dir, kept_s=0) == kept and not pinned.replaced_pins(held.MAP_NAME, pin_dir)
    os.close(fd)
    os.close(old)


def test_a_folder_locked_too_long_is_not_waited_for(pin_dir, monkeypatch):
    """Another profinfer stopped while it holds the pin folder's lock: the map is opened
    after LOCK_WAIT_S all the same, and that is said."""
    os.mkdir(pin_dir, 0o700)
    monkeypatch.setattr(pinned, "LOCK_WAIT_S", 0.3)
    holder = subprocess.Popen([sys.executable, "-c", f"import fcntl, os, sys, time\n"
                               f"fd = os.open({pin_dir!r}, os.O_RDONLY)\nfcntl.flock(fd, fcntl.LOCK_EX)\n"
                               "print('locked', flush=True)\ntime.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        said, warn = _warnings()
        fd = followed.open_shared(warn, pin_dir)
        assert fd is not None and any("stayed locked" in line for line in said), said
        os.close(fd)
    finally:
        holder.kill()
        holder.wait()


def test_a_folder_others_may_enter_is_not_trusted(pin_dir):
    os.mkdir(pin_dir, 0o700)
    os.chmod(pin_dir, 0o755)
    said, warn = _warnings()
    assert followed.open_shared(warn, pin_dir) is None
    assert len(said) == 1 and "not root's alone" in said[0], said


def _bpffs_mounts() -> list[str]:
    with open("/proc/self/mountinfo") as f:
        return [line for line in f if line.split()[4] == pinned.BPFFS]


def _without_bpffs(unshare: list[str]) -> list[str]:
    """What a process run by `unshare` in a mount namespace of its own with no bpffs at
    /sys/fs/bpf prints: the bpffs mounts there before (a count), whether the node's map was
    opened and pinned, the bpffs mounts with mode 0700 after, and what it warned."""
    script = ("from profinfer.core.ebpf import pinned, followed; said = []; "
              "fd = followed.open_shared(said.append); "
              "print(fd is not None, os.path.exists(pinned.PIN_DIR + '/recorded')); print(said)")
    p = subprocess.run(
        [*unshare, "sh", "-c",
         "while umount /sys/fs/bpf 2>/dev/null; do :; done; grep -c ' /sys/fs/bpf bpf ' /proc/self/mounts; "
         f"{sys.executable} -c \"import os; {script}\"; grep ' /sys/fs/bpf bpf ' /proc/self/mounts | grep -c mode=700"],
        capture_output=True, text=True, timeout=60, cwd=REPO)
    return p.stdout.splitlines() + [p.stderr]


def test_bpffs_is_mounted_where_the_host_has_none():
    """A host whose init mounts no bpffs (this project's VM, fresh), made for real: the
    host's bpffs unmounted (what is pinned there is the node's maps, made again when next
    opened), opening the node's map mounts bpffs at /sys/fs/bpf, mode 0700 as systemd mounts
    it, says so, and pins the map there."""
    while subprocess.run(["umount", pinned.BPFFS], capture_output=True).returncode == 0:
        pass
    assert not _bpffs_mounts()
    said: list[str] = []
    fd = followed.open_shared(said.append)
    try:
        assert fd is not None and os.path.exists(f"{pinned.PIN_DIR}/{followed.MAP_NAME}"), said
        mounts = _bpffs_mounts()
        assert len(mounts) == 1 and "mode=700" in mounts[0], mounts
        assert any("mounted bpffs at /sys/fs/bpf" in line for line in said), said
    finally:
        if fd is not None:
            os.close(fd)


def test_bpffs_is_not_mounted_in_a_containers_own_pid_namespace():
    """A container with its own PID and mount namespaces (its PID 1 in its mount namespace,
    as `docker run --privileged`): a bpffs mounted there would be its alone, so none is."""
    out = _without_bpffs(["unshare", "-m", "-p", "-f", "--mount-proc", "--propagation", "private"])
    assert out[:2] == ["0", "False False"] and out[3] == "0", out


def test_bpffs_is_not_mounted_outside_pid_1s_mount_namespace():
    """In a mount namespace other than PID 1's (a container's, whose /sys/fs/bpf is a
    hostPath): a bpffs mounted there would be its alone, so none is, and the map is not
    shared."""
    out = _without_bpffs(["unshare", "-m", "--propagation", "private"])
    assert out[:2] == ["0", "False False"] and out[3] == "0", out


IN_A_NEW_MOUNT_NAMESPACE = ("umount {bpffs} 2>/dev/null; exec {python} -c 'from profinfer.core.ebpf import pinned; "
                            "mounted, why = pinned.mount_bpffs(); print(mounted); print(why)'")


def test_bpffs_is_mounted_only_in_the_hosts_mount_namespace():
    """The host's mount namespace is told from a container's own, by PID 1's namespace or,
    where that cannot be read (this VM's init is not readable to root), by a kernel thread's.
    Here: the host's (bpffs mounted, where none was); in a mount
    namespace of its own (as a pod's), with no bpffs there, none is mounted, and it says why."""
    assert pinned._not_the_hosts_mounts() is None
    _, why = pinned.mount_bpffs()
    assert why is None and pinned.bpffs_mounted(), why
    script = IN_A_NEW_MOUNT_NAMESPACE.format(bpffs=pinned.BPFFS, python=sys.executable)
    r = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["False", "no bpffs at /sys/fs/bpf, and this process is not in "
                                     f"{'PID 1' if pinned._mount_ns(1) is not None else 'the host'}'s mount namespace"], r.stdout
    assert pinned.bpffs_mounted()       # the host's is untouched
