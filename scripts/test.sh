#!/usr/bin/env bash
# THE test command (README, .ci/run): sets everything up, then runs every tier.
#   lint                      ruff + mypy (scripts/lint.sh)                              (a minute)
#   tests/unit                pure logic, fake engine, checkpoint validation, layers     (seconds)
#   tests/operator/unit       the operator's pure logic, the chart, the examples         (seconds)
#   tests/engine              the real vLLM CPU engine behind real HTTP servers          (minutes)
#   tests/operator/envtest    the operator against a real kube-apiserver, etcd and
#                             controller-manager                                         (a minute)
#   tests/operator/node       a real kubelet cluster in a private netns with only lo (scripts/k8s/test-node.sh),
#                             running the project's images (scripts/images/build.sh) and ./scripts/demo.sh's story
# Nothing is skipped for a missing dependency: SAMPLER_REQUIRE_K8S=1 turns that into a failure.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
bash scripts/setup.sh
bash scripts/k8s/build.sh           # ~8 min once on a fresh machine, ~1 s cached
# The operator and CPU sampler images, which the node tier runs (~12 min once, ~1 s cached by input hash).
bash scripts/images/build.sh
# graphviz renders the docs' pictures (tests/unit/test_docs.py checks they are current).
command -v dot >/dev/null || (source scripts/k8s/lib.sh && apt_install graphviz)
export SAMPLER_REQUIRE_K8S=1 PYTHONDONTWRITEBYTECODE=1
# The cached venv may be shared by several checkouts: make every process import THIS one.
export PYTHONPATH="$ROOT:$ROOT/operator${PYTHONPATH:+:$PYTHONPATH}"
PY="$ROOT/.venv/bin/python"
bash scripts/lint.sh
TIERS=(tests/unit tests/operator/unit tests/engine tests/operator/envtest)

# A failing run is retried ONCE, running only the tests that failed (pytest --last-failed), and
# says so loudly: a real failure fails twice. This absorbs rare start-up races of the real
# Kubernetes tiers on a loaded 2-core box without hiding anything that fails consistently.
CACHE_OPT=(-p cacheprovider -o "cache_dir=$ROOT/.pytest_cache")
status=0
echo "=== unit, engine and envtest tiers" >&2
if ! "$PY" -m pytest "${TIERS[@]}" -q "${CACHE_OPT[@]}"; then
    echo "=== RETRY (once) of the tests that failed above" >&2
    "$PY" -m pytest "${TIERS[@]}" -q "${CACHE_OPT[@]}" --last-failed \
        --last-failed-no-failures none || status=1
fi
echo "=== node tier (real kubelet, private netns)" >&2
NODE_CACHE=(-o "cache_dir=$ROOT/.pytest_cache/node")
if ! bash scripts/k8s/test-node.sh "${NODE_CACHE[@]}"; then
    echo "=== RETRY (once) of the node-tier tests that failed above" >&2
    bash scripts/k8s/test-node.sh "${NODE_CACHE[@]}" --last-failed --last-failed-no-failures none || status=1
fi
exit $status
