#!/usr/bin/env bash
# THE test command (README, .ci/run): sets everything up, then runs every tier.
#   unit   : pure logic + fake engine + checkpoint validation      (seconds)
#   engine : the real vLLM CPU engine behind real HTTP servers     (minutes)
#   k8s    : the operator against a real kube-apiserver + etcd     (see scripts/k8s/)
#   node   : a real kubelet cluster inside a private netns        (see scripts/k8s/)
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
bash scripts/setup.sh
PY="$ROOT/.venv/bin/python"
export PYTHONDONTWRITEBYTECODE=1

status=0
run() { echo "=== $*" >&2; "$@" || status=1; }

run "$PY" -m pytest tests/unit -q -p no:cacheprovider
run "$PY" -m pytest tests/engine -q -p no:cacheprovider
if [[ -x scripts/k8s/test-k8s.sh ]]; then
    run bash scripts/k8s/test-k8s.sh
fi
exit $status
