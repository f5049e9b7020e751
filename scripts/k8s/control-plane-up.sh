#!/bin/bash
# Start a throw-away etcd + kube-apiserver (+ kube-controller-manager, + optional kube-scheduler) on 127.0.0.1
# in the CURRENT network namespace, write STATE_DIR/kubeconfig. Used by envtest-up.sh (host netns) and
# node-up.sh (inside the node's private netns). Adapted from the reference k8s-up.sh / cluster-up.sh.
# Usage: control-plane-up.sh STATE_DIR
# env: APISERVER_PORT ETCD_PORT ETCD_PEER_PORT (default: free ports), KCM=1|0 (default 1: GC, namespaces, SA tokens),
#      SCHED=1|0 (default 0), NODE_LIFECYCLE=1|0 (default 0; the node tier needs it: it removes the not-ready taint)
# Stop with control-plane-down.sh STATE_DIR (recorded PIDs only).
set -euo pipefail
source "$(dirname "$0")/lib.sh"
D=$(mkdir -p "${1:?usage: control-plane-up.sh STATE_DIR}" && readlink -f "$1")
for b in kube-apiserver kubectl; do [ -x "$K8S_BIN/$b" ] || { echo "missing $K8S_BIN/$b: run scripts/k8s/build.sh" >&2; exit 1; }; done
[ -x "$ETCD" ] || { echo "missing $ETCD: run scripts/k8s/build.sh (apt etcd-server)" >&2; exit 1; }
if [ -f "$D/apiserver.pid" ] && alive "$(cat "$D/apiserver.pid")"; then
  echo "control plane already running in $D (apiserver pid $(cat "$D/apiserver.pid"))" >&2; exit 1
fi
APISERVER_PORT=${APISERVER_PORT:-$(free_port)}
ETCD_PORT=${ETCD_PORT:-$(free_port)}
ETCD_PEER_PORT=${ETCD_PEER_PORT:-$(free_port)}
KCM=${KCM:-1}; SCHED=${SCHED:-0}; NODE_LIFECYCLE=${NODE_LIFECYCLE:-0}
rm -rf "$D/etcd-data"
t0=$(ts)
# started processes are stopped again if anything below fails
trap 'rc=$?; [ $rc = 0 ] || { echo "control-plane-up failed; stopping what it started" >&2; "$K8S_SCRIPTS/control-plane-down.sh" "$D" >/dev/null 2>&1; }; exit $rc' EXIT

# --- credentials (kept across runs: CA, serving cert, SA key, static admin token, controller client certs) ---
if [ ! -f "$D/pki.done" ]; then
  o() { openssl "$@" 2>/dev/null; }
  o req -x509 -newkey rsa:2048 -nodes -days 3650 -subj "/CN=test-ca" -keyout "$D/ca.key" -out "$D/ca.crt"
  o req -newkey rsa:2048 -nodes -subj "/CN=kube-apiserver" -keyout "$D/apiserver.key" -out "$D/apiserver.csr"
  printf 'subjectAltName=IP:127.0.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,IP:10.0.0.1\nextendedKeyUsage=serverAuth\n' > "$D/apiserver.ext"
  o x509 -req -in "$D/apiserver.csr" -CA "$D/ca.crt" -CAkey "$D/ca.key" -CAcreateserial -days 3650 -extfile "$D/apiserver.ext" -out "$D/apiserver.crt"
  o genrsa -out "$D/sa.key" 2048
  o rsa -in "$D/sa.key" -pubout -out "$D/sa.pub"
  for c in kcm:system:kube-controller-manager sched:system:kube-scheduler; do
    o req -newkey rsa:2048 -nodes -subj "/CN=${c#*:}" -keyout "$D/${c%%:*}.key" -out "$D/${c%%:*}.csr"
    o x509 -req -in "$D/${c%%:*}.csr" -CA "$D/ca.crt" -CAkey "$D/ca.key" -CAcreateserial -days 3650 -out "$D/${c%%:*}.crt"
  done
  echo "$(openssl rand -hex 16),admin,admin,system:masters" > "$D/tokens.csv"   # token,user,uid,"groups"
  touch "$D/pki.done"
fi
TOKEN=$(cut -d, -f1 "$D/tokens.csv")

# --- etcd ---
"$ETCD" --name test --data-dir "$D/etcd-data" \
  --listen-client-urls "http://127.0.0.1:$ETCD_PORT" --advertise-client-urls "http://127.0.0.1:$ETCD_PORT" \
  --listen-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" --initial-advertise-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" \
  --initial-cluster "test=http://127.0.0.1:$ETCD_PEER_PORT" \
  --unsafe-no-fsync --quota-backend-bytes 4294967296 --log-level warn > "$D/etcd.log" 2>&1 &
echo $! > "$D/etcd.pid"
for i in $(seq 1 200); do curl -sf "http://127.0.0.1:$ETCD_PORT/health" >/dev/null && break; alive "$(cat "$D/etcd.pid")" || break; sleep 0.05; done
curl -sf "http://127.0.0.1:$ETCD_PORT/health" >/dev/null || { echo "etcd did not start:" >&2; tail -20 "$D/etcd.log" >&2; exit 1; }
t1=$(ts)

# --- kube-apiserver ---
"$K8S_BIN/kube-apiserver" \
  --etcd-servers="http://127.0.0.1:$ETCD_PORT" \
  --bind-address=127.0.0.1 --advertise-address=127.0.0.1 --secure-port="$APISERVER_PORT" --insecure-port=0 \
  --tls-cert-file="$D/apiserver.crt" --tls-private-key-file="$D/apiserver.key" --client-ca-file="$D/ca.crt" \
  --token-auth-file="$D/tokens.csv" --authorization-mode=RBAC \
  --service-account-issuer=https://kubernetes.default.svc.cluster.local \
  --service-account-key-file="$D/sa.pub" --service-account-signing-key-file="$D/sa.key" \
  --api-audiences=https://kubernetes.default.svc.cluster.local \
  --service-cluster-ip-range="$K8S_SERVICE_CIDR" --allow-privileged=true \
  --disable-admission-plugins=ServiceAccount \
  --endpoint-reconciler-type=none --kubelet-preferred-address-types=InternalIP \
  --cert-dir="$D/certs" --v=1 > "$D/apiserver.log" 2>&1 &
echo $! > "$D/apiserver.pid"

kc_file() {  # kc_file FILE [client-cert-name]
  { echo "apiVersion: v1"; echo "kind: Config"; echo "clusters:"; echo "- name: test"; echo "  cluster:"
    echo "    server: https://127.0.0.1:$APISERVER_PORT"; echo "    certificate-authority: $D/ca.crt"
    echo "users:"; echo "- name: admin"; echo "  user:"
    if [ -n "${2:-}" ]; then echo "    client-certificate: $D/$2.crt"; echo "    client-key: $D/$2.key"
    else echo "    token: $TOKEN"; fi
    echo "contexts:"; echo "- name: test"; echo "  context: {cluster: test, user: admin, namespace: default}"
    echo "current-context: test"; } > "$1.tmp"
  mv -f "$1.tmp" "$1"
}
kc_file "$D/kubeconfig"; kc_file "$D/kcm.kubeconfig" kcm; kc_file "$D/sched.kubeconfig" sched

ok=
for i in $(seq 1 900); do
  if curl -sf --cacert "$D/ca.crt" -H "Authorization: Bearer $TOKEN" "https://127.0.0.1:$APISERVER_PORT/readyz" >/dev/null 2>&1; then ok=1; break; fi
  alive "$(cat "$D/apiserver.pid")" || break
  sleep 0.1
done
t2=$(ts)
[ -n "$ok" ] || { echo "kube-apiserver did not become ready; tail of log:" >&2; tail -30 "$D/apiserver.log" >&2; exit 1; }

if [ "$KCM" = 1 ]; then
  ctrls='*,-nodeipam,-cloud-node-lifecycle,-route,-service,-persistentvolume-binder,-attachdetach,-persistentvolume-expander,-ttl,-bootstrapsigner,-tokencleaner,-csrsigning'
  [ "$NODE_LIFECYCLE" = 1 ] || ctrls="$ctrls,-nodelifecycle"
  "$K8S_BIN/kube-controller-manager" --kubeconfig="$D/kcm.kubeconfig" --authentication-kubeconfig="$D/kcm.kubeconfig" \
    --authorization-kubeconfig="$D/kcm.kubeconfig" \
    --bind-address=127.0.0.1 --secure-port=0 --port=0 --leader-elect=false \
    --service-account-private-key-file="$D/sa.key" --root-ca-file="$D/ca.crt" \
    --use-service-account-credentials=true --controllers="$ctrls" --v=1 > "$D/kcm.log" 2>&1 &
  echo $! > "$D/kcm.pid"
fi
if [ "$SCHED" = 1 ]; then
  "$K8S_BIN/kube-scheduler" --kubeconfig="$D/sched.kubeconfig" --authentication-kubeconfig="$D/sched.kubeconfig" \
    --authorization-kubeconfig="$D/sched.kubeconfig" \
    --bind-address=127.0.0.1 --secure-port=0 --port=0 --leader-elect=false --v=1 > "$D/scheduler.log" 2>&1 &
  echo $! > "$D/scheduler.pid"
fi
# the 'default' namespace is created by the apiserver shortly after readyz
for i in $(seq 1 100); do KUBECONFIG="$D/kubeconfig" "$KUBECTL" get ns default >/dev/null 2>&1 && break; sleep 0.1; done
cat > "$D/env" <<ENV
export KUBECONFIG=$D/kubeconfig
export KUBECTL=$KUBECTL
export HELM=$K8S_BIN/helm
export K8S_BIN=$K8S_BIN
export APISERVER_PORT=$APISERVER_PORT
ENV
echo "etcd ready $(awk -v a="$t0" -v b="$t1" 'BEGIN{printf "%.2fs", b-a}'), apiserver ready $(awk -v a="$t1" -v b="$t2" 'BEGIN{printf "%.2fs", b-a}'), total $(el "$t0")" >&2
echo "KUBECONFIG=$D/kubeconfig"
