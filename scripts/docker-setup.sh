#!/usr/bin/env bash
# Everything the docker backend and its tests need, on a Debian 12 machine as
# root, with no container registry: the Docker engine from Debian's packages,
# a running dockerd, a Debian base image built with debootstrap, the test task
# images and the executor injector image.
#
#   scripts/docker-setup.sh            # idempotent; a second run takes seconds
#
# Images built (all local, none pulled):
#   orchard-base:bookworm       debootstrap'd Debian (python3, git, bash)
#   orchard-executor:latest     Dockerfile.executor on that base (also :VERSION)
#   orchard-test/busybox        a static busybox and nothing else
#   orchard-test/swe            Debian + bash, git, python3 and a repo at /testbed
#   orchard-test/toys           the same, with the toy tasks' repositories under /toys (examples/tasks/swe-mini.jsonl)
#   orchard-test/noshell        a few coreutils programs, no shell at all
#   orchard-test/nonroot        busybox as an unprivileged user with nowhere to write
#   orchard-test/browser        Chromium, Xvfb, openbox, xterm, xdotool, scrot and Playwright (images/tasks/browser);
#                               built again only when its files or the base change
#   orchard-tools:latest        agent-harness CLIs with their runtimes (images/tools), for tools=[...]
#
# It also makes this host refuse connections that network=False sandboxes open
# to it (an iptables chain, ORCHARD-INPUT: see "sandbox firewall" below).
#
# Caches live outside the repository, under $ORCHARD_CACHE (/var/cache/orchard):
# the base root filesystem, the executor's and the browser image's wheels and the
# tools bundle (with its downloads). dockerd logs to $ORCHARD_CACHE/dockerd.log;
# its pidfile is /var/run/docker.pid.
set -euo pipefail
cd "$(dirname "$0")/.."

CACHE=${ORCHARD_CACHE:-/var/cache/orchard}
export ORCHARD_CACHE=$CACHE
PY=${PYTHON:-python3}
BASE=orchard-base:bookworm
VERSION=$(sed -n 's/^__version__ = "\(.*\)"/\1/p' executor/orchard_executor/__init__.py)
mkdir -p "$CACHE"

step() { printf '== %s (%ss)\n' "$1" "$SECONDS"; }

# wheels_for REQUIREMENTS DIR: binary wheels for the base image's CPython, downloaded once
# into $CACHE/DIR/<hash of the requirements>; prints that directory.
wheels_for() {
  local dir
  dir=$CACHE/$2/$(sha256sum "$1" | cut -c1-16)
  if [ ! -f "$dir/.complete" ]; then
    rm -rf "$dir" && mkdir -p "$dir" || return 1
    "$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
      --python-version 3.11 --implementation cp --abi cp311 \
      --platform manylinux_2_36_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 \
      -d "$dir" -r "$1" >&2 || return 1 # errexit does not reach into $(...)
    touch "$dir/.complete"
  fi
  echo "$dir"
}

step "packages"
missing=()
for pkg in docker.io debootstrap busybox-static patchelf gcc libc6-dev; do
  dpkg-query -W -f '${Status}' "$pkg" 2>/dev/null | grep -q "ok installed" || missing+=("$pkg")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

step "dockerd"
# Debian's docker CLI: another `docker` earlier on PATH may be too new for this engine's API.
DOCKER=/usr/bin/docker
if ! "$DOCKER" info >/dev/null 2>&1; then
  pidfile=/var/run/docker.pid
  # A pid counts only if its process is alive: a killed daemon can linger as a
  # zombie here (nothing may reap it), and dockerd would wait on it forever.
  alive() {
    local pid state
    pid=$(cat "$1" 2>/dev/null) || return 1
    state=$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null) || return 1
    [ -n "$state" ] && [ "$state" != Z ]
  }
  if alive "$pidfile"; then
    echo "dockerd $(cat "$pidfile") is running but not answering yet"
  else
    rm -f "$pidfile"
    alive /var/run/docker/containerd/containerd.pid || rm -f /var/run/docker/containerd/containerd.pid
    # No systemd here: start it in its own session so it outlives this script.
    setsid dockerd --pidfile "$pidfile" >>"$CACHE/dockerd.log" 2>&1 </dev/null &
  fi
  for _ in $(seq 120); do
    "$DOCKER" info >/dev/null 2>&1 && break
    sleep 0.5
  done
  if ! "$DOCKER" info >/dev/null 2>&1; then
    echo "dockerd did not come up; the end of $CACHE/dockerd.log:" >&2
    tail -30 "$CACHE/dockerd.log" >&2
    exit 1
  fi
fi
echo "engine $("$DOCKER" version -f '{{.Server.Version}}') at /var/run/docker.sock"

step "sandbox firewall"
# Sandboxes with network=False join Orchard's internal network (bridge orchard-int),
# which has no route out; but they can still reach this host at the bridge's own
# address, where every service listening on all interfaces answers. Refuse what
# they start there; replies to the client's own connections (to the executors)
# pass. Rules by interface name hold before the bridge exists.
IPT="iptables -w"
$IPT -L ORCHARD-INPUT -n >/dev/null 2>&1 || $IPT -N ORCHARD-INPUT
rule() { $IPT -C ORCHARD-INPUT "$@" 2>/dev/null || $IPT -A ORCHARD-INPUT "$@"; }
rule -i orchard-int -m conntrack --ctstate ESTABLISHED,RELATED -j RETURN
rule -i orchard-int -j REJECT
$IPT -C INPUT -j ORCHARD-INPUT 2>/dev/null || $IPT -I INPUT 1 -j ORCHARD-INPUT

step "base image"
PATH=/usr/bin:$PATH images/base/build-base.sh "$BASE"

step "test task images"
# A static busybox: Debian's busybox-static package installs it as /bin/busybox.
for name in busybox nonroot; do
  tar -c -C "images/tasks/$name" Dockerfile -C /bin busybox |
    "$DOCKER" build -q --network none -t "orchard-test/$name:latest" - >/dev/null
done
"$DOCKER" build -q --network none --build-arg BASE="$BASE" -t orchard-test/noshell:latest images/tasks/noshell >/dev/null
"$DOCKER" build -q --network none --build-arg BASE="$BASE" -t orchard-test/swe:latest images/tasks/swe >/dev/null
"$DOCKER" build -q --network none --build-arg BASE="$BASE" -t orchard-test/toys:latest images/tasks/toys >/dev/null

step "browser image"
# Chromium, an X desktop and Playwright (images/tasks/browser), the packages from
# Debian's mirror in the build, Playwright's wheels downloaded here (the build's
# network does not trust PyPI's certificate). 1.2 GB and about 100 s to build
# cold, so built again only when its files or the base change.
browser_key=$({ cat images/tasks/browser/Dockerfile images/tasks/browser/requirements.txt
  "$DOCKER" image inspect -f '{{.Id}}' "$BASE"; } | sha256sum | cut -c1-16)
if [ "$("$DOCKER" image inspect -f '{{ index .Config.Labels "orchard.browser.key" }}' orchard-test/browser:latest 2>/dev/null)" != "$browser_key" ]; then
  bwheels=$(wheels_for images/tasks/browser/requirements.txt browser-wheels)
  tar -c -C images/tasks/browser Dockerfile requirements.txt \
    -C "$bwheels" --transform='s|^[^/]*\.whl$|wheels/&|' $(cd "$bwheels" && ls -- *.whl) |
    "$DOCKER" build -q --build-arg BASE="$BASE" --label "orchard.browser.key=$browser_key" \
      -t orchard-test/browser:latest - >/dev/null
fi
size=$("$DOCKER" image inspect -f '{{.Size}}' orchard-test/browser:latest)
echo "orchard-test/browser:latest: $((size / 1000000)) MB"

step "executor wheels"
# Downloaded here, where the package index is reachable, and passed in the build
# context, so the image build itself needs no network.
wheels=$(wheels_for images/executor/requirements.txt wheels)

step "injector image"
# The tests refuse an injector image built from other executor sources than the tree's.
source=$("$PY" images/executor/build_bundle.py --source-hash executor/orchard_executor)
# The context: what Dockerfile.executor copies, plus the wheels under images/executor/wheels/.
tar -c --exclude=__pycache__ --exclude='*.pyc' Dockerfile.executor images/executor executor/orchard_executor \
  -C "$wheels" --transform='s|^[^/]*\.whl$|images/executor/wheels/&|' $(cd "$wheels" && ls -- *.whl) |
  "$DOCKER" build -q --network none --build-arg BASE="$BASE" -f Dockerfile.executor \
    --label "orchard.executor.source=$source" -t "orchard-executor:$VERSION" -t orchard-executor:latest - >/dev/null
size=$("$DOCKER" image inspect -f '{{.Size}}' orchard-executor:latest)
echo "orchard-executor:latest ($VERSION): $((size / 1000000)) MB"

step "tools image"
# The harness CLIs from the npm registry at pinned versions (images/tools/build_tools.py),
# built once per version of the build files and kept under $CACHE/tools.
tools_key=$(cat images/tools/build_tools.py images/tools/launcher.c images/tools/Dockerfile | sha256sum | cut -c1-16)
if [ "$("$DOCKER" image inspect -f '{{ index .Config.Labels "orchard.tools.key" }}' orchard-tools:latest 2>/dev/null)" != "$tools_key" ]; then
  ctx=$CACHE/tools/$tools_key
  mkdir -p "$CACHE/tools"
  find "$CACHE/tools" -mindepth 1 -maxdepth 1 ! -name "$tools_key" -exec rm -rf {} +
  if [ ! -f "$ctx/.complete" ]; then
    rm -rf "$ctx"
    mkdir -p "$ctx/installer"
    "$PY" images/tools/build_tools.py --out "$ctx/bundle" --cache "$CACHE/tools-download" --sizes "$ctx/sizes.json"
    cp /bin/busybox "$ctx/installer/busybox"
    cp images/tools/Dockerfile "$ctx/Dockerfile"
    touch "$ctx/.complete"
  fi
  "$DOCKER" build -q --network none --label "orchard.tools.key=$tools_key" -t orchard-tools:latest "$ctx" >/dev/null
fi
size=$("$DOCKER" image inspect -f '{{.Size}}' orchard-tools:latest)
echo "orchard-tools:latest: $((size / 1000000)) MB"

step "done"
