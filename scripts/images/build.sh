#!/bin/bash
# Build the project's container images OFFLINE, cached by a hash of their inputs (outside the repo):
#   ghcr.io/sampler-operator/operator:<appVersion>     images/operator/Dockerfile
#   ghcr.io/sampler-operator/sampler-cpu:<appVersion>  images/sampler-cpu/Dockerfile
# (images/sampler-gpu/Dockerfile needs vLLM's serving image from a registry: linted, not built, here.)
#
# How, with no registry and no base image to pull:
#   1. base: Debian bookworm's own python3 (3.11, the wheels' ABI) via `debootstrap --variant=minbase`,
#      a root-fs tarball `docker import`ed as sampler-operator/python-base:<hash> (like scripts/k8s/make-images.sh);
#   (each image's sources, copied into its build context: images/<name>/sources)
#   2. wheels: a wheelhouse per image filled on the host by `pip download` (`pip wheel` for an sdist) from the
#      image's requirements.lock (scripts/images/lock.py), passed in the build context;
#   3. `docker build --network none` (pip install --no-index) against a PRIVATE dockerd this script starts in
#      its own network namespace (only `lo`) and stops again; its data-root is kept, so a source-only change
#      reuses the heavy venv layer;
#   4. `docker save` to $IMG_CACHE/<name>-<inputs-hash>.tar and a line in $IMG_CACHE/images.list, which
#      scripts/k8s/node-up.sh `docker load`s into the node tier's dockerd (skipped when already there).
# Warm (every tarball present for the current inputs): ~1 s, no dockerd started.
# Cold on 2 cores: see images/README.md (debootstrap ~1.5 min, wheels ~2 min from pip's cache, builds ~10 min).
#   FORCE=1  rebuild even if the tarballs exist
set -euo pipefail
source "$(dirname "$0")/../k8s/lib.sh"
IMG_SRC=$REPO_ROOT/images
IMG_CACHE=${IMG_CACHE:-$SAMPLER_CACHE_DIR/images}
REGISTRY=${IMAGE_REGISTRY:-ghcr.io/sampler-operator}
APP_VERSION=$(awk -F'"' '/^appVersion:/{print $2}' "$REPO_ROOT/charts/sampler-operator/Chart.yaml")
[ -n "$APP_VERSION" ] || { echo "[images] no appVersion in Chart.yaml" >&2; exit 1; }
RECIPE=1     # bump when this script's build steps change in a way the hashed inputs do not show
PIP=${PIP:-$REPO_ROOT/.venv/bin/pip}
MIRROR=${MIRROR:-$(awk '/^URIs:/{print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
# python3-venv brings ensurepip (pip for the image venvs); libgomp1/libnuma1: torch's and vLLM's CPU kernels.
BASE_PKGS="python3 python3-venv libgomp1 libnuma1 ca-certificates"
T0=$(ts)
apt_install debootstrap docker.io iproute2 util-linux
mkdir -p "$IMG_CACHE"
exec 8>"$IMG_CACHE/.lock"
flock -w 3600 8 || { echo "[images] could not lock $IMG_CACHE/.lock" >&2; exit 1; }

rm -rf "$IMG_CACHE"/.ctx-* "$IMG_CACHE"/.base-*   # leftovers of an interrupted run (we hold the lock)
h() { { echo "$RECIPE"; cat "$@"; } | sha256sum | cut -c1-16; }
# every file of a source package (bytecode excluded), by path and content
tree_hash() { (cd "$1" && find . -type f ! -name '*.pyc' ! -path '*/__pycache__/*' -print0 | LC_ALL=C sort -z | xargs -0 sha256sum) | sha256sum | cut -c1-16; }
# an image's sources (images/<name>/sources: ROOT:PATH lines, ROOT relative to the repo)
sources() { grep -v '^#' "$1" | grep -v '^$'; }
# A directory hashes as before (tree_hash), so an image whose sources are one package keeps its inputs hash.
sources_hash() {
  local e
  for e in $(sources "$1"); do
    if [ -d "$REPO_ROOT/${e%%:*}/${e#*:}" ]; then tree_hash "$REPO_ROOT/${e%%:*}/${e#*:}"
    else (cd "$REPO_ROOT/${e%%:*}" && sha256sum "${e#*:}"); fi
  done
}

# --- 1. base root-fs
BASE_H=$(echo "$BASE_PKGS bookworm minbase" | h)
BASE_TAR=$IMG_CACHE/python-base-$BASE_H.tar
BASE_TAG=sampler-operator/python-base:$BASE_H
if [ ! -f "$BASE_TAR" ]; then
  t=$(ts); echo "[images] debootstrap bookworm + python3 (one-time, ~1-2 min)..." >&2
  W=$(mktemp -d -p "$IMG_CACHE" .base-XXXX); R=$W/rootfs
  unshare -m --propagation private debootstrap --variant=minbase --include="$(echo $BASE_PKGS | tr ' ' ,)" \
    bookworm "$R" "$MIRROR" > "$W/debootstrap.log" 2>&1 || { tail -20 "$W/debootstrap.log" >&2; exit 1; }
  # no apt caches, docs or locales in the image
  rm -rf "$R"/var/cache/apt/archives/*.deb "$R"/var/cache/apt/*.bin "$R"/var/lib/apt/lists/*_* "$R"/etc/resolv.conf \
    "$R"/usr/share/doc/* "$R"/usr/share/man/* "$R"/usr/share/info/* "$R"/usr/share/locale/*
  "$R/usr/bin/python3" --version >/dev/null 2>&1 || chroot "$R" python3 --version >/dev/null
  tar -C "$R" -cf "$BASE_TAR.tmp" .; mv "$BASE_TAR.tmp" "$BASE_TAR"; rm -rf "$W"   # (not `&&`: see docker save)
  for f in "$IMG_CACHE"/python-base-*.tar; do [ "$f" = "$BASE_TAR" ] || rm -f "$f"; done
  echo "[images] base root-fs: $(el $t)" >&2
fi

# --- 2..4 per image
NAMES=(operator sampler-cpu)
DOCKERD_PID=""
DD=$IMG_CACHE/dockerd
stop_dockerd() {
  [ -n "$DOCKERD_PID" ] || return 0
  stop_pid "$DOCKERD_PID" 30; DOCKERD_PID=""
  echo "[images] build dockerd stopped" >&2
}
trap stop_dockerd EXIT
start_dockerd() {
  [ -n "$DOCKERD_PID" ] && return 0
  mkdir -p "$DD/data" "$DD/empty"; rm -rf "$DD/run"; mkdir -p "$DD/run"
  local driver=overlay2
  case "$(stat -f -c %T "$DD/data")" in overlayfs|overlay) driver=vfs;; esac
  # Own network namespace with only lo (nothing in a build can reach out) and own mount namespace
  # (never share a system containerd). `unshare` execs: its PID is dockerd's.
  unshare --net --mount --propagation private bash -c '
    ip link set lo up
    if [ -d /run/containerd ]; then mount --bind "$1/empty" /run/containerd; fi
    exec dockerd --data-root "$1/data" --exec-root "$1/run/exec" --host "unix://$1/run/docker.sock" \
      --pidfile "$1/run/docker.pid" --bridge=none --iptables=false --ip-masq=false --ip6tables=false \
      --exec-opt native.cgroupdriver=cgroupfs --storage-driver="$2"' _ "$DD" "$driver" > "$DD/dockerd.log" 2>&1 8>&- &
  DOCKERD_PID=$!
  export DOCKER_HOST=unix://$DD/run/docker.sock
  local i
  for i in $(seq 300); do docker version >/dev/null 2>&1 && break; alive "$DOCKERD_PID" || break; sleep 0.1; done
  docker version >/dev/null 2>&1 || { echo "[images] build dockerd failed:" >&2; tail -20 "$DD/dockerd.log" >&2; exit 1; }
  if [ "$(docker image inspect -f '{{index .Config.Labels "local.tarball"}}' "$BASE_TAG" 2>/dev/null)" != "$(basename "$BASE_TAR")" ]; then
    docker import -c 'CMD ["/usr/bin/python3"]' -c "LABEL local.tarball=$(basename "$BASE_TAR")" "$BASE_TAR" "$BASE_TAG" >/dev/null
  fi
  echo "[images] build dockerd up (private netns, data-root $DD/data)" >&2
}

wheelhouse() {  # wheelhouse LOCKFILE -> prints the dir; pip download (+ pip wheel for sdists), cached by lock hash
  local lock=$1 wh; wh=$IMG_CACHE/wheels/$(h "$lock")
  if [ ! -f "$wh/.complete" ]; then
    local t; t=$(ts); rm -rf "$wh"; mkdir -p "$wh"
    echo "[images] filling wheelhouse $wh (pip download; from pip's cache when warm)..." >&2
    # (grep drops pip's warnings about this machine's optional local mirrors, as scripts/setup.sh does)
    "$PIP" download --quiet --no-deps --dest "$wh" -r "$lock" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; } >&2
    [ "${PIPESTATUS[0]}" = 0 ] || { echo "[images] pip download failed" >&2; exit 1; }
    local f
    for f in "$wh"/*; do
      case "$f" in *.whl) ;; *) "$PIP" wheel --quiet --no-deps --wheel-dir "$wh" "$f" >&2; rm -f "$f";; esac
    done
    [ "$(ls "$wh"/*.whl | wc -l)" -ge "$(grep -c '==' "$lock")" ] || { echo "[images] wheelhouse incomplete: $wh" >&2; exit 1; }
    touch "$wh/.complete"; echo "[images] wheelhouse: $(el $t) ($(du -sh "$wh" | cut -f1))" >&2
  fi
  echo "$wh"
}

LIST=$IMG_CACHE/images.list.tmp; : > "$LIST"
for name in "${NAMES[@]}"; do
  dir=$IMG_SRC/$name
  H=$( { echo "$RECIPE $BASE_H $APP_VERSION"; cat "$dir/Dockerfile" "$dir/requirements.lock"; sources_hash "$dir/sources"; } | sha256sum | cut -c1-16)
  TAG=$REGISTRY/$name:$APP_VERSION
  TAR=$IMG_CACHE/$name-$H.tar
  if [ -n "${FORCE:-}" ] || [ ! -f "$TAR" ]; then
    t=$(ts)
    WH=$(wheelhouse "$dir/requirements.lock")
    start_dockerd
    CTX=$(mktemp -d -p "$IMG_CACHE" .ctx-XXXX)
    cp "$dir/Dockerfile" "$dir/requirements.lock" "$CTX/"
    cp -al "$WH" "$CTX/wheels" 2>/dev/null || cp -a "$WH" "$CTX/wheels"; rm -f "$CTX/wheels/.complete"
    for e in $(sources "$dir/sources"); do (cd "$REPO_ROOT/${e%%:*}" && cp -a --parents "${e#*:}" "$CTX/"); done
    find "$CTX" -name __pycache__ -prune -exec rm -rf {} +
    echo "[images] building $TAG (inputs $H)..." >&2
    # The classic builder (the Docker CLI here has no buildx). The build stage (the venv) is built and TAGGED
    # first: a tagged image survives `docker image prune`, so the next build (e.g. after a source change)
    # reuses its layers instead of reinstalling the wheels; the previous stage image, untagged, is pruned.
    : > "$IMG_CACHE/build-$name.log"
    for target in "--target build -t sampler-operator/$name-build:cache" "-t $TAG"; do
      # shellcheck disable=SC2086  # $target is two or four words on purpose
      DOCKER_BUILDKIT=0 docker build --network none --force-rm --build-arg "BASE_IMAGE=$BASE_TAG" \
        --label "org.opencontainers.image.version=$APP_VERSION" --label "sampler-operator.inputs=$H" \
        $target "$CTX" >> "$IMG_CACHE/build-$name.log" 2>&1 \
        || { tail -30 "$IMG_CACHE/build-$name.log" >&2; echo "[images] build of $TAG failed (log: $IMG_CACHE/build-$name.log)" >&2; exit 1; }
    done
    rm -rf "$CTX"
    # Two commands, not `save && mv`: set -e ignores a failure on the left of `&&`, and a `docker save` that
    # failed (a full disk) then left images.list naming a tarball that was never written, found only when the
    # node tier could not load it.
    docker save -o "$TAR.tmp" "$TAG" || { rm -f "$TAR.tmp"; echo "[images] docker save of $TAG failed (disk: $(df -h "$IMG_CACHE" | awk 'NR==2{print $4}') free)" >&2; exit 1; }
    mv "$TAR.tmp" "$TAR"
    for f in "$IMG_CACHE/$name"-*.tar; do [ "$f" = "$TAR" ] || rm -f "$f"; done
    docker image prune -f >/dev/null
    size=$(docker image inspect -f '{{.Size}}' "$TAG")
    echo "[images] $TAG: built + saved in $(el $t), $((size / 1000000)) MB" >&2
  fi
  echo "$TAG|$TAR|$H" >> "$LIST"
done
mv -f "$LIST" "$IMG_CACHE/images.list"
stop_dockerd
echo "[images] ok ($(el "$T0")): $(cut -d'|' -f1 "$IMG_CACHE/images.list" | tr '\n' ' ')" >&2
