#!/usr/bin/env bash
# THE demo command (README): the operator's story on a real local Kubernetes cluster.
#   ./scripts/demo.sh          set up (once), build the images (once), bring up the local cluster if needed,
#                              helm install the chart, then narrate: a SamplerPool of 2 and its gateway come up,
#                              sample through the gateway, an RL loop trains through it (examples/rl_loop.py),
#                              one replica's pod is lost mid-run and the loop finishes unharmed, then the README's
#                              quickstart push; every README quickstart command is run as written (scripts/demo_cluster.py)
#   ./scripts/demo.sh --local  the quick single-pod demo: one sampler process on 127.0.0.1, no Kubernetes
# The cluster is the node tier (scripts/k8s/README.md): kubelet + dockerd + control plane in a private network
# namespace with only `lo`, state in ${SAMPLER_CACHE_DIR:-~/.cache/sampler-operator}/k8s/node. It stays up
# afterwards (scripts/k8s/node-exec.sh kubectl get sp,sr -A); `make cluster-down` stops it.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
if [ "${1:-}" = --local ]; then
    bash scripts/setup.sh
    PYTHONPATH="$ROOT:$ROOT/operator" exec .venv/bin/python scripts/demo.py
fi
[ $# -eq 0 ] || { echo "usage: $0 [--local]" >&2; exit 2; }
CACHE=${SAMPLER_CACHE_DIR:-$HOME/.cache/sampler-operator}
T0=$(date +%s)

# A fresh machine: say up front what the one-time build costs (each step below prints its progress).
todo=()
compgen -G "$CACHE/venv-*/.complete" >/dev/null || todo+=("Python venv with vLLM ~4 min")
[ -x "$CACHE/k8s/bin/kubelet" ] || todo+=("Kubernetes binaries from Debian's source ~8 min (beside the other two)")
[ -f "$CACHE/images/images.list" ] || todo+=("container images ~6 min")
if [ ${#todo[@]} -gt 0 ]; then
    echo "=== first run on this machine: a one-time build comes first (on 2 cores, ~10-15 min):"
    printf '      - %s\n' "${todo[@]}"
    echo "    later runs reuse the caches in $CACHE and take 3-5 min."
fi
echo "=== [setup 1/2] Python venv, Kubernetes binaries, images (scripts/prepare.sh)"; bash scripts/prepare.sh
echo "=== [setup 2/2] local cluster (node tier)"; bash scripts/k8s/node-up.sh
echo "=== setup done in $(( $(date +%s) - T0 ))s; the story:"
export PYTHONDONTWRITEBYTECODE=1
# The cached venv may be shared by several checkouts: import THIS one.
export PYTHONPATH="$ROOT:$ROOT/operator${PYTHONPATH:+:$PYTHONPATH}"
scripts/k8s/node-exec.sh .venv/bin/python scripts/demo_cluster.py
echo "=== demo done in $(( $(date +%s) - T0 ))s"
