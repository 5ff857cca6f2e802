"""Every probe profinfer attaches to a bundled workload sits on an instruction the kernel
emulates, and the recording says how many do not ("doctor reports stepped probes:
0 on every bundled workload").

Read from outside profinfer: the probes attached are the kernel's (the uprobe links the
profinfer process holds: BPF_OBJ_GET_INFO_BY_FD on each, path and file offsets, Linux 6.8+),
the instruction at each offset is objdump's (not profinfer's capstone), and the kinds the
kernel emulates are those bench/probe_emulation.py measured on this kernel (bench/results.md):
push of a register, call/jmp rel, jcc rel, and the nops of the kernel's x86_nops table.
"""
from __future__ import annotations

import ctypes
import json
import os
import re
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from conftest import TESTS, Target, endless_cmd, llama_server, open_fds, start_profinfer

from profinfer.levels.cuda import workload as cuda_workload

PROGRAMS = TESTS / "levels" / "cuda" / "programs"
OPS_PACK = TESTS / "levels" / "cuda" / "ops_pack.toml"

# ---- the kernel's view: the uprobe links a process holds ----

_libc = ctypes.CDLL(None, use_errno=True)
_SYS_BPF = 321                     # x86-64
_OBJ_GET_INFO_BY_FD, _LINK_GET_FD_BY_ID = 15, 30
_LINK_PERF_EVENT, _LINK_UPROBE_MULTI = 7, 12
_PERF_UPROBE, _PERF_URETPROBE = 1, 2
_UPROBE_MULTI_RETURN = 1


class _LinkInfo(ctypes.Structure):
    # struct bpf_link_info: type, id, prog_id, then the union (8-byte aligned) as u64 words
    _fields_ = [("type", ctypes.c_uint32), ("id", ctypes.c_uint32), ("prog_id", ctypes.c_uint32),
                ("_pad", ctypes.c_uint32), ("u", ctypes.c_uint64 * 12)]


class _InfoAttr(ctypes.Structure):
    _fields_ = [("bpf_fd", ctypes.c_uint32), ("info_len", ctypes.c_uint32), ("info", ctypes.c_uint64)]


class _IdAttr(ctypes.Structure):
    _fields_ = [("id", ctypes.c_uint32), ("next_id", ctypes.c_uint32), ("open_flags", ctypes.c_uint32)]


def _bpf(cmd: int, attr) -> int:
    r = _libc.syscall(_SYS_BPF, cmd, ctypes.byref(attr), ctypes.sizeof(attr))
    if r < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return r


def _info(fd: int, info: _LinkInfo) -> None:
    _bpf(_OBJ_GET_INFO_BY_FD, _InfoAttr(fd, ctypes.sizeof(info), ctypes.addressof(info)))


def link_probes(link_id: int) -> list[tuple[str, int, bool]]:
    """(file, file offset, is a return probe) of each probe of a uprobe link; [] for another
    kind of link (a tracepoint's)."""
    fd = _bpf(_LINK_GET_FD_BY_ID, _IdAttr(link_id, 0, 0))
    try:
        first = _LinkInfo()
        _info(fd, first)
        path = ctypes.create_string_buffer(4096)
        again = _LinkInfo()
        if first.type == _LINK_UPROBE_MULTI:
            # uprobe_multi: path, offsets, ref_ctr_offsets, cookies; path_size, count; flags, pid
            count, flags = first.u[4] >> 32, first.u[5] & 0xFFFFFFFF
            offsets = (ctypes.c_uint64 * count)()
            again.u[0], again.u[1], again.u[4] = ctypes.addressof(path), ctypes.addressof(offsets), 4096 | count << 32
            _info(fd, again)
            return [(path.value.decode(), int(o), bool(flags & _UPROBE_MULTI_RETURN)) for o in offsets]
        if first.type == _LINK_PERF_EVENT and first.u[0] & 0xFFFFFFFF in (_PERF_UPROBE, _PERF_URETPROBE):
            # perf_event: type; uprobe: file_name, name_len and offset, cookie
            again.u[1], again.u[2] = ctypes.addressof(path), 4096
            _info(fd, again)
            return [(path.value.decode(), int(again.u[2] >> 32), first.u[0] & 0xFFFFFFFF == _PERF_URETPROBE)]
        return []
    finally:
        os.close(fd)


def held_probes(pid: int) -> list[tuple[str, int, bool]]:
    """Every uprobe of the links process `pid` holds (its fds' fdinfo name each link's id)."""
    out = []
    for _, target, info in open_fds(pid):
        m = re.search(r"^link_id:\s*(\d+)", info, re.M) if target == "anon_inode:bpf_link" else None
        if m:
            out += link_probes(int(m.group(1)))
    return out


# ---- objdump's view: the instruction at each offset, and whether the kernel emulates it ----

# the kernel's x86_nops table, 1 to 8 bytes (a 9-byte nopw is single-stepped, a cs-prefixed one refused)
KERNEL_NOPS = {"90", "66 90", "0f 1f 00", "0f 1f 40 00", "0f 1f 44 00 00", "66 0f 1f 44 00 00",
               "0f 1f 80 00 00 00 00", "0f 1f 84 00 00 00 00 00"}
EMULATED = re.compile(r"^(push\s+%[a-z0-9]+"                  # push of a register
                      r"|call\s+0x[0-9a-f]+|jmp\s+0x[0-9a-f]+"  # rel32 / rel8 (objdump: an address)
                      r"|j(?!mp|rcxz|ecxz|cxz)[a-z]{1,3}\s+0x[0-9a-f]+)$")   # jcc (not jrcxz, loop)
SLOT = 32        # 15 bytes of the file, then nops: each slot's first instruction starts aligned


def instructions(probes: list[tuple[str, int, bool]]) -> list[tuple[str, str]]:
    """(raw bytes, text) of the instruction at each probe's file offset, as objdump decodes
    the file's bytes there (one objdump run for all)."""
    blob = bytearray()
    for path, offset, _ in probes:
        with open(path, "rb") as f:
            f.seek(offset)
            code = f.read(15)
        blob += code + b"\x90" * (SLOT - len(code))
    with tempfile.NamedTemporaryFile(suffix=".bin") as tmp:
        tmp.write(blob)
        tmp.flush()
        out = subprocess.run(["objdump", "-D", "-w", "-b", "binary", "-m", "i386:x86-64", tmp.name],
                             capture_output=True, text=True, check=True).stdout
    found = {}
    for line in out.splitlines():
        m = re.match(r"\s*([0-9a-f]+):\t([0-9a-f ]+?)\s*\t(.*)$", line)
        if m and int(m.group(1), 16) % SLOT == 0:
            found[int(m.group(1), 16) // SLOT] = (m.group(2).strip(), re.sub(r"\s+", " ", m.group(3).strip()))
    return [found.get(i, ("", "")) for i in range(len(probes))]


def emulated(raw: str, text: str) -> bool:
    return raw in KERNEL_NOPS or bool(EMULATED.match(text))


def stepped_probes(probes: list[tuple[str, int, bool]]) -> list[str]:
    """The probes whose instruction the kernel single-steps: file+offset and objdump's text."""
    return [f"{os.path.basename(p)}+{off:#x}{' (return)' if ret else ''}: {text} [{raw}]"
            for (p, off, ret), (raw, text) in zip(probes, instructions(probes)) if not emulated(raw, text)]


def _meta(summary: Path) -> dict[str, str]:
    return json.loads(summary.read_text())["meta"]


def _loader(path: str) -> bool:
    """The dynamic loader, probed by the session's follower (not a collector's probe)."""
    return os.path.basename(path).startswith("ld-linux")


# ---- the check of the classification itself, against what the kernel was measured doing ----

def test_the_classification_matches_objdump_on_known_encodings():
    """The kinds above, on encodings whose fate bench/probe_emulation.py measured here."""
    cases = {"55": True, "41 54": True, "e8 00 00 00 00": True, "eb 00": True, "74 00": True,
             "0f 84 00 00 00 00": True, "0f 1f 44 00 00": True, "66 90": True,
             "f3 0f 1e fa": False, "66 0f 1f 84 00 00 00 00 00": False, "e3 00": False, "e2 00": False,
             "48 89 f8": False, "6a 00": False, "4c 8d 54 24 08": False, "ff d0": False}
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "code"
        path.write_bytes(b"".join(bytes.fromhex(h) + b"\x90" * (16 - len(bytes.fromhex(h))) for h in cases))
        probes = [(str(path), 16 * i, False) for i in range(len(cases))]
        got = [emulated(raw, text) for raw, text in instructions(probes)]
    assert got == list(cases.values()), list(zip(cases, got))


# ---- the bundled workloads ----

@pytest.mark.parametrize("extra", [(), ("--levels", "token,graph,op,sched", "--counters", "task-clock")],
                         ids=["demo-levels", "two-probe-op-design"])
def test_llama_cpp_probes_are_emulated(extra, llama_build, tiny_model, llama_env, tmp_path):
    """The demo's workload (llama.cpp, the tiny model) at its levels, and with counters (the
    op level's two-probe design) and the sched level."""
    target = Target(endless_cmd(llama_build, tiny_model), llama_env)
    summary = tmp_path / "s.json"
    try:
        prof = start_profinfer(["attach", "--pid", str(target.proc.pid), "--duration", "3", "--quiet",
                                "--json", str(summary), *extra], env=llama_env)
        probes = held_probes(prof.pid)
        _, err = prof.communicate(timeout=120)
    finally:
        target.stop()
    assert prof.returncode == 0, err
    assert probes, "no uprobe link held by profinfer"
    meta = _meta(summary)
    assert stepped_probes(probes) == []
    assert meta["probes_stepped"] == "0" and int(meta["probes"]) == len(probes)


def test_llama_server_request_probes_are_emulated(llama_build, tiny_model, llama_env, tmp_path):
    """llama-server's request marks (its task queue's post, a task's launch on its slot) too:
    probed in libllama-server-impl.so, beside the token level's."""
    summary = tmp_path / "s.json"
    with llama_server(llama_build, tiny_model, llama_env, 2) as (proc, _url):
        prof = start_profinfer(["attach", "--pid", str(proc.pid), "--levels", "token", "--duration", "1",
                                "--quiet", "--json", str(summary)], env=llama_env)
        probes = held_probes(prof.pid)
        _, err = prof.communicate(timeout=120)
    assert prof.returncode == 0, err
    server = [p for p in probes if os.path.basename(p[0]).startswith("libllama-server-impl")]
    assert len(server) == 2, probes
    assert stepped_probes(probes) == []
    meta = _meta(summary)
    assert meta["probes_stepped"] == "0" and int(meta["probes"]) == len(probes)


CUDA_CASES = {
    # the static runtime (nvcc's default) and libcuda; the shared CUDA 13 runtime with CUDA 12's
    # (PyPI) preloaded and libcuda; the ops pack (a program's own functions as ops) with its runtime
    "static": ("cuda_calls", "static", ("--levels", "cuda"), False),
    "shared+cudart12": ("cuda_calls", "shared", ("--levels", "cuda"), True),
    "ops-pack": ("cuda_ops", "static", ("--levels", "op,cuda", "--pack", str(OPS_PACK)), False),
}


@pytest.mark.parametrize("case", sorted(CUDA_CASES))
def test_cuda_probes_are_emulated(case, tmp_path):
    """The CUDA programs recorded at the cuda level, held before their calls while the links
    are read: the runtime's and the driver's functions, entry and return probes."""
    name, variant, args, preload = CUDA_CASES[case]
    program = cuda_workload.build_program(PROGRAMS / f"{name}.cu", variant)
    go, summary = tmp_path / "go", tmp_path / "s.json"
    cmd = [str(program), "--log", str(tmp_path / "log.jsonl"), "--start-after", str(go)]
    if name == "cuda_calls":       # libcuda dlopened before the wait: probed at the loader's hook
        cmd += ["--libcuda", str(cuda_workload.ensure_libcuda()), "--libcuda-early"]
    env = {**os.environ, **({"LD_PRELOAD": str(cuda_workload.ensure_cudart12())} if preload else {})}
    prof = start_profinfer(["record", "--quiet", "--json", str(summary), *args, "--", *cmd], env=env)
    try:
        deadline = time.monotonic() + 30
        line = prof.stdout.readline()          # the program's "ready": everything it maps is mapped
        assert line.startswith("ready "), line
        # probed before it runs on (held at the loader's hook), unless something else continued
        # it meanwhile (another session's daemon): wait for libcuda's probes then
        probes = held_probes(prof.pid)
        while (name == "cuda_calls" and not any(p.endswith("libcuda.so.1") for p, _, _ in probes)
               and time.monotonic() < deadline):
            time.sleep(0.1)
            probes = held_probes(prof.pid)
        go.write_text("")
        _, err = prof.communicate(timeout=max(1, deadline - time.monotonic()) + 60)
    finally:
        if prof.poll() is None:
            prof.kill()
            prof.wait()
    assert prof.returncode == 0, err
    files = {os.path.basename(p) for p, _, _ in probes}
    assert "libcuda.so.1" in files or name == "cuda_ops", files
    if preload:
        assert {"libcudart.so.12"} <= files and any(f.startswith("libcudart.so.13") for f in files), files
    meta = _meta(summary)
    assert stepped_probes(probes) == []
    stated = int(meta.get("probes_stepped", 0)) + int(meta["cuda_probes_stepped"])
    collectors = int(meta.get("probes", 0)) + int(meta["cuda_probes"])
    assert stated == 0 and collectors == sum(not _loader(p) for p, _, _ in probes)


def test_daemon_probes_are_emulated(llama_build, tiny_model, llama_env, tmp_path):
    """The daemon's probes (the token floor and graph probes shared per build, the cuda level,
    discovery's loader hooks, and a process's op probes where the budget lets it have them) on
    a llama.cpp process and a CUDA program; its /status says none of theirs is single-stepped.
    (The daemon watches every engine process on the machine: only the files these two map,
    and the groups they are in, are looked at.)"""
    from daemon_helpers import _STARTED, Daemon, Workload, _get, kill_started

    program = cuda_workload.build_program(PROGRAMS / "cuda_calls.cu", "shared")
    d = Daemon(tmp_path, extra=("--levels", "token,graph,op,cuda"))
    try:
        llama = Workload(llama_build, tiny_model, llama_env, tmp_path)
        cuda = subprocess.Popen([str(program), "--log", str(tmp_path / "log.jsonl"), "--start-after",
                                 str(tmp_path / "go")], stdout=subprocess.PIPE, text=True)
        _STARTED.append(cuda)
        assert cuda.stdout.readline().startswith("ready ")
        ours = {llama.proc.pid, cuda.pid}
        for pid, level in ((llama.proc.pid, "token"), (cuda.pid, "cuda")):
            deadline = time.monotonic() + 60          # the machine may be busy
            while level not in d.watched(pid, timeout=60)["levels"] and time.monotonic() < deadline:
                time.sleep(0.2)
            assert level in d.watched(pid)["levels"], d.text()
        mapped = {line.split()[-1] for pid in ours for line in Path(f"/proc/{pid}/maps").read_text().splitlines()
                  if line.split()[-1].startswith("/")}
        probes = [p for p in held_probes(d.proc.pid) if os.path.realpath(p[0]) in
                  {os.path.realpath(m) for m in mapped}]
        status = json.loads(_get(d.url + "/status", d.token)[1])
    finally:
        kill_started()
        d.stop()
    files = {os.path.basename(p) for p, _, _ in probes}
    assert "libllama.so.0.6.0" in files and "libcudart.so.13" in " ".join(files), files
    assert stepped_probes(probes) == []
    stated = (sum(g["probes_stepped"] for g in status["shared_probes"] if ours & set(g["processes"]))
              + sum(p["probes_stepped"] for p in status["processes"] if p["pid"] in ours))
    assert stated == 0


def test_doctor_says_how_many_probes_are_stepped(llama_build, tiny_model):
    """doctor's rows for the llama.cpp demo and the CUDA runtimes here: a real attach each,
    whose count matches the probes the workloads above hold (none stepped)."""
    from profinfer import doctor
    from profinfer.core.plugin.commands import demos
    llama = next(d for d in demos() if d.name == "llama.cpp")
    for status, detail in (doctor._check_demo(llama), doctor._check_cuda_runtime()):
        m = re.match(r"stepped probes: (\d+) of (\d+)", detail)
        assert status == doctor.OK and m and m.group(1) == "0" and int(m.group(2)) > 0, detail
