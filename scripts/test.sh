#!/usr/bin/env bash
# THE test command (README, .ci/run): sets everything up, then runs every tier.
#   lint                      ruff + mypy (scripts/lint.sh)                              (a minute)
#   tests/unit                pure logic, fake engine, checkpoint validation, layers     (seconds)
#   tests/operator/unit       the operator's pure logic, the chart, the examples         (seconds)
#   tests/gateway             the pool's gateway: pure decisions, and a real gateway process
#                             in front of real fake-engine sampler processes             (a few minutes)
#   tests/engine              the real vLLM CPU engine behind real HTTP servers          (~10 min)
#   tests/operator/envtest    the operator against a real kube-apiserver, etcd and
#                             controller-manager                                         (~5 min)
#   tests/operator/node       a real kubelet cluster in a private netns with only lo (scripts/k8s/test-node.sh),
#                             running the project's images (scripts/images/build.sh) and ./scripts/demo.sh's story
# Nothing is skipped for a missing dependency: SAMPLER_REQUIRE_K8S=1 turns that into a failure.
#
# Two chains run side by side, so that a fresh machine takes the longer chain, not their sum:
#   the node chain  the Kubernetes binaries (a CPU-bound Go compile), the images (they need the venv's pip),
#                   then the node tier (17-20 min, mostly waiting on pods); its lines start with "[node] ";
#   this shell      the venv, lint, the unit, gateway and engine tiers, then the envtest tier (it needs the
#                   binaries: by then long built).
# They share nothing but the caches, each behind its lock (setup.sh's, k8s/build.sh's, images/build.sh's);
# the node tier runs in its own network namespace with its own dockerd, so no port or daemon is shared.
# Side by side is safe since the gateway's second-send fix (465f528): the faults soak under CPU hogs
# (`python -m bench.faults --cpu-hogs 3`) lost nothing.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
source scripts/k8s/lib.sh
# Every apt package the builds need, first and in one go: the chains below never run apt at once.
# (graphviz renders the docs' pictures; tests/unit/test_docs.py checks they are current.)
apt_install "${K8S_BUILD_PKGS[@]}" graphviz
export SAMPLER_REQUIRE_K8S=1 PYTHONDONTWRITEBYTECODE=1
# The cached venv may be shared by several checkouts: make every process import THIS one.
export PYTHONPATH="$ROOT:$ROOT/operator${PYTHONPATH:+:$PYTHONPATH}"
PY="$ROOT/.venv/bin/python"
# No retries: a flaky test is a bug to fix at its cause, never re-run into passing.
# --durations: where the time goes, in every CI log.

node_chain() {
  bash scripts/k8s/build.sh
  bash scripts/setup.sh          # the venv this shell builds: waits on setup.sh's lock, then ~1 s
  bash scripts/images/build.sh
  echo "=== node tier (real kubelet, private netns)" >&2
  bash scripts/k8s/test-node.sh -p no:cacheprovider --durations=0
}
# Its own process group (job control on for this one job), so that an early exit stops all of it.
set -m
( set -o pipefail; node_chain 2>&1 | sed -u 's/^/[node] /' >&2 ) &
NODE=$!
set +m
trap 'kill -- "-$NODE" 2>/dev/null || true' EXIT

bash scripts/setup.sh
bash scripts/lint.sh
status=0
echo "=== unit, gateway and engine tiers" >&2
"$PY" -m pytest tests/unit tests/operator/unit tests/gateway tests/engine -q -p no:cacheprovider \
  --durations=25 || status=1
echo "=== envtest tier (real kube-apiserver, etcd, controller-manager)" >&2
SKIP_IMAGES=1 bash scripts/k8s/build.sh
"$PY" -m pytest tests/operator/envtest -q -p no:cacheprovider --durations=10 || status=1

echo "=== waiting for the node chain" >&2
wait "$NODE" || { echo "=== the node chain failed" >&2; status=1; }
trap - EXIT
exit $status
