# shellcheck shell=bash
# Sourced by the scripts in scripts/k8s/: common paths. Nothing here starts anything.
#   SAMPLER_CACHE_DIR  cache root (default $HOME/.cache/sampler-operator); binaries/images live in $K8S_CACHE
K8S_SCRIPTS=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO_ROOT=$(cd "$K8S_SCRIPTS/../.." && pwd)
SAMPLER_CACHE_DIR=${SAMPLER_CACHE_DIR:-$HOME/.cache/sampler-operator}
K8S_CACHE=${K8S_CACHE:-$SAMPLER_CACHE_DIR/k8s}
K8S_BIN=$K8S_CACHE/bin            # kube-apiserver kube-controller-manager kube-scheduler kubelet kube-proxy kubectl helm kubectl-v32
K8S_IMAGES=$K8S_CACHE/images      # <name>-<hash>.tar root-fs tarballs for `docker import`
K8S_VERSION=v1.20.2
K8S_SERVICE_CIDR=10.0.0.0/24      # the apiserver's ClusterIP range; node-up.sh routes it to kube-proxy's rules
DEB_K8S_SRC_VERSION=1.20.5+really1.20.2-1.1+deb12u1
ETCD=${ETCD:-/usr/bin/etcd}
# The apt packages scripts/k8s/build.sh needs (scripts/images/build.sh needs a subset of them).
K8S_BUILD_PKGS=(golang-go golang-github-modern-go-reflect2-dev dpkg-dev etcd-server openssl curl ca-certificates
  debootstrap docker.io gcc libc6-dev busybox-static iproute2 util-linux procps
  iptables conntrack)   # kube-proxy (iptables mode) runs iptables-restore, and `conntrack -D` for stale UDP entries
KUBECTL=${KUBECTL:-$K8S_BIN/kubectl}

ts() { date +%s.%N; }
el() { awk -v a="$1" -v b="$(date +%s.%N)" 'BEGIN{printf "%.2fs", b-a}'; }
# a live, non-zombie process
alive() { [ -n "${1:-}" ] && [ -d "/proc/$1" ] && ! grep -q '^[^)]*) Z' "/proc/$1/stat" 2>/dev/null; }
# stop ONE recorded pid: TERM, wait up to ${2:-5}s, then KILL
stop_pid() {
  local p=$1 t=${2:-5} i
  alive "$p" || return 0
  kill "$p" 2>/dev/null || true
  for ((i = 0; i < t * 20; i++)); do alive "$p" || return 0; sleep 0.05; done
  kill -9 "$p" 2>/dev/null || true
  for ((i = 0; i < 40; i++)); do alive "$p" || return 0; sleep 0.05; done
}
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
apt_install() {  # apt_install pkg...  (only the missing ones; waits for a concurrent apt/dpkg)
  local missing=() p
  for p in "$@"; do [ "$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null)" = "install ok installed" ] || missing+=("$p"); done
  [ ${#missing[@]} -eq 0 ] && return 0
  echo "[k8s] apt-get install ${missing[*]}" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get -o DPkg::Lock::Timeout=600 update -qq
  apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}
