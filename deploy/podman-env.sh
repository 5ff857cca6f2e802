# Sourced by the image scripts: Debian's podman, buildah, runc and debootstrap (installed when
# missing), and podman's settings for this kind of host (containers.conf: runc, ulimits).
_deploy=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
export CONTAINERS_CONF="${CONTAINERS_CONF:-$_deploy/containers.conf}"
_missing=()
for _p in podman buildah runc catatonit debootstrap containernetworking-plugins; do
    dpkg -s "$_p" >/dev/null 2>&1 || _missing+=("$_p")
done
if [ ${#_missing[@]} -gt 0 ]; then
    echo "deploy: installing ${_missing[*]}" >&2
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${_missing[@]}" >/dev/null
fi
