#!/usr/bin/env bash
# Everything the demo and the tests run on, built once per machine into caches outside the repo
# (each step is idempotent, ~1 s when its cache is current):
#   scripts/setup.sh         the Python venv with vLLM (requirements/lock.txt)
#   scripts/k8s/build.sh     the Kubernetes binaries, built from Debian's source, and the node tier's root-fs images
#   scripts/images/build.sh  the operator and CPU sampler images (it needs the venv's pip)
# On a fresh machine the Kubernetes build (mostly a CPU-bound Go compile, ~7 min) runs BESIDE the venv and
# the image builds (mostly downloading and unpacking), instead of before them: the three one-time builds
# took 17 min one after another on 2 cores.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
source scripts/k8s/lib.sh
# Every apt package the builds need, first and in one go: the two builds below never run apt at once.
apt_install "${K8S_BUILD_PKGS[@]}"
# Its own process group (job control on for this one job), so that a failure below stops all of it.
set -m
bash scripts/k8s/build.sh &
K8S_BUILD=$!
set +m
trap 'kill -- "-$K8S_BUILD" 2>/dev/null || true' EXIT
bash scripts/setup.sh
bash scripts/images/build.sh
wait "$K8S_BUILD"
trap - EXIT
