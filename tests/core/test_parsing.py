"""Readings of tenants' files in the worker process (profinfer.core.target.parsing): one that runs past
its deadline is killed, told, and not tried again, and the worker serves the next; one that
needs more memory than the worker's limit fails there, not in the caller; the caller waits
for a new reading a bounded while, then goes on (NotReady) and gets it later."""
from __future__ import annotations

import os
import time

import pytest

from profinfer.core.target import parsing
from profinfer.core.base.errors import ProfinferError


@pytest.fixture
def worker():
    parsing.start(wait_s=0.5, deadline_s=3.0)
    yield parsing._worker
    parsing.stop()


def _worker_pid(w) -> int:
    return w.proc.pid


def test_past_its_deadline_killed_told_and_not_tried_again(worker):
    first = _worker_pid(worker)
    t0 = time.monotonic()
    with pytest.raises(parsing.NotReady):
        parsing.run(("slow",), "time", "sleep", 60)
    assert time.monotonic() - t0 < 2.5          # the caller waited 0.5 s, not the reading's 60
    deadline = time.monotonic() + 30
    while True:
        try:
            parsing.run(("slow",), "time", "sleep", 60)
        except parsing.NotReady:
            assert time.monotonic() < deadline
            time.sleep(0.2)
            continue
        except ProfinferError as e:
            assert "took over 3 s" in str(e)
            break
    assert not os.path.exists(f"/proc/{first}")        # killed (and reaped)
    t0 = time.monotonic()
    with pytest.raises(ProfinferError, match="took over"):      # told again at once, not re-read
        parsing.run(("slow",), "time", "sleep", 60)
    assert time.monotonic() - t0 < 0.5
    # the next reading: a new worker
    assert _run_until_done(("pid",), "os", "getpid") not in (first, os.getpid())


def _run_until_done(key, module, function, *args):
    deadline = time.monotonic() + 30
    while True:
        try:
            return parsing.run(key, module, function, *args)
        except parsing.NotReady:
            assert time.monotonic() < deadline
            time.sleep(0.1)


def test_over_its_memory_fails_in_the_worker(worker):
    with pytest.raises(ProfinferError, match="MiB to read"):
        _run_until_done(("big",), "os", "urandom", 1 << 30)
    assert _run_until_done(("after",), "os", "getpid") == _worker_pid(worker)   # it lives on


def test_without_a_worker_readings_run_in_the_caller():
    assert parsing.run(("pid",), "os", "getpid") == os.getpid()


def test_the_worker_can_read_and_little_else():
    """The parse worker confines itself before its first reading (core/target/confine.py). As the
    kernel reports it: two capabilities (CAP_SYS_PTRACE, CAP_DAC_READ_SEARCH) in every set,
    no_new_privs, a seccomp filter. A reading of another process's library through its
    /proc/PID/root still works; one that opens a socket, runs a program, signals a process,
    writes a file or opens another process's memory for writing fails. A mapped file deleted
    since is read through /proc/PID/map_files, its descriptor given by the daemon."""
    import shutil
    import subprocess
    import sys
    libc = "/usr/lib/x86_64-linux-gnu/libc.so.6"
    other = subprocess.Popen(["sleep", "60"])
    copy = f"/tmp/confined-libc-{os.getpid()}.so"
    shutil.copy(libc, copy)
    holder = subprocess.Popen([sys.executable, "-c", "import mmap, os, sys, time\n"
                               "f = open(sys.argv[1], 'rb'); m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)\n"
                               "os.unlink(sys.argv[1]); print('ready', flush=True); time.sleep(60)", copy],
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline() == "ready\n"
    span = next(line.split()[0] for line in open(f"/proc/{holder.pid}/maps") if "(deleted)" in line)
    deleted_path = f"/proc/{holder.pid}/map_files/{span}"
    parsing.start(wait_s=2.0)
    try:
        worker = parsing._worker
        assert set(worker.confinement) == {"capabilities", "no_new_privs", "landlock", "seccomp"}
        assert not any(v.startswith("not applied") for v in worker.confinement.values()), worker.confinement
        status = dict(line.split(":\t", 1) for line in open(f"/proc/{worker.proc.pid}/status").read().splitlines()
                      if ":\t" in line)
        kept = 1 << 19 | 1 << 2                    # CAP_SYS_PTRACE, CAP_DAC_READ_SEARCH
        assert int(status["CapEff"], 16) == int(status["CapPrm"], 16) == kept, status
        assert int(status["CapBnd"], 16) == kept and int(status["CapAmb"], 16) == 0, status
        assert status["NoNewPrivs"].strip() == "1" and status["Seccomp"].strip() == "2", status

        def ask(key, module, function, *args):
            deadline = time.monotonic() + 30
            while True:
                parsing.pump()
                try:
                    return parsing.run(key, module, function, *args)
                except parsing.NotReady:
                    assert time.monotonic() < deadline
                    time.sleep(0.05)

        from profinfer.core.target import symbols      # noqa: F401 (preloaded, as the daemon's readers are)
        elf = ask(("elf",), "profinfer.core.target.symbols", "_read_elf", f"/proc/{other.pid}/root{libc}", f"/proc/{other.pid}/root")
        assert "malloc" in elf.symbols and elf.build_id, elf.build_id
        # a mapped file deleted since (an engine's library replaced): read through map_files
        deleted_elf = ask(("deleted",), "profinfer.core.target.symbols", "_read_elf", deleted_path, f"/proc/{holder.pid}/root")
        assert deleted_elf.build_id == elf.build_id
        for key, call in (("socket", ("socket", "socket")), ("exec", ("os", "execv", "/bin/true", ["/bin/true"])),
                          ("kill", ("os", "kill", other.pid, 0)),
                          ("write", ("os", "open", f"/tmp/confined-{os.getpid()}", os.O_WRONLY | os.O_CREAT)),
                          ("mem", ("os", "open", f"/proc/{other.pid}/mem", os.O_RDWR))):
            with pytest.raises(ProfinferError, match="PermissionError"):
                ask((key,), *call)
        assert not os.path.exists(f"/tmp/confined-{os.getpid()}")
    finally:
        parsing.stop()
        for p in (other, holder):
            p.kill()
            p.wait()
