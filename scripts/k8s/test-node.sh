#!/usr/bin/env bash
# The node tier end to end: bring up the real single-node cluster (kubelet + dockerd in a private netns with
# only `lo`), run the node-marked tests INSIDE it, and ALWAYS bring it down again. Exits with pytest's status.
#   scripts/k8s/build.sh && scripts/k8s/test-node.sh [extra pytest args, e.g. -k vllm -x]
# env: K8S_NODE_STATE (state dir, default $SAMPLER_CACHE_DIR/k8s/node-test: its own, so a developer's
#      `make cluster-up` cluster in .../k8s/node is never touched), PYTHON (default .venv/bin/python),
#      NODE_TEST_TIMEOUT (pytest wall-clock cap, default 2700 s: the tier takes 20-30 min on a 2-core box), KEEP_CLUSTER=1 (skip the final node-down).
# SAMPLER_REQUIRE_K8S=1 is exported: a missing prerequisite FAILS the tests instead of skipping them.
set -uo pipefail
source "$(dirname "$0")/lib.sh"
S=${K8S_NODE_STATE:-$K8S_CACHE/node-test}
mkdir -p "$S" && S=$(readlink -f "$S")
PY=${PYTHON:-$REPO_ROOT/.venv/bin/python}
export SAMPLER_REQUIRE_K8S=1 PYTHONDONTWRITEBYTECODE=1
# The cached venv may be shared with other checkouts (its .pth names the last one set up): import THIS one.
export PYTHONPATH="$REPO_ROOT:$REPO_ROOT/operator${PYTHONPATH:+:$PYTHONPATH}"
unset K8S_NODE_STATE   # node-exec.sh gets --state explicitly

# One run per state dir at a time (a second concurrent run would tear the first one's cluster down).
# Every child gets `9>&-`: a daemon that inherited the lock's fd (dockerd, kubelet...) would hold it forever.
exec 9>"$S.lock"
flock -w 3600 9 || { echo "[test-node] could not lock $S.lock" >&2; exit 1; }

T0=$(ts)
down() {
  [ -n "${KEEP_CLUSTER:-}" ] && { echo "[test-node] KEEP_CLUSTER set: cluster left up in $S" >&2; return; }
  # node-up.sh stops what it started when it fails: a second node-down would rotate its logs away
  [ -d "$S/run" ] || return 0
  local t; t=$(ts)
  "$K8S_SCRIPTS/node-down.sh" "$S" >&2 9>&- || true
  echo "[test-node] node-down: $(el "$t"); total $(el "$T0")" >&2
}
trap down EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# Leftovers of an interrupted run (holder killed, kubelet/dockerd/operator still around): stop them first,
# so a fresh namespace, dockerd and etcd start clean (node-up.sh wipes etcd; the docker data-root keeps only
# the imported images, node-down.sh removes every container).
if [ -d "$S/run" ]; then
  echo "[test-node] leftovers of an earlier run in $S: stopping them" >&2
  "$K8S_SCRIPTS/node-down.sh" "$S" >&2 9>&- || true
fi

# node-up.sh cleans up after itself when it fails and keeps its logs. No retry: a node that fails to come
# up is a failure CI must show (the suite never retries its way to green).
t=$(ts)
if ! "$K8S_SCRIPTS/node-up.sh" "$S" 9>&-; then
  rm -rf "$S/logs.node-up-failed"; [ -d "$S/logs.prev" ] && cp -a "$S/logs.prev" "$S/logs.node-up-failed"
  echo "[test-node] node-up.sh failed (logs: $S/logs.node-up-failed)" >&2
  exit 1
fi
echo "[test-node] node-up: $(el "$t")" >&2

cd "$REPO_ROOT"
t=$(ts)
timeout --kill-after=30 "${NODE_TEST_TIMEOUT:-2700}" \
  "$K8S_SCRIPTS/node-exec.sh" --state "$S" "$PY" -m pytest -m node tests/operator/node -q "$@" 9>&-
rc=$?
echo "[test-node] pytest exited $rc after $(el "$t")" >&2
exit $rc
