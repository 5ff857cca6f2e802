#!/usr/bin/env bash
# The cuda level on a real GPU, in one command (<= 10 minutes on one GPU): build llama.cpp's
# CUDA backend for one architecture, generate a short text unprofiled and then under
# `profinfer record --levels token,graph,op,cuda`, and check that kernel launches were
# recorded, that CUDA graph launches were counted (llama.cpp replays a graph per decode
# token), and how much profiling slowed decoding (llama.cpp's own llama_perf eval rate).
# Then the daemon's GPU metrics against `nvidia-smi --query-gpu` (bench/gpu_metrics_check.py):
# memory used and total, utilization (within UTIL_TOL points), idle and under a decode load,
# and the load's own GPU memory against `nvidia-smi --query-compute-apps`.
#
#   bench/gpu_check.sh            # CUDA_ARCH=90 (Hopper); e.g. CUDA_ARCH=80 for Ampere
#
# Needs: the project set up (./setup.sh: the venv, the llama.cpp source and models in the
# cache), the CUDA toolkit (nvcc), a GPU and its driver. Exit 0 when every check passes.
set -euo pipefail
cd "$(dirname "$0")/.."
ARCH="${CUDA_ARCH:-90}"
PY=.venv/bin/python
TOKENS="${TOKENS:-64}"
OUT="${OUT:-/tmp/profinfer-gpu-check}"
mkdir -p "$OUT"
ROOT=$($PY -c 'from profinfer.engines.llamacpp import workload as w; print(w.ensure_llama_build().parent)')
MODEL=$($PY -c 'from profinfer.engines.llamacpp import workload as w; print(w.ensure_model("llama-1.5b"))')
BUILD="$ROOT/build-cuda-sm$ARCH"
if [ ! -x "$BUILD/bin/llama-completion" ]; then
    cmake -S "$ROOT/src" -B "$BUILD" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DBUILD_SHARED_LIBS=ON \
        -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="$ARCH" -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF >"$OUT/cmake.log"
    cmake --build "$BUILD" -j"$(nproc)" --target llama-completion >"$OUT/build.log"
fi
CMD=("$BUILD/bin/llama-completion" -m "$MODEL" -p "The quick brown fox jumps over the lazy dog" \
     -n "$TOKENS" -ngl 99 --temp 0 -no-cnv)
export LD_LIBRARY_PATH="$BUILD/bin:${LD_LIBRARY_PATH:-}"
"${CMD[@]}" >"$OUT/plain.out" 2>"$OUT/plain.err"
$PY -m profinfer.cli record --levels token,graph,op,cuda --quiet --json "$OUT/profiled.json" \
    -o "$OUT/profiled.pftrace" -- "${CMD[@]}" >"$OUT/profiled.out" 2>"$OUT/profiled.err"
rc=0
$PY - "$OUT" <<'PY' || rc=1
import json, re, sys
out = sys.argv[1]
rate = lambda f: float(re.search(r"(?:llama_perf_context_print|common_perf_print):\s+eval time =.*?([\d.]+) tokens per second",
                                 open(f"{out}/{f}").read()).group(1))
plain, profiled = rate("plain.err"), rate("profiled.err")
s = json.load(open(f"{out}/profiled.json"))
cuda = s.get("cuda", {})
checks = {
    "kernel launches recorded": cuda.get("launches", 0) + cuda.get("captured_launches", 0) > 0,
    "CUDA graph launches counted": cuda.get("graph_launches", 0) > 0,
    "no events lost": s.get("lost_events", 1) == 0,
    # llama.cpp launches through the runtime only: a driver launch the runtime makes for it
    # must not be counted again (the nested-call check; cuda_nested counts those skipped)
    "no launch counted twice": not any(api.startswith("cuLaunch") for api in cuda.get("calls", {})),
}
print(f"driver launches made by the runtime, skipped: {s.get('meta', {}).get('cuda_nested', '?')}")
print(f"decode: {plain:.1f} tok/s unprofiled, {profiled:.1f} profiled: slowdown {plain / profiled - 1:+.1%}")
print(f"launches {cuda.get('launches')}, captured {cuda.get('captured_launches')}, "
      f"graph launches {cuda.get('graph_launches')}, per step {cuda.get('launches_per_step')}")
for name, ok in checks.items():
    print(("PASS " if ok else "FAIL ") + name)
sys.exit(0 if all(checks.values()) else 1)
PY
LOAD=("$BUILD/bin/llama-completion" -m "$MODEL" -p "The quick brown fox jumps over the lazy dog" \
      -n 8000 -c 8192 --ignore-eos -ngl 99 --temp 0 -no-cnv)
$PY bench/gpu_metrics_check.py --util-tol "${UTIL_TOL:-10}" --log "$OUT/daemon.log" -- "${LOAD[@]}" || rc=1
exit $rc
