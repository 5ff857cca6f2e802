#!/usr/bin/env bash
# A minimal Debian 12 base image made without a registry: debootstrap (minbase) from this
# machine's own Debian archive (its apt sources, read by debian_archive.py), slimmed like
# Debian's -slim images (no docs, man pages or locales, now or in later installs), imported
# into podman's local storage under the name deploy/Containerfile's FROM uses.
#   deploy/base-image.sh [NAME]      prints the name; does nothing when the image exists
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
. "$here/podman-env.sh"
name=${1:-$(sed -n 's/^FROM \([^ ]*\) AS build.*/\1/p' "$here/Containerfile")}
if podman image exists "$name"; then
    echo "$name"
    exit 0
fi
uri=$(python3 "$here/debian_archive.py" uri)
suite=$(python3 "$here/debian_archive.py" suite)
keyring=$(python3 "$here/debian_archive.py" keyring)
rootfs=$(mktemp -d /var/tmp/profinfer-base.XXXXXX)
trap 'rm -rf "$rootfs"' EXIT
echo "deploy: debootstrap $suite into $rootfs" >&2
debootstrap --variant=minbase ${keyring:+--keyring="$keyring"} "$suite" "$rootfs" "$uri" >&2
# apt in the image reads the same archive as this machine (with its key, where it is a file)
rm -f "$rootfs/etc/apt/sources.list"
python3 "$here/debian_archive.py" image-sources > "$rootfs/etc/apt/sources.list.d/debian.sources"
grep '^Signed-By: /' "$rootfs/etc/apt/sources.list.d/debian.sources" | cut -d' ' -f2 | sort -u |
    while read -r key; do
        [ -e "$rootfs$key" ] || install -D -m 0644 "$key" "$rootfs$key"
    done
# slim: what a container does not read, now and in every later apt-get install
cat > "$rootfs/etc/dpkg/dpkg.cfg.d/slim" <<'SLIM'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
path-exclude /usr/share/lintian/*
SLIM
cat > "$rootfs/etc/apt/apt.conf.d/slim" <<'SLIM'
APT::Install-Recommends "false";
APT::Install-Suggests "false";
Acquire::Languages "none";
DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/*.bin || true"; };
SLIM
find "$rootfs/usr/share/doc" -mindepth 2 ! -name copyright ! -type d -delete
find "$rootfs/usr/share/doc" -mindepth 1 -type d -empty -delete
rm -rf "$rootfs"/usr/share/{man,info,locale,lintian}/* "$rootfs"/var/cache/apt/*.bin "$rootfs"/var/cache/apt/archives/*.deb \
       "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/log/*.log "$rootfs"/var/cache/debconf/*-old
: > "$rootfs/etc/hostname"
tar --numeric-owner -C "$rootfs" -c . |
    podman import --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' --change 'CMD ["/bin/bash"]' --message "debootstrap $suite (minbase)" - "$name" >&2
echo "$name"
