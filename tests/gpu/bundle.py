"""Make the gpu tier's bundle: everything tests/gpu needs on a GPU machine that has torch,
triton and numpy but no network, no clang and maybe no libbpf.

    python tests/gpu/bundle.py OUTDIR        # then, there: bash OUTDIR/run_gpu_tier.sh

OUTDIR gets (at most 60 MiB; the device runner carries 64 MiB of ignored files):
    wheels/    profinfer's wheel and its dependencies' (and pytest's), for CPython 3.12 on
               manylinux x86-64, less what the image has (numpy); scipy (35 MB) is the big
               one, kept: the cuda level's summary imports it (core.compare)
    bpf/       the prebuilt BPF objects of exactly that profinfer (PROFINFER_BPF_PREBUILT)
    lib/       Debian 12's libbpf.so.1 and libelf.so.1, used where the image has no libbpf
    tests/gpu/ the tests and their programs; pytest.ini (the `gpu` marker)
    run_gpu_tier.sh, MANIFEST.txt
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

LIMIT = 60 << 20
REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
IMAGE_HAS = {"numpy", "torch", "triton"}        # on the GPU image already: not bundled
PLATFORM = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
            "--platform", "manylinux_2_17_x86_64"]
SYSTEM_LIBS = ["/usr/lib/x86_64-linux-gnu/libbpf.so.1", "/usr/lib/x86_64-linux-gnu/libelf.so.1"]
PYTEST_INI = """[pytest]
markers =
    gpu: needs an NVIDIA GPU and torch (the gpu tier, tests/gpu/run_gpu_tier.sh)
"""


def pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "-q", "--disable-pip-version-check", *args], check=True)


def snapshot(stage: Path) -> None:
    """profinfer's source as it is now: the wheel and the BPF objects are both made from this
    copy, so the objects' content keys match the wheel's sources even while the tree changes."""
    shutil.copy2(REPO / "pyproject.toml", stage)
    shutil.copytree(REPO / "profinfer", stage / "profinfer",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.so", "*.o"))


def bpf_objects(stage: Path, dest: Path) -> list[str]:
    """Every BPF object (each program, both variants) of the staged profinfer: found in the
    cache by content, or built with clang here."""
    env = {**os.environ, "PYTHONPATH": str(stage)}       # run in stage: not the checkout's copy
    check = "import profinfer, sys; sys.exit(not profinfer.__file__.startswith(sys.argv[1]))"
    subprocess.run([sys.executable, "-c", check, str(stage)], env=env, cwd=stage, check=True)
    out = subprocess.run([sys.executable, "-m", "profinfer.core.ebpf.bpfobj"], env=env, cwd=stage, check=True,
                         capture_output=True, text=True).stdout.split()
    dest.mkdir()
    for path in out:
        shutil.copy2(path, dest / os.path.basename(path))
    return [os.path.basename(p) for p in out]


def glibc_needed(path: str) -> str:
    versions = {tuple(map(int, v.split(b"."))) for v in re.findall(rb"GLIBC_(\d+\.\d+)", Path(path).read_bytes())}
    return ".".join(map(str, max(versions))) if versions else "?"


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    out = Path(argv[0]).resolve()
    if out.exists() and any(out.iterdir()) and not (out / "MANIFEST.txt").exists():
        print(f"bundle: {out} is neither empty nor a bundle: not replacing it", file=sys.stderr)
        return 2
    shutil.rmtree(out, ignore_errors=True)
    wheels = out / "wheels"
    wheels.mkdir(parents=True)
    (out / "MANIFEST.txt").write_text("incomplete\n")      # a bundle, if a partial one: replaceable
    notes = []
    with tempfile.TemporaryDirectory() as tmp:
        stage = Path(tmp) / "profinfer-src"
        stage.mkdir()
        snapshot(stage)
        objects = bpf_objects(stage, out / "bpf")
        pip("wheel", "--no-deps", "-w", str(wheels), str(stage))
        deps = tomllib.loads((stage / "pyproject.toml").read_text())["project"]["dependencies"]
    pip("download", *PLATFORM, "-d", str(wheels), *deps, "pytest")
    for w in sorted(wheels.glob("*.whl")):
        if w.name.split("-")[0].lower().replace("_", "-") in IMAGE_HAS:
            w.unlink()
            notes.append(f"left out {w.name}: the image has it")
        elif not (w.name.endswith("-none-any.whl") or "manylinux" in w.name):
            raise SystemExit(f"bundle: {w.name} is neither pure Python nor manylinux")
    (out / "lib").mkdir()
    for lib in SYSTEM_LIBS:
        shutil.copyfile(os.path.realpath(lib), out / "lib" / os.path.basename(lib))
        notes.append(f"lib/{os.path.basename(lib)}: {os.path.realpath(lib)} from this Debian 12 "
                     f"machine, needs glibc >= {glibc_needed(lib)}")
    tests = out / "tests" / "gpu"
    shutil.copytree(HERE, tests, ignore=shutil.ignore_patterns("__pycache__", "bundle.py", "run_gpu_tier.sh"))
    shutil.copy2(HERE / "run_gpu_tier.sh", out / "run_gpu_tier.sh")
    (out / "pytest.ini").write_text(PYTEST_INI)
    files = sorted(p for p in out.rglob("*") if p.is_file() and p.name != "MANIFEST.txt")
    size = sum(p.stat().st_size for p in files)
    manifest = [f"profinfer gpu tier bundle: {size / (1 << 20):.1f} MiB, {len(files) + 1} files",
                f"BPF objects: {' '.join(objects)}", *notes, "",
                *(f"{p.stat().st_size:>10}  {p.relative_to(out)}" for p in files)]
    (out / "MANIFEST.txt").write_text("\n".join(manifest) + "\n")
    size += (out / "MANIFEST.txt").stat().st_size
    print(f"bundle: {out}: {size / (1 << 20):.1f} MiB ({size:,} bytes) in {len(files) + 1} files")
    if size > LIMIT:
        print(f"bundle: over the {LIMIT >> 20} MiB limit", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
