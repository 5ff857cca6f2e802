#!/usr/bin/env bash
# The image's size and start time: podman run (the manifest's securityContext: read-only root,
# only its capabilities, host pids, the cache and token volumes; no seccomp filter, as
# Kubernetes runs a pod that names none, where podman's default filter would refuse bpf() and
# perf_event_open() without CAP_SYS_ADMIN) until /healthz answers 200, polled every 20 ms;
# RUNS runs (default 5), each a fresh container.
#   bench/image_check.sh       prints the numbers bench/results.md records
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
image=$("$here/../deploy/build-image.sh")
export CONTAINERS_CONF="${CONTAINERS_CONF:-$here/../deploy/containers.conf}"
caps=$(python3 - "$here/../deploy/kubernetes/profinfer.yaml" <<'PY'
import re, sys
text = open(sys.argv[1]).read()
add = text.split("add:", 1)[1].split("resources:", 1)[0]
print(",".join(re.findall(r"^\s*- ([A-Z_]+)", add, re.M)))
PY
)
port=19464
size=$(podman image inspect --format '{{.Size}}' "$image")
times=()
for i in $(seq "${RUNS:-5}"); do
    t0=$(date +%s%N)
    cid=$(podman run -d --rm --security-opt seccomp=unconfined --network host --pid host --read-only --cap-drop ALL --cap-add "$caps" \
        --tmpfs /var/cache/profinfer --tmpfs /run/profinfer -v /sys/kernel/btf:/sys/kernel/btf:ro \
        "$image" daemon --listen "0.0.0.0:$port" --allow-remote --token-file /run/profinfer/token)
    code=000
    for _ in $(seq 1500); do
        code=$(curl -s -o /dev/null -w '%{http_code}' "localhost:$port/healthz" || true)
        [ "$code" = 200 ] && break
        sleep 0.02
    done
    t1=$(date +%s%N)
    podman stop -t 2 "$cid" >/dev/null
    [ "$code" = 200 ] || { echo "run $i: /healthz never answered 200" >&2; exit 1; }
    times+=("$(( (t1 - t0) / 1000000 ))")
done
sorted=$(printf '%s\n' "${times[@]}" | sort -n | tr '\n' ' ')
echo "image $image: $((size / 1000000)) MB (podman image inspect .Size)"
echo "podman run to /healthz 200, ms (${#times[@]} runs, sorted): $sorted"
