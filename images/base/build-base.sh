#!/usr/bin/env bash
# Build the local Debian base image without a registry: debootstrap a minimal
# bookworm (plus CPython, which the injector build needs, and git and bash,
# which the SWE-style test image needs) and `docker import` it.
#
#   images/base/build-base.sh [TAG]        # default TAG: orchard-base:bookworm
#
# With a registry, use debian:bookworm-slim instead (Dockerfile.executor's
# default BASE). The root filesystem is cached as a tarball under
# $ORCHARD_CACHE (default /var/cache/orchard), keyed by suite, packages and
# this script, so a rerun only imports it (or does nothing if the image is
# already there). Needs root and debootstrap.
set -euo pipefail

TAG=${1:-orchard-base:bookworm}
SUITE=bookworm
PACKAGES=python3,git,ca-certificates
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
CACHE=${ORCHARD_CACHE:-/var/cache/orchard}/base

key=$( { echo "$SUITE $PACKAGES"; cat "$0"; } | sha256sum | cut -c1-16)
if [ "$(docker image inspect -f '{{ index .Config.Labels "orchard.base.key" }}' "$TAG" 2>/dev/null)" = "$key" ]; then
  echo "base image $TAG is up to date ($key)"
  exit 0
fi

mkdir -p "$CACHE"
tarball=$CACHE/$SUITE-$key.tar
if [ ! -s "$tarball" ]; then
  rootfs=$(mktemp -d "$CACHE/rootfs.XXXXXX")
  trap 'rm -rf "$rootfs"' EXIT
  echo "debootstrap $SUITE ($PACKAGES) from $MIRROR: a minute or two"
  debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$rootfs" "$MIRROR" >"$CACHE/debootstrap.log" 2>&1 ||
    { tail -20 "$CACHE/debootstrap.log" >&2; exit 1; }
  # What an image does not need: package caches, docs, man pages, locales.
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/* \
    "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/* "$rootfs"/usr/share/info/* \
    "$rootfs"/usr/share/locale/* "$rootfs"/var/log/*.log "$rootfs"/var/cache/debconf/*-old
  # The image's apt talks to the same mirror, for whoever builds on it.
  echo "deb $MIRROR $SUITE main" >"$rootfs/etc/apt/sources.list"
  tar -C "$rootfs" --numeric-owner -cf "$tarball.tmp" .
  mv "$tarball.tmp" "$tarball"
  rm -rf "$rootfs"
  trap - EXIT
  # Older tarballs are for other keys: keep only this one.
  find "$CACHE" -maxdepth 1 -name "$SUITE-*.tar" ! -name "$(basename "$tarball")" -delete
fi
docker import \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV LANG=C.UTF-8' \
  --change 'CMD ["/bin/bash"]' \
  --change "LABEL orchard.base.key=$key" \
  "$tarball" "$TAG" >/dev/null
echo "imported base image $TAG ($key)"
