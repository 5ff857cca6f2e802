#!/usr/bin/env bash
# The README's first command on a fresh Debian 12 with no CUDA at all: `./setup.sh &&
# .venv/bin/profinfer demo` in a container made from the debootstrap base (deploy/base-image.sh)
# with a copy of this working tree (tracked and untracked files, no venv, no cache). The
# container is privileged with the host's pids: the demo loads BPF programs, whose pids are
# the host's. Not part of the tests (it takes 15-30 minutes on 2 cores).
#   bench/fresh_setup.sh [LOG]        prints the wall time and the result; log in LOG
# What the container takes from this machine is its site configuration only: apt sources (in
# the base image), the CA bundle a TLS proxy may need (SSL_CERT_FILE, PIP_CERT), and pip's
# sources as the environment gives them (PIP_INDEX_URL, PIP_EXTRA_INDEX_URL, PIP_FIND_LINKS;
# local directories mounted read-only): vLLM's CPU torch (torch==2.13.0+cpu) is not on PyPI,
# and pip finds it only where the site says (PyTorch's CPU wheel index, or local wheels).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(dirname "$here")
log=${1:-/tmp/profinfer-fresh-setup.log}
base=$("$repo/deploy/base-image.sh")
export CONTAINERS_CONF="${CONTAINERS_CONF:-$repo/deploy/containers.conf}"
copy=$(mktemp -d /var/tmp/profinfer-fresh.XXXXXX)
trap 'rm -rf "$copy"' EXIT
(cd "$repo" && git ls-files -co --exclude-standard -z | xargs -0 tar -c --no-recursion) | tar -x -C "$copy"
ca=()
if [ -f /etc/ssl/certs/ca-certificates.crt ]; then
    ca=(-v /etc/ssl/certs/ca-certificates.crt:/etc/ssl/site-ca.crt:ro
        -e SSL_CERT_FILE=/etc/ssl/site-ca.crt -e PIP_CERT=/etc/ssl/site-ca.crt)
fi
pipenv=()
for v in PIP_INDEX_URL PIP_EXTRA_INDEX_URL PIP_FIND_LINKS; do
    [ -n "${!v:-}" ] || continue
    pipenv+=(-e "$v=${!v}")
    for w in ${!v}; do
        d=${w#file://}
        if [ "${d:0:1}" = / ] && [ -d "$d" ]; then pipenv+=(-v "$d:$d:ro"); fi
    done
done
# a fresh machine installs Recommends and docs: the base image's slimming undone
script='rm -f /etc/apt/apt.conf.d/slim /etc/dpkg/dpkg.cfg.d/slim
        ! command -v nvcc && test ! -e /usr/local/cuda
        cd /src && ./setup.sh && .venv/bin/profinfer demo'
echo "fresh setup: $(date -u +%FT%TZ) in $base, log $log; ${pipenv[*]}" >&2
t0=$(date +%s)
rc=0
podman run --rm --privileged --pid host --network host "${ca[@]}" "${pipenv[@]}" -v "$copy:/src" "$base" \
    bash -c "$script" > "$log" 2>&1 || rc=$?
t1=$(date +%s)
echo "fresh setup + demo: exit $rc, $(( (t1 - t0) / 60 )) min $(( (t1 - t0) % 60 )) s wall"
exit "$rc"
