"""Hostile tenants as the daemon meets them: processes in mount namespaces and roots of their
own (the host's unmounted: no way back), each mapping a file named like an engine's library.

- One maps a stripped copy of libllama: the daemon looks for its debug file by build-id.
  Its own debug path is a FIFO, and the host has a debug file with that build-id. Once the
  daemon has read the library, the tenant swaps its directory for an absolute symlink to a
  host directory holding another libllama.so. Its loader's path is a FIFO too.
- One maps a sparse 16 GiB "libllama.so" whose symbol table's section header claims 12 GiB.
- One maps a CUDA runtime and another library, deleted and replaced by a FIFO at its path.

The truths come from outside profinfer. fanotify on the host's files (inotify's events, with
the process that made each: other daemons run on this node) shows the daemon never opens or
reads them, whatever the tenant's links say; a probe needs the file open, so none is on them
either. The daemon runs in a memory cgroup limited as the manifest limits it, and stays
alive. /healthz, polled every 0.5 s throughout, answers 200 every time (no FIFO is waited on,
no file parsed on its loop); a llama.cpp generation beside the huge file is counted exactly.
The huge file is told once."""
from __future__ import annotations

import ctypes
import json
import os
import shutil
import struct
import subprocess
import threading
import time
from pathlib import Path

import pytest
import yaml
from elftools.elf.elffile import ELFFile

from conftest import llama_perf
from daemon_helpers import MANIFEST, Daemon, Workload, _get, kill_started, series

HERE = Path(__file__).resolve().parent
FAN_ACCESS, FAN_OPEN = 0x1, 0x20
FAN_CLASS_NOTIF, FAN_CLOEXEC, FAN_NONBLOCK, FAN_MARK_ADD, AT_FDCWD = 0, 1, 2, 1, -100
HUGE_FILE = 16 << 30
HUGE_TABLE = 12 << 30      # under the VM's memory: an allocation of it is not refused at once


def _manifest_memory_limit() -> int:
    ds = next(d for d in yaml.safe_load_all(MANIFEST.read_text()) if d and d["kind"] == "DaemonSet")
    (c,) = ds["spec"]["template"]["spec"]["containers"]
    limit = c["resources"]["limits"]["memory"]
    assert limit.endswith("Mi")
    return int(limit[:-2]) << 20


class Accesses:
    """Opens and reads of files, as the kernel reports them, with the process that made
    each (fanotify: this node has other daemons and tests, whose accesses are not ours)."""

    def __init__(self, paths: list[Path]):
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.libc.fanotify_mark.argtypes = [ctypes.c_int, ctypes.c_uint, ctypes.c_uint64,
                                            ctypes.c_int, ctypes.c_char_p]
        self.fd = self.libc.fanotify_init(FAN_CLASS_NOTIF | FAN_CLOEXEC | FAN_NONBLOCK, os.O_RDONLY)
        assert self.fd >= 0, os.strerror(ctypes.get_errno())
        for p in paths:
            assert self.libc.fanotify_mark(self.fd, FAN_MARK_ADD, FAN_OPEN | FAN_ACCESS, AT_FDCWD,
                                           os.fsencode(p)) == 0, os.strerror(ctypes.get_errno())

    def events(self) -> list[tuple[str, int, int]]:
        """(file, mask, pid) of each access since the last call."""
        out = []
        while True:
            try:
                buf = os.read(self.fd, 65536)
            except BlockingIOError:
                return out
            at = 0
            while at < len(buf):
                length, _, _, _, mask, fd, pid = struct.unpack_from("IBBHQii", buf, at)
                if fd >= 0:
                    out.append((os.readlink(f"/proc/self/fd/{fd}"), mask, pid))
                    os.close(fd)
                at += length

    def close(self) -> None:
        os.close(self.fd)


def _of(pid: int, ancestor: int) -> bool:
    """Whether `pid` is `ancestor` or one of its descendants (the daemon's parse worker)."""
    while pid > 1:
        if pid == ancestor:
            return True
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[2])
        except (OSError, IndexError, ValueError):
            return False
    return False


def _jail(root: Path, binary: Path) -> None:
    """The tenant's binary and what it loads (ldd), at their own paths in root."""
    (root / "bin").mkdir(parents=True)
    shutil.copy2(binary, root / "bin" / "tenant")
    out = subprocess.run(["ldd", str(binary)], capture_output=True, text=True, check=True).stdout
    for line in out.splitlines():
        parts = line.split()
        path = parts[2] if "=>" in parts and len(parts) > 2 else parts[0]
        if path.startswith("/"):
            dest = root / path.lstrip("/")
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(os.path.realpath(path), dest)


class Tenant:
    """The tenant's program in mount and PID namespaces of its own, its root pivoted to
    `root` (the tenant unmounts the host's). `pid`: the program's PID as the host sees it."""

    def __init__(self, root: Path, *args: str):
        script = (f"mount --make-rprivate / && mount --bind {root} {root} && cd {root} && "
                  "mkdir -p .host && pivot_root . .host && "
                  "exec /bin/tenant " + " ".join(args))
        # --kill-child: the program (PID 1 of its namespace) dies with unshare
        self.proc = subprocess.Popen(["unshare", "--mount", "--pid", "--fork", "--kill-child", "sh", "-c", script])
        deadline = time.monotonic() + 15
        while not (root / "ready").exists():
            assert self.proc.poll() is None and time.monotonic() < deadline, "the tenant did not start"
            time.sleep(0.05)
        (self.pid,) = map(int, Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split())

    def state(self) -> str:
        """Its state letter, as /proc/PID/stat says it (T: stopped)."""
        return self.state_of(self.pid)

    @staticmethod
    def state_of(pid: int) -> str:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


def _build_id(path: Path) -> str:
    with open(path, "rb") as f:
        for sec in ELFFile(f).iter_sections():
            if sec.header.sh_type == "SHT_NOTE":
                for note in sec.iter_notes():
                    if note["n_type"] == "NT_GNU_BUILD_ID":
                        return note["n_desc"]
    raise AssertionError(f"{path} has no build-id")


def _copy_with_section_at(src: Path, dest: Path, section: str) -> int:
    """A copy of src at dest; where in it the header of `section` has its offset and size
    (Elf64_Shdr: sh_offset, sh_size, 24 bytes in)."""
    shutil.copy2(src, dest)
    with open(dest, "rb") as f:
        elf = ELFFile(f)
        shoff, shentsize = elf.header.e_shoff, elf.header.e_shentsize
        index = next(i for i, s in enumerate(elf.iter_sections()) if s.name == section)
    return shoff + index * shentsize + 24


def _huge_symbol_table(src: Path, dest: Path) -> None:
    """A copy of src, sparse to HUGE_FILE, its .symtab's header claiming HUGE_TABLE bytes
    in the hole."""
    at = _copy_with_section_at(src, dest, ".symtab")
    with open(dest, "r+b") as f:
        f.seek(at)
        f.write(struct.pack("<QQ", 1 << 30, HUGE_TABLE))
        f.truncate(HUGE_FILE)


def _cgroup2_root() -> Path | None:
    """Where the unified (v2) hierarchy is mounted here, if it is."""
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        if right.split()[0] == "cgroup2":
            return Path(left.split()[4])
    return None


def _memory_cgroup_v1(name: str) -> Path:
    mine = next((line.split(":", 2)[2] for line in Path("/proc/self/cgroup").read_text().splitlines()
                 if line.split(":")[1] == "memory"), None)
    base = Path("/sys/fs/cgroup/memory") / (mine or "/").lstrip("/")
    if mine is None or not (base / "memory.limit_in_bytes").exists():
        pytest.skip("cgroup v1: no v1 memory controller on this host")
    cg = base / name
    cg.mkdir()
    (cg / "memory.limit_in_bytes").write_text(str(_manifest_memory_limit()))
    return cg


def _memory_cgroup_v2(name: str) -> Path:
    """Under the unified hierarchy's root, which may hold processes and enable controllers
    for its children (a cgroup below ours could not: no internal processes)."""
    root = _cgroup2_root()
    if root is None or "memory" not in (root / "cgroup.controllers").read_text().split():
        pytest.skip("cgroup v2: the memory controller is not in the unified hierarchy here "
                    f"({'no cgroup2 mount' if root is None else 'bound to cgroup v1: a hybrid host'})")
    if "memory" not in (root / "cgroup.subtree_control").read_text().split():
        (root / "cgroup.subtree_control").write_text("+memory")
    cg = root / name
    cg.mkdir()
    (cg / "memory.max").write_text(str(_manifest_memory_limit()))
    return cg


@pytest.fixture(params=["v1", "v2"], ids=["cgroup-v1", "cgroup-v2"])
def memory_cgroup(request):
    """A memory cgroup limited as the manifest limits the daemon, in either hierarchy: each
    test runs in each one the host has (a host without one says so in one line)."""
    make = _memory_cgroup_v1 if request.param == "v1" else _memory_cgroup_v2
    cg = make(f"profinfer-hostile-{os.getpid()}")
    yield cg
    for _ in range(50):
        try:
            cg.rmdir()
            return
        except OSError:
            time.sleep(0.1)


# the daemon's loop not seen this long: /healthz answers 503 (PROFINFER_STALL_S; 30 s by
# default, its least here so that a test waits past it in seconds)
STALL_S = 5


@pytest.fixture
def tenant_bin(tmp_path) -> Path:
    out = tmp_path / "hostile_tenant"
    subprocess.run(["gcc", "-O1", "-o", str(out), str(HERE / "hostile_tenant.c")], check=True)
    return out


class Watched:
    """The daemon, in the memory cgroup, with /healthz polled every 0.5 s until stop()."""

    def __init__(self, tmp_path: Path, cgroup: Path, extra: tuple[str, ...] = (), env: dict | None = None):
        self.daemon = Daemon(tmp_path, extra, prefix=("sh", "-c", f'echo $$ > {cgroup}/cgroup.procs && exec "$@"', "sh"),
                             env={**os.environ, "PROFINFER_STALL_S": str(STALL_S), **(env or {})})
        self.statuses: list[int] = []
        self._stop = threading.Event()
        self._poller = threading.Thread(target=self._poll, daemon=True)
        self._poller.start()

    def _poll(self) -> None:
        while not self._stop.wait(0.5):
            try:
                self.statuses.append(_get(self.daemon.url + "/healthz", timeout=5)[0])
            except OSError:
                self.statuses.append(0)        # refused or timed out: the daemon gone or stuck

    def stop_polling(self) -> None:
        self._stop.set()
        self._poller.join()

    def assert_alive_and_healthy(self) -> None:
        assert self.daemon.proc.poll() is None, "the daemon died (its memory limit?)\n" + self.daemon.text()
        assert self.statuses and set(self.statuses) == {200}, \
            f"/healthz answered {self.statuses}\n{self.daemon.text()}"

    def close(self) -> None:
        self._stop.set()
        if self.daemon.proc.poll() is None:
            try:
                self.daemon.stop()
                return
            except subprocess.TimeoutExpired:      # stuck (on a FIFO): not left behind
                self.daemon.proc.kill()
                self.daemon.proc.wait()
        self.daemon.log.close()


def test_links_fifos_and_a_swapped_directory_never_reach_the_host(tmp_path, llama_build, tenant_bin,
                                                                  memory_cgroup):
    """A stripped libllama whose debug path is a FIFO in its root while the host has a debug
    file of its build-id; its loader's path a FIFO; its directory swapped for a link to a host
    directory once the daemon has read it. The daemon opens neither host file, and /healthz
    stays 200."""
    lib = (llama_build / "bin" / "libllama.so").resolve()
    host_dir = tmp_path / "host-lib"
    host_dir.mkdir()
    host_lib = host_dir / "libllama.so"
    shutil.copy2(lib, host_lib)
    bid = _build_id(lib)
    host_debug = Path("/usr/lib/debug/.build-id") / bid[:2] / f"{bid[2:]}.debug"
    made_debug_dir = not host_debug.parent.exists()
    host_debug.parent.mkdir(parents=True, exist_ok=True)
    assert not host_debug.exists()
    shutil.copy2(lib, host_debug)

    root = tmp_path / "tenant"
    _jail(root, tenant_bin)
    (root / "opt" / "lib").mkdir(parents=True)
    subprocess.run(["strip", "--strip-all", "-o", str(root / "opt" / "lib" / "libllama.so"), str(lib)],
                   check=True)
    assert _build_id(root / "opt" / "lib" / "libllama.so") == bid
    debug_in_root = root / host_debug.relative_to("/")
    debug_in_root.parent.mkdir(parents=True)
    os.mkfifo(debug_in_root)

    tenant = accesses = watched = None
    try:
        tenant = Tenant(root, "/opt/lib/libllama.so", "swap", str(host_dir))
        accesses = Accesses([host_lib, host_debug])
        watched = Watched(tmp_path, memory_cgroup)
        deadline = time.monotonic() + 30
        while not (root / "swapped").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert (root / "swapped").exists(), "the daemon never read the tenant's library\n" + watched.daemon.text()
        # its attach once the directory was swapped: to the file it had read and checked
        said = f"watching PID {tenant.pid} "
        while said not in watched.daemon.text() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert said in watched.daemon.text(), watched.daemon.text()
        watched.stop_polling()
        pid = watched.daemon.proc.pid
        events = [e for e in accesses.events() if _of(e[2], pid)]
        assert events == [], f"the daemon opened or read host files: {events}\n{watched.daemon.text()}"
        watched.assert_alive_and_healthy()
    finally:
        if accesses is not None:
            accesses.close()
        if watched is not None:
            watched.close()
        if tenant is not None:
            tenant.kill()
        host_debug.unlink()
        if made_debug_dir:
            host_debug.parent.rmdir()


def _end(watched: "Watched | None", *tenants: "Tenant | None") -> None:
    """A test's end: its workloads killed, the daemon stopped, the tenants killed."""
    kill_started()
    if watched is not None:
        watched.close()
    for t in tenants:
        if t is not None:
            t.kill()


def _counted_beside(d: Daemon, llama_build, model, llama_env, tmp_path: Path, watched_within: float = 30) -> float:
    """A llama.cpp generation beside the tenant: the daemon counts its tokens exactly. How
    long after its start it was watched."""
    w = Workload(llama_build, model, llama_env, tmp_path, n=32)
    t0 = time.monotonic()
    d.watched(w.proc.pid, timeout=watched_within)
    waited = time.monotonic() - t0
    w.go()
    err = w.finish()
    perf = llama_perf(err)      # its log drain is preloaded: a missing line is a defect
    assert {"prompt eval", "eval"} <= perf.keys(), f"llama.cpp's perf lines missing:\n{err[-2000:]}"
    want = {"prefill": perf["prompt eval"][1], "decode": perf["eval"][1]}
    deadline = time.monotonic() + 10
    while (got := series(_get(d.url + "/metrics")[1].decode(), "profinfer_tokens_total", w.proc.pid, "phase")) \
            != want and time.monotonic() < deadline:
        time.sleep(0.2)
    assert got == want, d.text()
    return waited


def test_a_huge_library_neither_exhausts_nor_stalls_the_daemon(tmp_path, llama_build, tiny_model, llama_env,
                                                               tenant_bin, memory_cgroup):
    """A sparse 16 GiB libllama.so whose symbol table claims 12 GiB: the daemon, limited as
    the manifest limits it, stays alive, /healthz stays 200, a llama.cpp generation beside it
    is counted exactly, and the file is told once."""
    root = tmp_path / "tenant"
    _jail(root, tenant_bin)
    (root / "opt" / "lib").mkdir(parents=True)
    _huge_symbol_table((llama_build / "bin" / "libllama.so").resolve(), root / "opt" / "lib" / "libllama.so")
    tenant = watched = None
    try:
        tenant = Tenant(root, "/opt/lib/libllama.so")
        watched = Watched(tmp_path, memory_cgroup)
        _counted_beside(watched.daemon, llama_build, tiny_model, llama_env, tmp_path)
        time.sleep(5)          # a retry of the tenant (backing off from 2 s)
        watched.stop_polling()
        watched.assert_alive_and_healthy()
        told = [l for l in watched.daemon.text().splitlines() if f"PID {tenant.pid}" in l or "over the" in l]
        assert len([l for l in told if "over the 64 MiB read" in l]) == 1, watched.daemon.text()
    finally:
        _end(watched, tenant)


MAPPINGS = 60000       # under vm.max_map_count's 65530


def _maps_bytes(pid: int) -> int:
    """The size of the process's maps text, read as the kernel writes it (a chunk at a time)."""
    n = 0
    with open(f"/proc/{pid}/maps", "rb") as f:
        while chunk := f.read(1 << 20):
            n += len(chunk)
    return n


def test_a_flood_of_mappings_neither_exhausts_nor_stalls_the_daemon(tmp_path, llama_build, tiny_model, llama_env,
                                                                    tenant_bin, memory_cgroup):
    """A tenant named like an engine maps a page 60,000 times under a 3.6 KB path (over
    200 MB of maps text), its size changing every 0.2 s so that each scan looks again. The
    daemon, limited as the manifest limits it, stays alive, /healthz stays 200, a llama.cpp
    generation beside it is counted exactly, and nothing is left stopped."""
    root = tmp_path / "tenant"
    _jail(root, tenant_bin)
    (root / "opt" / "lib").mkdir(parents=True)
    shutil.copy2(tenant_bin, root / "opt" / "lib" / "libllama.so")
    tenant = watched = None
    try:
        tenant = Tenant(root, "/opt/lib/libllama.so", "maps", str(MAPPINGS))
        assert _maps_bytes(tenant.pid) > 200 << 20
        watched = Watched(tmp_path, memory_cgroup)
        _counted_beside(watched.daemon, llama_build, tiny_model, llama_env, tmp_path)
        time.sleep(3)          # more scans of the tenant, its size changed each time
        watched.stop_polling()
        watched.assert_alive_and_healthy()
        assert tenant.state() != "T"
    finally:
        _end(watched, tenant)


def _billion_sections(src: Path, dest: Path) -> None:
    """A copy of src, sparse to 64 GiB, its header's section count 0 and section 0's size
    2^30: the extended count a reader takes (each header it walks, ~11.5 µs: hours)."""
    shutil.copy2(src, dest)
    with open(dest, "rb") as f:
        shoff = ELFFile(f).header.e_shoff
    with open(dest, "r+b") as f:
        f.seek(0x3C)                                   # Elf64_Ehdr.e_shnum
        f.write(struct.pack("<H", 0))
        f.seek(shoff + 32)                             # section 0's sh_size
        f.write(struct.pack("<Q", 1 << 30))
        f.truncate(64 << 30)


SLOW_FILES = 3
PARSE_DEADLINE_S = 2       # PROFINFER_PARSE_DEADLINE_S: each slow file costs the worker this long
DYNAMIC_ENTRIES = 1 << 20  # 16 MiB, under the 64 MiB a table may be: ~4 s of pyelftools (4.3 µs each)


def _long_dynamic(src: Path, dest: Path) -> None:
    """A copy of src whose .dynamic section is DYNAMIC_ENTRIES entries (DT_DEBUG, no
    DT_NULL before the end), appended: a reader that walks its tags for DT_NEEDED walks
    them all."""
    at = _copy_with_section_at(src, dest, ".dynamic")
    with open(dest, "r+b") as f:
        offset = f.seek(0, os.SEEK_END)
        f.write(struct.pack("<qQ", 21, 0) * DYNAMIC_ENTRIES)          # DT_DEBUG
        f.seek(at)
        f.write(struct.pack("<QQ", offset, 16 * DYNAMIC_ENTRIES))


def test_a_tenants_slow_and_bogus_files_delay_another_tenants_engine_by_one_reading(
        tmp_path, llama_build, tiny_model, llama_env, tenant_bin, memory_cgroup):
    """A tenant with a CUDA runtime (the cuda level reads the dynamic section of each of its
    executable mappings, to find the ones that link it) maps a 64 GiB file whose header
    claims 2^30 sections (refused by its header at once: hours of pyelftools otherwise) and
    three files whose dynamic sections are a million entries each: each one's reading runs to
    the parse deadline (2 s here), in the worker, off the loop. A llama.cpp run of another
    tenant (the host's), started once the first has cost its deadline, waits for the one
    reading running then, not for those left: it is watched within two deadlines, where
    served one reading each in turn it waited for one of them before each of its own files,
    asked one after another (and at the default 20 s deadline, minutes). It is counted
    exactly; /status says what failed, by tenant (the slow tenant's three, the host's none);
    the tenant is watched at the cuda level as any other; /healthz stays 200 past the time
    after which a stalled loop answers 503, and nothing is left stopped."""
    from profinfer.levels.cuda import workload as cuda_workload
    root = tmp_path / "tenant"
    _jail(root, tenant_bin)
    (root / "opt" / "lib").mkdir(parents=True)
    shutil.copy2(cuda_workload.ensure_cudart12(), root / "opt" / "lib" / "libcudart.so.12")
    _billion_sections(tenant_bin, root / "opt" / "lib" / "libhuge.so")
    slow = [f"/opt/lib/libkernels{i}.so" for i in range(SLOW_FILES)]
    for path in slow:
        _long_dynamic(tenant_bin, root / path.lstrip("/"))
    tenant = watched = None
    try:
        watched = Watched(tmp_path, memory_cgroup, env={"PROFINFER_PARSE_DEADLINE_S": str(PARSE_DEADLINE_S)})
        d = watched.daemon
        started = time.monotonic()

        def parse_worker() -> dict:
            return json.loads(_get(d.url + "/status")[1])["parse_worker"]
        tenant = Tenant(root, "/opt/lib/libcudart.so.12", "also", "/opt/lib/libhuge.so", *slow)
        deadline = time.monotonic() + 30
        while not parse_worker().get("failed") and time.monotonic() < deadline:    # its first killed
            time.sleep(0.1)
        first = parse_worker()
        assert first.get("failed") == 1 and first["deadline_s"] == PARSE_DEADLINE_S, (first, d.text())
        (slow_tenant,) = first["failed_by_tenant"]
        assert slow_tenant.startswith("root "), first
        waited = _counted_beside(d, llama_build, tiny_model, llama_env, tmp_path, 4 * PARSE_DEADLINE_S + 10)
        # the reading running (a deadline), the worker started again, its own readings, a
        # scan: measured 3.3 s; one of the slow tenant's between its own: 8.2 s and more
        assert waited < 2 * PARSE_DEADLINE_S + 3, f"watched after {waited:.1f} s\n{d.text()}"
        # the slow tenant's readings go on after, each to its deadline, once
        deadline = time.monotonic() + SLOW_FILES * (PARSE_DEADLINE_S + 5)
        while parse_worker()["failed"] < SLOW_FILES and time.monotonic() < deadline:
            time.sleep(0.2)
        last = parse_worker()
        assert last["failed"] == SLOW_FILES and last["failed_by_tenant"] == {slow_tenant: SLOW_FILES}, last
        time.sleep(max(0.0, started + STALL_S + 1 - time.monotonic()))     # past a stall's 503
        watched.stop_polling()
        watched.assert_alive_and_healthy()
        watched.daemon.watched(tenant.pid, timeout=5)
        assert tenant.state() != "T"
    finally:
        _end(watched, tenant)


def _children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def test_decoys_take_their_tenants_share_and_give_their_places_up(tmp_path, llama_build, tiny_model, llama_env,
                                                                 tenant_bin, memory_cgroup):
    """`--max-processes 4 --max-per-tenant 2`, PROFINFER_WATCH_GRACE_S=2. One tenant starts six
    processes that map a CUDA runtime and make no engine call: two are watched, four left out
    and counted under its tenant in /status. Another tenant's two fill the cap. A llama.cpp
    generation of the host's then finds a decoy giving its place up (from the first tenant,
    the longest watched) and is counted exactly; /healthz stays 200, and nothing is left
    stopped."""
    from profinfer.levels.cuda import workload as cuda_workload
    roots = [tmp_path / "tenant-a", tmp_path / "tenant-b"]
    for root in roots:
        _jail(root, tenant_bin)
        (root / "opt" / "lib").mkdir(parents=True)
        shutil.copy2(cuda_workload.ensure_cudart12(), root / "opt" / "lib" / "libcudart.so.12")
    tenants, watched = [], None
    try:
        tenants.append(Tenant(roots[0], "/opt/lib/libcudart.so.12", "copies", "6"))
        watched = Watched(tmp_path, memory_cgroup, ("--max-processes", "4", "--max-per-tenant", "2"),
                          {"PROFINFER_WATCH_GRACE_S": "2"})
        d = watched.daemon
        first = [tenants[0].pid, *_children(tenants[0].pid)]
        assert len(first) == 6

        def status() -> dict:
            return json.loads(_get(d.url + "/status")[1])
        deadline = time.monotonic() + 20
        while status()["limits"]["processes_dropped"] < 4 and time.monotonic() < deadline:
            time.sleep(0.2)
        st = status()
        assert {p["pid"] for p in st["processes"]} <= set(first) and len(st["processes"]) == 2, st
        (key, dropped), = st["limits"]["dropped_by_tenant"].items()
        assert key.startswith("root ") and dropped == 4, st["limits"]
        tenants.append(Tenant(roots[1], "/opt/lib/libcudart.so.12", "copies", "2"))
        second = [tenants[1].pid, *_children(tenants[1].pid)]
        deadline = time.monotonic() + 20
        while len(status()["processes"]) < 4 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert {p["pid"] for p in status()["processes"]} >= set(second), status()
        time.sleep(2)                         # past the grace: the decoys may give way
        _counted_beside(d, llama_build, tiny_model, llama_env, tmp_path)
        gave = [l for l in d.text().splitlines() if "gave its place up" in l]
        assert len(gave) == 1 and any(f"PID {p} " in gave[0] for p in first), d.text()
        watched.stop_polling()
        watched.assert_alive_and_healthy()
        assert [p for p in first + second if Tenant.state_of(p) == "T"] == []
    finally:
        kill_started()
        if watched is not None:
            watched.close()
        for t in tenants:
            t.kill()


def test_a_fifo_and_a_padded_loader_do_not_stall_the_loop(tmp_path, tenant_bin, memory_cgroup):
    """Two tenants at once. One with a CUDA runtime (the cuda level looks at each of its
    executable mappings) maps a library, deletes it and makes a FIFO at its path. The other's
    program names (PT_INTERP) a copy of glibc's loader padded to 4 MiB, .text's section header
    pointing at undecodable bytes (read inline, old: ~4 min on the loop). /healthz stays 200
    past the STALL_S after which a stalled loop answers 503, and the first is watched at the
    cuda level as any other."""
    from profinfer.levels.cuda import workload as cuda_workload
    from test_parsing_bounds import _padded_loader      # tests/: on the path, as conftest
    fifo_root, padded_root = tmp_path / "fifo-tenant", tmp_path / "padded-tenant"
    _jail(fifo_root, tenant_bin)
    (fifo_root / "opt" / "lib").mkdir(parents=True)
    shutil.copy2(cuda_workload.ensure_cudart12(), fifo_root / "opt" / "lib" / "libcudart.so.12")
    shutil.copy2(tenant_bin, fifo_root / "opt" / "lib" / "libkernels.so")
    exe = tmp_path / "padded_tenant"
    subprocess.run(["gcc", "-O1", "-o", str(exe), str(HERE / "hostile_tenant.c"),
                    "-Wl,--dynamic-linker=/lib64/ld-padded.so"], check=True)
    _jail(padded_root, exe)
    shutil.copy2(_padded_loader(tmp_path), padded_root / "lib64" / "ld-padded.so")
    tenants, watched = [], None
    try:
        tenants.append(Tenant(fifo_root, "/opt/lib/libcudart.so.12", "fifo", "/opt/lib/libkernels.so"))
        tenants.append(Tenant(padded_root, "/bin/tenant"))
        watched = Watched(tmp_path, memory_cgroup)
        time.sleep(STALL_S + 2)      # past the time after which a stalled loop answers 503 (polled each 0.5 s)
        watched.stop_polling()
        watched.assert_alive_and_healthy()
        watched.daemon.watched(tenants[0].pid, timeout=5)     # at the cuda level, as any other
        assert [t.state() for t in tenants if t.state() == "T"] == []
    finally:
        if watched is not None:
            watched.close()
        for t in tenants:
            t.kill()
