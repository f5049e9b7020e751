#!/usr/bin/env bash
# THE test command (README, .ci/run): sets everything up, then runs every tier.
#   lint                      ruff + mypy (scripts/lint.sh)                              (a minute)
#   tests/unit                pure logic, fake engine, checkpoint validation, layers     (seconds)
#   tests/operator/unit       the operator's pure logic, the chart, the examples         (seconds)
#   tests/gateway             the pool's gateway: pure decisions, and a real gateway process
#                             in front of real fake-engine sampler processes             (a few minutes)
#   tests/engine              the real vLLM CPU engine behind real HTTP servers          (~10 min, run
#                                                                                         beside the others)
#   tests/operator/envtest    the operator against a real kube-apiserver, etcd and
#                             controller-manager                                         (~5 min)
#   tests/operator/node       a real kubelet cluster in a private netns with only lo (scripts/k8s/test-node.sh),
#                             running the project's images (scripts/images/build.sh) and ./scripts/demo.sh's story
# Nothing is skipped for a missing dependency: SAMPLER_REQUIRE_K8S=1 turns that into a failure.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
# The venv, the Kubernetes binaries and the images the node tier runs: ~10 min once on a fresh machine
# (the Kubernetes build beside the other two), ~2 s cached.
bash scripts/prepare.sh
# graphviz renders the docs' pictures (tests/unit/test_docs.py checks they are current).
command -v dot >/dev/null || (source scripts/k8s/lib.sh && apt_install graphviz)
export SAMPLER_REQUIRE_K8S=1 PYTHONDONTWRITEBYTECODE=1
# The cached venv may be shared by several checkouts: make every process import THIS one.
export PYTHONPATH="$ROOT:$ROOT/operator${PYTHONPATH:+:$PYTHONPATH}"
PY="$ROOT/.venv/bin/python"
# Lint (ruff + mypy, ~1 min of one core) runs beside the tiers; its output is printed when it ends.
LINT_LOG=$(mktemp -t sampler-lint.XXXXXX)
bash scripts/lint.sh > "$LINT_LOG" 2>&1 &
LINT=$!
# No retries: a flaky test is a bug to fix at its cause, never re-run into passing.
status=0
# Two pytest processes at once: the engine tier (real vLLM engines, ~10 min alone) beside the other tiers
# (~10 min alone). One stream kept about one of the two cores busy (the engine tier waits on its engine,
# envtest on its API server), and nothing is shared between them: every test has its own ports, directories
# and engine-startup lock, and the envtest tier its own control plane. The engine tier's log is printed
# whole once it ends. --durations: where the time goes, in every CI log.
echo "=== unit, gateway and envtest tiers, with the engine tier beside them" >&2
ENGINE_LOG=$(mktemp -t sampler-engine-tier.XXXXXX)
"$PY" -m pytest tests/engine -q -p no:cacheprovider --durations=15 > "$ENGINE_LOG" 2>&1 &
ENGINE_TIER=$!
trap 'kill "$ENGINE_TIER" "$LINT" 2>/dev/null || true' EXIT
"$PY" -m pytest tests/unit tests/operator/unit tests/gateway tests/operator/envtest -q -p no:cacheprovider \
  --durations=15 || status=1
wait "$ENGINE_TIER" || status=1
wait "$LINT" || status=1
trap - EXIT
echo "=== lint (it ran beside the tiers)" >&2
cat "$LINT_LOG"; rm -f "$LINT_LOG"
echo "=== engine tier (real vLLM CPU engines; it ran beside the tiers above)" >&2
cat "$ENGINE_LOG"; rm -f "$ENGINE_LOG"
echo "=== node tier (real kubelet, private netns)" >&2
bash scripts/k8s/test-node.sh -p no:cacheprovider --durations=0 || status=1
exit $status
