#!/usr/bin/env bash
# Build the profinfer image here, with no registry: the base from Debian's archive
# (base-image.sh), then deploy/Containerfile, tagged with the name the Kubernetes manifest
# uses. Cached: when an image of that name carries the same content label (a hash of the
# files that go into it and of the base image), nothing is built. Prints the image's name.
#   deploy/build-image.sh            (CONTAINERS_CONF=deploy/containers.conf for podman run)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(dirname "$here")
. "$here/podman-env.sh"
name=${PROFINFER_IMAGE:-$(sed -n 's/^ *image: *\([^ ]*\).*/\1/p' "$here/kubernetes/profinfer.yaml" | head -1)}
base=$("$here/base-image.sh")
# what goes into the image: the build context (.containerignore), the Containerfile, the base
content=$(cd "$repo" && {
    podman image inspect --format '{{.Id}}' "$base"
    inputs=(pyproject.toml setup.py profinfer deploy/Containerfile .containerignore)
    if git rev-parse --git-dir >/dev/null 2>&1; then
        git ls-files -co --exclude-standard -- "${inputs[@]}"
    else
        find "${inputs[@]}" -type f
    fi | grep -v '__pycache__\|\.pyc$\|\.egg-info' | sort |
        while read -r f; do [ -f "$f" ] && printf '%s %s\n' "$(sha256sum < "$f" | cut -c1-64)" "$f"; done
} | sha256sum | cut -c1-16)
have=$(podman image inspect --format '{{index .Labels "profinfer.content"}}' "$name" 2>/dev/null || true)
if [ "$have" != "$content" ]; then
    echo "deploy: building $name (content $content)" >&2
    # pip in the build trusts what this machine trusts (a site's TLS proxy): its CA bundle,
    # mounted for the RUN steps only
    tls=()
    if [ -f /etc/ssl/certs/ca-certificates.crt ]; then
        conf=$(mktemp)
        trap 'rm -f "$conf"' EXIT
        printf '[global]\ncert = /etc/ssl/host-ca-certificates.crt\n' > "$conf"
        tls=(--volume /etc/ssl/certs/ca-certificates.crt:/etc/ssl/host-ca-certificates.crt:ro
             --volume "$conf:/etc/pip.conf:ro")
    fi
    # the build stage tagged first: its layers (the compiler, the dependencies) are then no
    # dangling images for the prune below, and the next build of a source change reuses them
    podman build --pull=never --layers "${tls[@]}" --target build \
        -t localhost/profinfer-build-stage:latest -f "$here/Containerfile" "$repo" >&2
    podman build --pull=never --layers "${tls[@]}" --label "profinfer.content=$content" \
        -t "$name" -f "$here/Containerfile" "$repo" >&2
    podman image prune -f >/dev/null 2>&1 || true     # the replaced image's layers
fi
echo "$name"
