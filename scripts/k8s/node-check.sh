#!/bin/bash
# Smoke test of the node tier (run it with node-up.sh already up; it re-executes itself inside the namespace):
#  1) busybox pod with an exec readiness probe -> Ready
#  2) sampler-base pod running the HOST's Python + project venv + repo (hostPath, read-only):
#     `import vllm, fastapi` then an HTTP server with an httpGet readiness probe -> Ready, reachable on 127.0.0.1
#  3) delete both, no containers left.  Prints timings; exit 1 on failure.
# Usage: node-check.sh [--state DIR]
set -uo pipefail
source "$(dirname "$0")/lib.sh"
if [ "${SAMPLER_K8S_TIER:-}" != node ]; then exec "$K8S_SCRIPTS/node-exec.sh" "$@" "$0"; fi
fail=0; ok() { echo "PASS $*"; }; bad() { echo "FAIL $*"; fail=1; }
K() { kubectl "$@"; }
VENV=$(readlink -f "$REPO_ROOT/.venv")
PYROOT=$(dirname "$(awk -F' = ' '/^home/{print $2}' "$VENV/pyvenv.cfg")")
PORT=${PORT:-18080}
K delete pod bb-ready py-ready --ignore-not-found --wait=true >/dev/null 2>&1
t=$(ts)
cat <<YAML | K apply -f - >/dev/null
apiVersion: v1
kind: Pod
metadata: {name: bb-ready}
spec:
  hostNetwork: true
  terminationGracePeriodSeconds: 1
  containers:
  - name: c
    image: local/busybox:dev
    imagePullPolicy: Never
    command: ["sh", "-c", "touch /tmp/ready; trap 'exit 0' TERM; while true; do sleep 0.2; done"]
    readinessProbe: {exec: {command: ["test", "-f", "/tmp/ready"]}, periodSeconds: 1}
YAML
K wait --for=condition=Ready pod/bb-ready --timeout=120s >/dev/null && ok "busybox pod apply -> Ready in $(el $t)" || bad "busybox pod not Ready"
t=$(ts)
cat <<YAML | K apply -f - >/dev/null
apiVersion: v1
kind: Pod
metadata: {name: py-ready}
spec:
  hostNetwork: true
  terminationGracePeriodSeconds: 2
  volumes:
  - {name: python, hostPath: {path: $PYROOT, type: Directory}}
  - {name: venv, hostPath: {path: $VENV, type: Directory}}
  - {name: src, hostPath: {path: $REPO_ROOT, type: Directory}}
  containers:
  - name: c
    image: local/sampler-base:dev
    imagePullPolicy: Never
    workingDir: /tmp
    command: ["$VENV/bin/python", "-c", "import time, sys; t=time.time(); import vllm, fastapi, uvicorn; print('imported vllm', vllm.__version__, 'fastapi', fastapi.__version__, 'in %.1fs' % (time.time()-t), flush=True); import http.server; http.server.HTTPServer(('127.0.0.1', $PORT), http.server.SimpleHTTPRequestHandler).serve_forever()"]
    volumeMounts:
    - {name: python, mountPath: $PYROOT, readOnly: true}
    - {name: venv, mountPath: $VENV, readOnly: true}
    - {name: src, mountPath: $REPO_ROOT, readOnly: true}
    readinessProbe: {httpGet: {host: 127.0.0.1, port: $PORT, path: /}, periodSeconds: 1}
YAML
K wait --for=condition=Ready pod/py-ready --timeout=300s >/dev/null && ok "sampler-base pod (host python + venv via hostPath) apply -> Ready in $(el $t)" || { bad "python pod not Ready"; K describe pod py-ready | tail -20; }
logs=$(K logs py-ready 2>&1)   # (no `| grep -q` under pipefail: an early grep exit fails the pipeline)
line=$(echo "$logs" | grep 'imported vllm' || true)
[ -n "$line" ] && ok "in-pod: $line" || { bad "import vllm in pod"; echo "$logs" | tail -20; }
curl -sf "http://127.0.0.1:$PORT/" >/dev/null && ok "pod reachable on 127.0.0.1:$PORT (hostNetwork, inside the netns)" || bad "http to pod"
[ "$(K get pod py-ready -o jsonpath='{.spec.nodeName} {.status.phase} {.status.podIP}')" = "${NODE_NAME:-sampler-node} Running 127.0.0.1" ] && ok "scheduled on ${NODE_NAME:-sampler-node}, Running, podIP 127.0.0.1" || bad "placement/phase"
t=$(ts); K delete pod bb-ready py-ready --wait=true >/dev/null; d=$(el $t)
n=$(docker ps -aq --filter label=io.kubernetes.pod.namespace=default | wc -l)
[ "$n" = 0 ] && ok "delete removed all containers (kubectl delete took $d)" || bad "containers left: $n"
exit $fail
