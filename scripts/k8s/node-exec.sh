#!/bin/bash
# Run CMD inside the node tier's private network + mount namespace, with KUBECONFIG, DOCKER_HOST and PATH
# (our kubectl/helm first) set. The apiserver (127.0.0.1:6443) and hostNetwork pods are only reachable in there.
# Usage: node-exec.sh [--state STATE_DIR] CMD [ARGS...]     (default state: ${K8S_NODE_STATE:-$SAMPLER_CACHE_DIR/k8s/node})
# The working directory is kept; the environment is inherited (plus the variables above).
set -euo pipefail
source "$(dirname "$0")/lib.sh"
S=${K8S_NODE_STATE:-$K8S_CACHE/node}
if [ "${1:-}" = --state ]; then S=$2; shift 2; fi
S=$(readlink -f "$S")
[ $# -gt 0 ] || { echo "usage: node-exec.sh [--state DIR] CMD [ARGS...]" >&2; exit 2; }
P=$(cat "$S/run/ns.pid" 2>/dev/null || true)
alive "$P" || { echo "node tier not running (no live $S/run/ns.pid): run scripts/k8s/node-up.sh" >&2; exit 1; }
exec nsenter -t "$P" -n -m --wd="$PWD" -- env K8S_NODE_STATE="$S" KUBECONFIG="$S/state/kubeconfig" \
  DOCKER_HOST="unix://$S/run/docker.sock" KUBECTL="$K8S_BIN/kubectl" HELM="$K8S_BIN/helm" \
  SAMPLER_K8S_TIER=node PATH="$K8S_BIN:$PATH" "$@"
