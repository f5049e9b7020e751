#!/bin/bash
# Node tier: a REAL single-node Kubernetes v1.20.2 cluster -- etcd, kube-apiserver, kube-controller-manager
# (incl. node-lifecycle), kube-scheduler, dockerd, patched kubelet with dockershim, kube-proxy (iptables mode:
# Services' ClusterIPs answer) -- ALL inside a private network + mount namespace whose only interface is `lo`
# (ns-init.sh). Images come from `docker import`
# of the cached root-fs tarballs (make-images.sh) and `docker load` of the project's images
# (scripts/images/build.sh): no registry.
# Usage: node-up.sh [STATE_DIR]    (default ${K8S_NODE_STATE:-$SAMPLER_CACHE_DIR/k8s/node}); idempotent.
# Then:  scripts/k8s/node-exec.sh kubectl get pods        (anything that talks to the cluster or to pods)
# Stop:  scripts/k8s/node-down.sh [STATE_DIR]
# env: NODE_NAME (default sampler-node), KUBELET_V (2), DOCKER_STORAGE_DRIVER (overlay2; vfs on an overlayfs)
set -euo pipefail
source "$(dirname "$0")/lib.sh"
S=${1:-${K8S_NODE_STATE:-$K8S_CACHE/node}}; S=$(mkdir -p "$S" && readlink -f "$S")
D=$S/state; R=$S/run; L=$S/logs
NODE_NAME=${NODE_NAME:-sampler-node}
T0=$(ts)
for b in kube-apiserver kube-controller-manager kube-scheduler kubelet kube-proxy kubectl; do [ -x "$K8S_BIN/$b" ] || need=1; done
[ -f "$K8S_IMAGES/images.list" ] || need=1
[ -z "${need:-}" ] || "$K8S_SCRIPTS/build.sh"
export KUBECONFIG=$D/kubeconfig

if [ -f "$R/ns.pid" ] && alive "$(cat "$R/ns.pid")"; then
  if "$K8S_SCRIPTS/node-exec.sh" --state "$S" kubectl get node "$NODE_NAME" >/dev/null 2>&1; then
    echo "node tier already up in $S"; exit 0
  fi
  echo "[node] stale node tier in $S: stopping it first" >&2
  "$K8S_SCRIPTS/node-down.sh" "$S" >/dev/null
fi
rm -rf "$R"; mkdir -p "$R" "$L" "$D" "$S/kubelet" "$S/dockershim" "$S/cni/net.d" "$S/cni/bin" "$S/cni/cache"
trap 'rc=$?; [ $rc = 0 ] || { echo "[node] node-up failed (logs: $L); stopping what it started" >&2; "$K8S_SCRIPTS/node-down.sh" "$S" >&2; }; exit $rc' EXIT

# 1) namespace holder (private netns with only lo + private mount ns)
rm -f "$S/ns/ready"
S=$S unshare --net --mount --propagation private "$K8S_SCRIPTS/ns-init.sh" > "$L/ns.log" 2>&1 &
echo $! > "$R/ns.pid"
for i in $(seq 100); do [ -f "$S/ns/ready" ] && break; sleep 0.05; done
[ -f "$S/ns/ready" ] || { echo "namespace setup failed:"; cat "$L/ns.log"; exit 1; }
NS=(nsenter -t "$(cat "$R/ns.pid")" -n -m --)

# 2) dockerd (background; it starts its own containerd under the exec-root)
echo '{}' > "$R/daemon.json"
# overlay2 cannot sit on an overlayfs (e.g. when this machine is itself a container with an overlay root): use vfs there
if [ -z "${DOCKER_STORAGE_DRIVER:-}" ]; then
  mkdir -p "$S/docker-data"
  case "$(stat -f -c %T "$S/docker-data")" in overlayfs|overlay) DOCKER_STORAGE_DRIVER=vfs;; *) DOCKER_STORAGE_DRIVER=overlay2;; esac
fi
t=$(ts)
"${NS[@]}" dockerd --config-file "$R/daemon.json" --data-root "$S/docker-data" --exec-root "$R/docker-exec" \
  --host "unix://$R/docker.sock" --pidfile "$R/docker.pid" \
  --bridge=none --iptables=false --ip-masq=false --ip6tables=false \
  --exec-opt native.cgroupdriver=cgroupfs --storage-driver=$DOCKER_STORAGE_DRIVER ${DOCKERD_EXTRA:-} > "$L/dockerd.log" 2>&1 &
echo $! > "$R/dockerd.pid"

# 3) etcd + apiserver + controller-manager (with node-lifecycle) + scheduler, in parallel with dockerd's start
"${NS[@]}" env APISERVER_PORT=6443 ETCD_PORT=2379 ETCD_PEER_PORT=2380 KCM=1 SCHED=1 NODE_LIFECYCLE=1 \
  "$K8S_SCRIPTS/control-plane-up.sh" "$D" 2>&1 | sed 's/^/[node]   control plane: /' >&2
[ "${PIPESTATUS[0]}" = 0 ] || exit 1
echo "[node] control plane up: $(el $T0)" >&2
export DOCKER_HOST=unix://$R/docker.sock
for i in $(seq 300); do docker version >/dev/null 2>&1 && break; alive "$(cat "$R/dockerd.pid")" || break; sleep 0.1; done
docker version >/dev/null 2>&1 || { echo "dockerd failed"; tail "$L/dockerd.log"; exit 1; }
echo "[node] dockerd up: $(el $t) after its start" >&2

# 4) images: docker import of the cached tarballs, skipped when the tag already holds the same tarball
t=$(ts)
while IFS='|' read -r tag tar change; do
  [ "$(docker image inspect -f '{{index .Config.Labels "local.tarball"}}' "$tag" 2>/dev/null)" = "$(basename "$tar")" ] && continue
  docker import -c "$change" -c "LABEL local.tarball=$(basename "$tar")" "$tar" "$tag" >/dev/null
  echo "[node]   imported $tag" >&2
done < "$K8S_IMAGES/images.list"
# the project's images (scripts/images/build.sh: `docker save` tarballs keyed by their inputs' hash):
# `docker load` only when the tag does not already hold those inputs
IMG_LIST=$SAMPLER_CACHE_DIR/images/images.list
if [ -f "$IMG_LIST" ]; then
  while IFS='|' read -r tag tar inputs; do
    [ "$(docker image inspect -f '{{index .Config.Labels "sampler-operator.inputs"}}' "$tag" 2>/dev/null)" = "$inputs" ] && continue
    tl=$(ts); docker load -q -i "$tar" >/dev/null
    echo "[node]   loaded $tag ($(el $tl))" >&2
  done < "$IMG_LIST"
else
  echo "[node]   no project images yet ($IMG_LIST): run scripts/images/build.sh" >&2
fi
docker image prune -f >/dev/null 2>&1 || true
echo "[node] images ready: $(el $t)" >&2

# 5) kubelet (patched: --node-ip=127.0.0.1 allowed, negative oom_score_adj clamped), dockershim
KUBELET_FLAGS=(
  --kubeconfig="$D/kubeconfig"                     # static admin token (test cluster only)
  --container-runtime=docker                       # built-in dockershim
  --docker-endpoint="unix://$R/docker.sock"
  --container-runtime-endpoint="unix://$R/dockershim.sock"
  --experimental-dockershim-root-directory="$S/dockershim"
  --docker="unix://$R/docker.sock"                 # cadvisor's own docker client
  --docker-root="$S/docker-data"
  --pod-infra-container-image=local/pause:3.4
  --root-dir="$S/kubelet" --cert-dir="$S/kubelet/pki"
  --volume-plugin-dir="$S/kubelet/volume-plugins"
  --hostname-override="$NODE_NAME" --node-ip=127.0.0.1
  --address=127.0.0.1 --port=10250 --read-only-port=0 --healthz-bind-address=127.0.0.1 --healthz-port=10248
  --anonymous-auth=true --authorization-mode=AlwaysAllow   # bound to 127.0.0.1 of the private netns
  --fail-swap-on=false --cgroup-driver=cgroupfs
  --cgroups-per-qos=false --enforce-node-allocatable=
  --make-iptables-util-chains=false
  --cni-conf-dir="$S/cni/net.d" --cni-bin-dir="$S/cni/bin" --cni-cache-dir="$S/cni/cache"
  --node-status-update-frequency=2s
  --image-gc-high-threshold=100 --image-gc-low-threshold=99   # never GC the imported (unpullable) images
  --eviction-hard= --v="${KUBELET_V:-2}"
)
t=$(ts)
"${NS[@]}" env AWS_EC2_METADATA_DISABLED=true "$K8S_BIN/kubelet" "${KUBELET_FLAGS[@]}" > "$L/kubelet.log" 2>&1 &
echo $! > "$R/kubelet.pid"
K=("${NS[@]}" env KUBECONFIG="$D/kubeconfig" "$K8S_BIN/kubectl")
for i in $(seq 600); do
  [ "$("${K[@]}" get node "$NODE_NAME" -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}' 2>/dev/null)" = True ] && break
  alive "$(cat "$R/kubelet.pid")" || { echo "kubelet died:"; tail -20 "$L/kubelet.log"; exit 1; }
  sleep 0.2
done
[ "$("${K[@]}" get node "$NODE_NAME" -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}')" = True ] \
  || { echo "node not Ready:"; tail -20 "$L/kubelet.log"; exit 1; }
echo "[node] node Ready: $(el $t) after kubelet start" >&2
# the node.kubernetes.io/not-ready taint is removed by the node-lifecycle controller
for i in $(seq 300); do [ -z "$("${K[@]}" get node "$NODE_NAME" -o jsonpath='{.spec.taints}')" ] && break; sleep 0.2; done
# pods need the default service account (token controller) before they can be created
for i in $(seq 300); do "${K[@]}" -n default get sa default >/dev/null 2>&1 && break; sleep 0.2; done

# 6) kube-proxy (iptables mode), so a Service's ClusterIP answers inside the netns, as on a real node.
# The ClusterIPs (K8S_SERVICE_CIDR, the apiserver's --service-cluster-ip-range) need a route, or connect()
# fails with ENETUNREACH before kube-proxy's nat OUTPUT rules ever see the packet. The route goes through `lo`
# (no new interface: nothing can leave the netns). Its source is 127.0.0.2, not 127.0.0.1: the endpoints of
# hostNetwork pods are 127.0.0.1, and kube-proxy masquerades a connection whose source is its endpoint's own
# address (hairpin); MASQUERADE out of `lo` finds no address of scope below `host` there and DROPS the packet
# (seen: the ClusterIP timed out). Without a source the kernel picks 0.0.0.0 and answers never come back.
# A route through `lo` delivers locally, so a ClusterIP would otherwise reach any listener on 0.0.0.0 at the
# same port WITHOUT kube-proxy: what still arrives addressed to the service range (no DNAT of kube-proxy
# rewrote it) is refused, so a ClusterIP answers only through kube-proxy.
"${NS[@]}" ip route add "$K8S_SERVICE_CIDR" dev lo src 127.0.0.2
"${NS[@]}" iptables -w -A INPUT -d "$K8S_SERVICE_CIDR" -p tcp -j REJECT --reject-with tcp-reset
"${NS[@]}" iptables -w -A INPUT -d "$K8S_SERVICE_CIDR" -j REJECT
# The endpoints of hostNetwork pods are 127.0.0.1:<port>: the apiserver refuses loopback addresses in an
# Endpoints object (validateNonSpecialIP), but not in an EndpointSlice, which kube-proxy 1.20 reads
# (EndpointSliceProxying is on by default). kube-proxy sets route_localnet=1 (for NodePorts on 127.0.0.1;
# net.ipv4.conf.* belong to this netns); the DNAT of a local connection to 127.0.0.1 works without it.
# What it must NOT touch, being global or read-only outside the initial netns: nf_conntrack_max and the
# hashsize module parameter (--conntrack-max-per-core=0 leaves them as they are; writing nf_conntrack_max fails
# here and would stop kube-proxy), the conntrack TCP timeouts (0: left as they are), the host's OOM policy
# (--oom-score-adj=0: no negative score for a test process).
KUBE_PROXY_FLAGS=(
  --kubeconfig="$D/kubeconfig" --proxy-mode=iptables
  --hostname-override="$NODE_NAME" --bind-address=127.0.0.1
  --healthz-bind-address=127.0.0.1:10256 --metrics-bind-address=127.0.0.1:10249
  --conntrack-max-per-core=0 --conntrack-tcp-timeout-established=0 --conntrack-tcp-timeout-close-wait=0
  --oom-score-adj=0 --v="${KUBE_PROXY_V:-2}"
)
t=$(ts)
"${NS[@]}" "$K8S_BIN/kube-proxy" "${KUBE_PROXY_FLAGS[@]}" > "$L/kube-proxy.log" 2>&1 &
echo $! > "$R/kube-proxy.pid"
# Ready once its first sync wrote its nat chains (it has read the Services and EndpointSlices by then).
for i in $(seq 300); do
  "${NS[@]}" iptables -w -t nat -S KUBE-SERVICES >/dev/null 2>&1 && break
  alive "$(cat "$R/kube-proxy.pid")" || { echo "kube-proxy died:"; tail -20 "$L/kube-proxy.log"; exit 1; }
  sleep 0.1
done
"${NS[@]}" iptables -w -t nat -S KUBE-SERVICES >/dev/null 2>&1 \
  || { echo "kube-proxy wrote no rules:"; tail -20 "$L/kube-proxy.log"; exit 1; }
echo "[node] kube-proxy synced: $(el $t) after its start" >&2
cat > "$S/env" <<ENV
export K8S_NODE_STATE=$S
export KUBECONFIG=$D/kubeconfig
export DOCKER_HOST=unix://$R/docker.sock
export NODE_NAME=$NODE_NAME
export KUBECTL=$K8S_BIN/kubectl
export HELM=$K8S_BIN/helm
ENV
echo "[node] WHOLE STACK READY in $(el $T0) (state $S; use scripts/k8s/node-exec.sh CMD...)" >&2
