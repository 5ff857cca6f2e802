"""The gpu tier: profinfer's cuda level, attached by `profinfer record --levels cuda` to small
torch programs on a real GPU, against truths from outside profinfer: what torch.profiler
(CUPTI) saw, what the program knows it did (calls made, tensor sizes copied), what torch's
caching allocator says of its memory, and what nvidia-smi says beside profinfer's NVML sampler.

Each program (programs/) writes its own truth as JSON; each is recorded once per module and
the tests read the same `--json` summary that `profinfer record` writes (its "cuda" section).
Run by tests/gpu/run_gpu_tier.sh on a machine with a GPU; elsewhere every test skips.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

PROGRAMS = Path(__file__).parent / "programs"
RECORD_TIMEOUT_S = 180      # torch's start under the probes; the tier has 8 minutes in all


def _no_gpu() -> str | None:
    try:
        import torch
    except ImportError:
        return "no GPU here: torch is not installed"
    if not torch.cuda.is_available():
        return "no GPU here: torch.cuda.is_available() is False"
    return None


NO_GPU = _no_gpu()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(NO_GPU is not None, reason=NO_GPU or "")]


# ---- recording the programs (once each; a failure is kept, not recorded again) ----

_runs: dict[tuple, tuple[dict, dict, Path] | str] = {}


def _recorded(tmp_root: Path, program: str, *args: str, trace: bool = False) -> tuple[dict, dict, Path]:
    """(the summary's "cuda" section, the program's truth, its folder) of one recorded run."""
    key = (program, args, trace)
    if key not in _runs:
        out = tmp_root / "-".join((program, *(a.strip("-") for a in args)))
        out.mkdir()
        cmd = [sys.executable, "-m", "profinfer.cli", "record", "--levels", "cuda", "--quiet",
               "--json", str(out / "summary.json"), *(["-o", str(out / "t.pftrace")] if trace else []),
               "--", sys.executable, str(PROGRAMS / f"{program}.py"), str(out / "truth.json"), *args]
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=RECORD_TIMEOUT_S)
            if p.returncode != 0 or not (out / "truth.json").exists():
                raise AssertionError(f"{' '.join(cmd)} exited {p.returncode}:\n{p.stderr[-3000:]}")
            summary = json.loads((out / "summary.json").read_text())
            _runs[key] = (summary.get("cuda", {}), json.loads((out / "truth.json").read_text()), out)
        except (AssertionError, subprocess.TimeoutExpired, OSError, ValueError) as e:
            _runs[key] = f"recording {program} failed: {e}"
    got = _runs[key]
    if isinstance(got, str):
        pytest.fail(got)
    return got


@pytest.fixture(scope="module")
def record(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu")
    return lambda program, *args, trace=False: _recorded(root, program, *args, trace=trace)


# ---- kernel names: profinfer demangles with cxxfilt, CUPTI with its own demangler ----

def _norm(name: str) -> str:
    """A kernel name with the demanglers' differences taken out: spacing, a leading "void",
    integer literal suffixes (3ul), how an anonymous namespace is spelled."""
    n = re.sub(r"\s+", "", name)
    n = n.removeprefix("void")
    n = re.sub(r"\(anonymousnamespace\)|`anonymousnamespace'", "anon", n)
    return re.sub(r"\b(\d+)(?:ull|ul|u|ll|l)\b", r"\1", n, flags=re.I)


def _family(name: str) -> str:
    """The kernel's function without template arguments and parameters
    (at::native::vectorized_elementwise_kernel)."""
    return re.split(r"[<(]", _norm(name), maxsplit=1)[0]


def _by(key, counts: dict[str, int]) -> Counter:
    out = Counter()
    for name, n in counts.items():
        if n:
            out[key(name)] += n
    return out


def _launched(cuda: dict, key=_norm, field: str = "launches") -> Counter:
    """profinfer's launches (or captured launches) per kernel, named by `key`."""
    return _by(key, {name: k[field] for name, k in cuda.get("kernels", {}).items()})


def _diff(want: Counter, got: Counter) -> str:
    return f"CUPTI only: {dict(want - got)}; profinfer only: {dict(got - want)}"


# ---- NVML (the daemon's sampler) against nvidia-smi ----

def _smi(*args: str) -> list[list[str]]:
    p = subprocess.run(["nvidia-smi", *args, "--format=csv,noheader,nounits"],
                       capture_output=True, text=True, timeout=30)
    assert p.returncode == 0, p.stdout + p.stderr
    return [[v.strip() for v in line.split(",")] for line in p.stdout.splitlines() if line.strip()]


def _number(v: str) -> float | None:
    try:
        return float(v)
    except ValueError:       # [N/A], [Not Supported]
        return None


def test_nvml_sample_equals_nvidia_smi():
    if shutil.which("nvidia-smi") is None:
        pytest.skip("nvidia-smi is not on PATH")
    from profinfer.daemon.export import nvml
    holder = subprocess.Popen([sys.executable, str(PROGRAMS / "hold_memory.py"), "1024"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().startswith("ready "), "the memory holder did not start"
        time.sleep(1)
        state, before, problems = nvml.gpu_sample()
        assert state == "on" and not problems, (state, problems)
        fields = "uuid,memory.total,memory.used,memory.reserved,power.draw,utilization.gpu"
        try:
            rows = _smi(f"--query-gpu={fields}")
        except AssertionError:        # a driver without memory.reserved
            rows = [[r[0], r[1], r[2], "0", *r[3:]] for r in
                    _smi("--query-gpu=" + fields.replace("memory.reserved,", ""))]
        apps = _smi("--query-compute-apps=gpu_uuid,pid,used_memory")
        _, after, _ = nvml.gpu_sample()
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    MiB = 1 << 20
    smi = {r[0]: r for r in rows}
    assert {g["uuid"] for g in before} == set(smi)
    for g, g2 in zip(before, after):
        uuid, total, used, reserved, power, util = smi[g["uuid"]]
        assert g["total"] // MiB == int(total)
        # NVML's v2 figure leaves the driver's reservation out; nvidia-smi's may include it
        used_mib = g["used"] / MiB
        assert min(abs(used_mib - float(used)), abs(used_mib + float(reserved) - float(used))) <= 16, \
            (used_mib, used, reserved)
        if _number(power) is not None and g["power"] is not None:
            lo, hi = sorted((g["power"], g2["power"]))
            assert lo - max(15, 0.1 * lo) <= float(power) <= hi + max(15, 0.1 * hi), (g["power"], power)
        if _number(util) is not None and g["util"] is not None:
            assert abs(g["util"] * 100 - float(util)) <= 30, (g["util"], util)
    nvml_procs = {(g["uuid"], pid): b for g in before for pid, b in g["processes"]}
    smi_procs = {(r[0], int(r[1])): float(r[2]) for r in apps if _number(r[2]) is not None}
    assert set(nvml_procs) == set(smi_procs)
    for k, b in nvml_procs.items():
        assert abs(b / MiB - smi_procs[k]) <= 2, (k, b, smi_procs[k])
    if nvml_procs:        # in a container without the host's PID namespace both may list none
        assert max(nvml_procs.values()) >= 1024 * MiB


# ---- eager mode ----

def test_eager_launches_equal_cupti_kernels(record):
    cuda, truth, _ = record("eager")
    want = sum(truth["cupti"]["kernels"].values())
    assert want >= 4 * truth["iterations"]      # add, relu, mul, sum each time
    assert cuda["launches"] == want
    assert cuda["captured_launches"] == 0 and cuda["graph_launches"] == 0


def test_eager_kernels_by_family_equal_cupti(record):
    cuda, truth, _ = record("eager")
    want, got = _by(_family, truth["cupti"]["kernels"]), _launched(cuda, _family)
    assert got == want, _diff(want, got)


def test_eager_kernels_named_as_cupti_names_them(record):
    cuda, truth, _ = record("eager")
    unnamed = [k for k in cuda["kernels"] if k.startswith(("kernel@", "CUfunction@"))]
    assert not unnamed, f"kernels profinfer could not name: {unnamed}"
    want, got = _by(_norm, truth["cupti"]["kernels"]), _launched(cuda)
    assert got == want, _diff(want, got)


# ---- CUDA graphs ----

def test_graph_launches_equal_replays(record):
    cuda, truth, _ = record("graphs")
    assert truth["graph_launch_calls"] == truth["replays"], "CUPTI's cudaGraphLaunch calls are not the replays"
    assert cuda["graph_launches"] == truth["replays"]
    assert list(cuda["graph_launches_by_exec"].values()) == [truth["replays"]]


def test_graph_capture_holds_one_eager_call(record):
    cuda, truth, _ = record("graphs")
    want, got = _by(_family, truth["one_call"]), _launched(cuda, _family, "captured")
    assert cuda["captured_launches"] == sum(truth["one_call"].values()), _diff(want, got)
    assert cuda["launches"] == truth["eager_launches"]
    assert got == want, _diff(want, got)


# ---- Triton (driver API launches) ----

def _triton_needs_a_compiler() -> None:
    # Triton builds its launcher with the host's C compiler the first time
    if not any(shutil.which(c) for c in ("cc", "gcc", "clang")):
        pytest.skip("Triton needs a C compiler (cc, gcc or clang) to build its launcher: none here")


def test_triton_launches_counted(record):
    _triton_needs_a_compiler()
    cuda, truth, _ = record("triton_add")
    assert truth["cupti_launches"] == truth["calls"]
    driver = sum(v["calls"] for api, v in cuda["calls"].items() if api.startswith("cuLaunch"))
    assert driver == truth["calls"], f"driver-API launches {driver}, the program made {truth['calls']}: {cuda['calls']}"


def test_triton_kernel_named(record):
    _triton_needs_a_compiler()
    cuda, truth, _ = record("triton_add")
    named = {k: v["launches"] for k, v in cuda["kernels"].items() if "pi_add_kernel" in k}
    assert sum(named.values()) == truth["calls"], f"named {named}; every kernel: {list(cuda['kernels'])}"
    configs = [c for k in named for c in cuda["kernels"][k]["configs"]]
    assert any(f"grid ({truth['grid'][0]}, 1, 1)" in c for c in configs), configs


# ---- copies ----

def test_copy_bytes_equal_tensor_sizes(record):
    cuda, truth, _ = record("copies")
    copies = {k: v for k, v in cuda["copies"].items() if k != "memset"}
    got = {k: {"calls": v["calls"], "bytes": v["bytes"]} for k, v in copies.items()}
    assert got == truth["copies"], f"profinfer {got}; the program {truth['copies']}"
    assert truth["cupti"]["copies"] == truth["copies"], "CUPTI's copies are not the program's"


# ---- device memory ----

def test_device_memory_equals_torch_allocator(record):
    """Each segment of torch's caching allocator is one cudaMalloc: the cuda level's live
    device memory is torch's reserved memory (which holds memory_allocated's tensors)."""
    from profinfer.exporters.trace_reader import read_trace
    cuda, truth, out = record("memory", trace=True)
    m = cuda["memory"]
    assert m["failed"] == 0
    assert m["device_peak_bytes"] == truth["max_memory_reserved"]
    assert m["device_live_bytes_at_end"] == truth["memory_reserved"]
    assert truth["memory_allocated"] <= m["device_live_bytes_at_end"]
    calls = [c for c in read_trace(out / "t.pftrace").cuda_calls
             if c.what == "memory" and c.copy_kind == "device" and c.ret == 0]
    mallocs = [c for c in calls if c.api.startswith("cudaMalloc")]
    frees = [c for c in calls if c.api.startswith("cudaFree") and c.ptr]   # cudaFree(0) frees nothing
    assert len(mallocs) == truth["segments_allocated"]
    assert sum(c.bytes for c in mallocs) == truth["reserved_bytes_allocated"]
    assert len(frees) == truth["segments_freed"]


# ---- cuBLAS (last: the likeliest to find something, and the least needed by the rest) ----

def test_matmul_launches_equal_cupti_kernels(record):
    """cuBLAS's GEMMs beside torch's own kernels: launched from cuBLAS's libraries."""
    cuda, truth, _ = record("eager", "--matmul")
    want, got = _by(_family, truth["cupti"]["kernels"]), _launched(cuda, _family)
    assert cuda["launches"] == sum(want.values()), _diff(want, got)     # every launch seen...
    assert got == want, _diff(want, got)                                # ...and named
