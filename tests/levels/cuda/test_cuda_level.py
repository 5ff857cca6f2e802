"""The cuda level against programs built with nvcc that log every CUDA call they make: the
real CUDA 13 runtime (the toolkit's, linked statically as nvcc does by default, and shared),
CUDA 12's from PyPI (dlopen'd after recording started), and the driver library. There is no
GPU: the calls fail, but enter the probed functions with their real arguments, which is what
is compared, exactly, with the program's own log."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from profinfer.recording import record_command
from profinfer.levels.cuda import workload

PROGRAMS = Path(__file__).parent / "programs"
OPS_PACK = Path(__file__).parent / "ops_pack.toml"
PROFINFER = [sys.executable, "-m", "profinfer.cli"]
LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")
NOT_PROBED = ("cuInit",)


def _program(name: str, variant: str) -> Path:
    return workload.build_program(PROGRAMS / f"{name}.cu", variant)


def _log(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _hex(v) -> int:
    return int(v, 16) if isinstance(v, str) else int(v or 0)


def _captured(log: list[dict]) -> list[bool]:
    """Per line: a launch made while its stream was being captured (begun successfully)."""
    capturing, out = set(), []
    for d in log:
        if d["fn"] == "cudaStreamBeginCapture" and d["ret"] == 0:
            capturing.add(_hex(d["stream"]))
        elif d["fn"] == "cudaStreamEndCapture":
            capturing.discard(_hex(d["stream"]))
        out.append(d["fn"] in LAUNCHES and _hex(d.get("stream")) in capturing)
    return out


def _expected_kernel(d: dict, log: list[dict]) -> str:
    if d["fn"].startswith("cuLaunch"):
        got = [g for g in log if g["fn"] == "cuModuleGetFunction" and g["func"] == d["func"]]
        # the driver names a function only when cuModuleGetFunction made it (no driver: it failed)
        return d["kernel"] if got and got[-1]["ret"] == 0 else f"CUfunction@{d['func']}"
    return d["kernel"]


def _key_from_log(d: dict, log: list[dict], captured: bool) -> tuple:
    fn = d["fn"]
    if fn in LAUNCHES:
        return (fn, _expected_kernel(d, log), tuple(d["grid"]), tuple(d["block"]), d["shmem"],
                _hex(d["stream"]), captured)
    if fn.startswith("cudaMemcpy"):
        return (fn, d["bytes"], {0: "H2H", 1: "H2D", 2: "D2H", 3: "D2D", 4: "Default"}[d["kind"]],
                _hex(d["dst"]), _hex(d.get("stream")), d["ret"])
    if fn.startswith("cudaMemset"):
        return (fn, d["bytes"], _hex(d["dst"]), _hex(d.get("stream")), d["ret"])
    if fn.startswith(("cudaMalloc", "cudaHostAlloc")):
        return (fn, d["size"], _hex(d["ptr"]), d["ret"])
    if fn.startswith("cudaFree"):
        return (fn, _hex(d["ptr"]), d["ret"])
    if fn in ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize"):
        return (fn, _hex(d.get("stream") or d.get("event")), d["ret"])
    if fn == "cudaStreamWaitEvent":
        return (fn, _hex(d["stream"]), _hex(d["event"]), d["ret"])
    if fn == "cudaGraphLaunch":
        return (fn, _hex(d["exec"]), _hex(d["stream"]))
    if fn == "cudaGraphInstantiate":
        return (fn, _hex(d["graph"]), _hex(d["exec"]), d["ret"])
    if fn in ("cudaStreamBeginCapture", "cudaStreamEndCapture", "cuModuleGetFunction"):
        return (fn, d["ret"])
    raise AssertionError(f"the program logged a call the test does not know: {fn}")


def _key_from_call(c) -> tuple | None:
    fn = c.api
    if fn in LAUNCHES:
        return (fn, c.kernel, c.grid, c.block, c.shmem, c.stream, c.captured)
    if fn.startswith("cudaMemcpy"):
        return (fn, c.bytes, c.copy_kind, c.ptr, c.stream, c.ret)
    if fn.startswith("cudaMemset"):
        return (fn, c.bytes, c.ptr, c.stream, c.ret)
    if fn.startswith(("cudaMalloc", "cudaHostAlloc")):
        return (fn, c.bytes, c.ptr, c.ret)
    if fn.startswith("cudaFree"):
        return (fn, c.ptr, c.ret)
    if fn in ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize"):
        return (fn, c.handle, c.ret)
    if fn == "cudaStreamWaitEvent":
        return (fn, c.stream, c.handle, c.ret)
    if fn == "cudaGraphLaunch":
        return (fn, c.handle, c.stream)
    if fn == "cudaGraphInstantiate":
        return (fn, c.handle, c.ptr, c.ret)
    if fn in ("cudaStreamBeginCapture", "cudaStreamEndCapture", "cuModuleGetFunction"):
        return (fn, c.ret)
    return None        # registrations: the runtime's own, not the program's


def _per_call(c):
    """A group BPF counted, as one of its calls (bytes are the group's total; no pointers)."""
    if c.count == 1:
        return c
    from dataclasses import replace
    return replace(c, count=1, bytes=c.bytes // c.count)


def _compare(log: list[dict], calls, pointers: bool = True) -> None:
    def copy_ptr(k: tuple) -> tuple:
        # counted in BPF, copies and sets keep no pointers: compare without the destination
        if pointers or not k[0].startswith(("cudaMemcpy", "cudaMemset")):
            return k
        return tuple(v for i, v in enumerate(k) if i != (3 if k[0].startswith("cudaMemcpy") else 2))

    want = Counter(copy_ptr(_key_from_log(d, log, cap)) for d, cap in zip(log, _captured(log))
                   if d["fn"] not in NOT_PROBED)
    got = Counter(copy_ptr(k) for k in (_key_from_call(_per_call(c)) for c in calls for _ in range(c.count)) if k)
    missing, extra = want - got, got - want
    assert not missing and not extra, f"missing {dict(missing)}; extra {dict(extra)}"


CASES = {
    # (program variant, runtime argument): CUDA 13 static (nvcc's default) and shared; CUDA 12
    # from PyPI, dlopen'd by the program once recording has started
    "cuda13-static": ("static", None),
    "cuda13-shared": ("shared", None),
    "cuda12-dlopen": ("shared", "cudart12"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_call_exact_with_timeline(case, tmp_path, libcuda, cudart12):
    variant, runtime = CASES[case]
    program = _program("cuda_calls", variant)
    log = tmp_path / "calls.jsonl"
    cmd = [str(program), "--log", str(log), "--libcuda", str(libcuda), "--repeat", "2"]
    if runtime:
        cmd += ["--runtime", f"dlopen:{cudart12}"]
    profile, code = record_command(cmd, {"cuda"}, None, timeline=True)
    assert code == 0
    assert profile.lost_events == 0
    calls = profile.cuda_calls
    _compare(_log(log), calls)
    names = {c.kernel for c in calls if c.what == "launch" and c.api.startswith("cuda")}
    assert "void pi_test::scale<float>(float*, float, int)" in names
    assert "void pi_test::inner::add_n<4>(int*, int)" in names
    if variant == "static" and not runtime:
        assert any(v.startswith("static in ") for k, v in profile.meta.items() if k.startswith("cuda_runtime:"))
    if runtime:   # the late library was probed before its first call: every call above counted
        assert any("libcudart.so.12" in k for k in profile.meta)


def test_counted_in_bpf_without_timeline(tmp_path, libcuda):
    """Without a timeline, launches, copies and syncs are counted in BPF: the same totals."""
    program = _program("cuda_calls", "static")
    log = tmp_path / "calls.jsonl"
    profile, code = record_command([str(program), "--log", str(log), "--libcuda", str(libcuda),
                                    "--repeat", "3"], {"cuda"}, None, timeline=False)
    assert code == 0 and profile.lost_events == 0
    assert profile.meta["cuda_timeline"] == "0"
    grouped = [c for c in profile.cuda_calls if c.count > 1]
    assert grouped, "nothing was counted in BPF"
    _compare(_log(log), profile.cuda_calls, pointers=False)
    copied = sum(c.bytes for c in profile.cuda_calls if c.what == "copy")
    assert copied == sum(d["bytes"] for d in _log(log) if d["fn"].startswith("cudaMemcpy"))


def _attach_and_run(tmp_path, program_args: list[str]) -> tuple[Path, Path, Path]:
    """Start the program held before its calls, attach (cuda level, with a timeline), let it
    run to its end; returns (its log, the JSON summary, the trace)."""
    log, go = tmp_path / "calls.jsonl", tmp_path / "go"
    summary, trace = tmp_path / "s.json", tmp_path / "t.pftrace"
    target = subprocess.Popen([*program_args, "--log", str(log), "--start-after", str(go)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert target.stdout.readline().startswith("ready ")
        _attach_then(target, go, ["--json", str(summary), "-o", str(trace)])
    finally:
        target.kill()
    return log, summary, trace


def test_attach_after_registration_names_every_kernel(tmp_path, libcuda):
    program = _program("cuda_calls", "static")
    log, summary, _ = _attach_and_run(tmp_path, [str(program), "--libcuda", str(libcuda)])
    cuda = json.loads(summary.read_text())["cuda"]
    logged = Counter(d["kernel"] for d in _log(log) if d["fn"].startswith("cudaLaunch"))
    named = Counter({k: v["launches"] + v["captured"] for k, v in cuda["kernels"].items()
                     if not k.startswith("CUfunction@")})
    assert named == logged


def test_attach_then_a_runtime_dlopened_later_loses_no_call(tmp_path, libcuda, cudart12):
    """Attached first; then the program dlopens CUDA 12's runtime and libcuda and calls them
    at once: probed at the loader's hook, before the first call."""
    from profinfer.exporters.trace_reader import read_trace
    program = _program("cuda_calls", "static")
    log, _, trace = _attach_and_run(tmp_path, [str(program), "--runtime", f"dlopen:{cudart12}",
                                               "--libcuda", str(libcuda)])
    back = read_trace(trace)
    assert back.lost_events == 0
    _compare(_log(log), back.cuda_calls)
    assert any("libcudart.so.12" in k for k in back.meta)


def _attach_then(target: subprocess.Popen, go: Path, outputs: list[str]) -> None:
    """attach (cuda level) to the waiting target, then let it go; its end ends the attach."""
    prof = subprocess.Popen(PROFINFER + ["attach", "--pid", str(target.pid), "--levels", "cuda", "--quiet",
                                         *outputs], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and prof.poll() is None and not _attached(prof):
        time.sleep(0.05)
    go.write_text("")
    target.wait(timeout=60)
    _, err = prof.communicate(timeout=60)
    assert prof.returncode == 0, err


def _attached(proc: subprocess.Popen) -> bool:
    import select
    if select.select([proc.stderr], [], [], 0)[0]:
        line = proc.stderr.readline()
        return "attached" in line
    return False


def test_each_call_attributed_to_the_op_open_on_its_thread(tmp_path):
    """The program's functions are an engine's ops (a test pack: packs are data); each CUDA
    call made inside one, on any of its threads, carries that op, as the program logged."""
    program = _program("cuda_ops", "static")
    log = tmp_path / "ops.jsonl"
    profile, code = record_command([str(program), "--log", str(log), "--threads", "3", "--layers", "5"],
                                   {"op", "cuda"}, None, packs=(str(OPS_PACK),), timeline=True)
    assert code == 0 and profile.lost_events == 0
    want = Counter((d["tid"], d["fn"], d["op"] or "") for d in _log(log))
    got = Counter((c.tid, c.api, c.op) for c in profile.cuda_calls if c.what != "registration")
    assert len({t for t, _, _ in want}) == 3
    assert got == want
    ops = {c.op for c in profile.calls}
    assert ops == {"pi_op_attention", "pi_op_mlp", "pi_op_norm"}


def test_perfetto_nesting_streams_and_live_memory(tmp_path):
    """Written and read back: each CUDA call a slice inside the op slice it was made in, on
    its thread; each stream a track of its launches in the program's order; the live-memory
    counter ends at what was never freed."""
    from profinfer.exporters.perfetto import write_perfetto
    from profinfer.exporters.trace_reader import read_named_tracks, read_trace
    program = _program("cuda_ops", "static")
    log = tmp_path / "ops.jsonl"
    profile, code = record_command([str(program), "--log", str(log), "--threads", "2", "--layers", "3"],
                                   {"op", "cuda"}, None, packs=(str(OPS_PACK),), timeline=True)
    assert code == 0
    trace = tmp_path / "t.pftrace"
    write_perfetto(profile, trace)
    back = read_trace(trace)
    assert len(back.cuda_calls) == len(profile.cuda_calls)
    ops = back.calls
    inside = 0
    for c in back.cuda_calls:
        if not c.op:
            continue
        parent = [o for o in ops if o.tid == c.tid and o.start_ns <= c.start_ns <= o.end_ns]
        assert [o.op for o in parent] == [c.op], (c, parent)
        inside += 1
    assert inside == sum(1 for d in _log(log) if d["op"])
    tracks = read_named_tracks(trace)
    by_stream: dict[int, list[str]] = {}
    for d in sorted(_log(log), key=lambda d: d["t_ns"]):
        if d["fn"] == "cudaLaunchKernel":
            by_stream.setdefault(_hex(d["stream"]), []).append(d["kernel"])
    for stream, kernels in by_stream.items():
        name = f"CUDA stream 0x{stream:x}" + (" (default)" if stream == 0 else "")
        assert tracks[(profile.pid, name)] == kernels
    # the program's own account of its device memory: what its successful allocations left
    # (none here: without a driver they fail; the writer's counter is tested with made-up
    # successful ones in test_cuda_memory_logic.py)
    live: dict[int, int] = {}
    for d in _log(log):
        if d["ret"] == 0 and d["fn"] in ("cudaMalloc", "cudaMallocAsync"):
            live[_hex(d["ptr"])] = d["size"]
        elif d["ret"] == 0 and d["fn"] in ("cudaFree", "cudaFreeAsync"):
            live.pop(_hex(d["ptr"]), None)
    memory = tracks.get((profile.pid, "CUDA live device memory (bytes)"))
    if memory is None:
        assert not any(d["ret"] == 0 for d in _log(log) if d["fn"].startswith("cudaMalloc"))
    else:
        assert memory[-1] == sum(live.values())


def test_a_stripped_static_runtime_is_named_not_silently_missed(tmp_path):
    program = _program("cuda_calls", "static")
    stripped = tmp_path / "cuda_calls_stripped"
    subprocess.run(["strip", "-o", str(stripped), str(program)], check=True)
    out = subprocess.run(PROFINFER + ["record", "--levels", "cuda", "--quiet", "--",
                                      str(stripped), "--log", str(tmp_path / "l.jsonl")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "Traceback" not in out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert "stripped (no .symtab)" in last and str(stripped) in last


def test_attach_to_a_process_tree_records_every_process(tmp_path, libcuda, cudart12):
    """attach to a parent whose children make the CUDA calls (as vLLM's API server and its
    workers): each child's calls are recorded, one of them from a runtime it dlopens after
    profinfer attached."""
    from profinfer.exporters.trace_reader import read_trace
    program = _program("cuda_calls", "static")
    go, trace = tmp_path / "go", tmp_path / "t.pftrace"
    logs = [tmp_path / "a.jsonl", tmp_path / "b.jsonl"]
    script = (f"{program} --log {logs[0]} --libcuda {libcuda} --start-after {go} & "
              f"{program} --log {logs[1]} --runtime dlopen:{cudart12} --start-after {go} & wait")
    parent = subprocess.Popen(["bash", "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        pids = sorted(int(parent.stdout.readline().split()[1]) for _ in logs)
        _attach_then(parent, go, ["-o", str(trace)])
    finally:
        parent.kill()
    back = read_trace(trace)
    assert back.lost_events == 0
    assert {c.pid for c in back.cuda_calls if c.what != "registration"} == set(pids)
    for log in logs:
        entries = _log(log)
        pid = {d["tid"] for d in entries}.pop()       # one thread: its tid is its pid
        _compare(entries, [c for c in back.cuda_calls if c.pid == pid])
