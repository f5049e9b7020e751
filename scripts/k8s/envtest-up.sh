#!/bin/bash
# envtest tier: etcd + kube-apiserver + kube-controller-manager (garbage collector, namespace controller,
# SA tokens) on 127.0.0.1 in the host network namespace; no kubelet, no scheduler: pods stay Pending.
# Usage: envtest-up.sh STATE_DIR      -> STATE_DIR/kubeconfig, STATE_DIR/env (sourceable: KUBECONFIG, KUBECTL, HELM)
# env: APISERVER_PORT / ETCD_PORT / ETCD_PEER_PORT (default: free ports), KCM=0 to skip the controller-manager.
# Needs scripts/k8s/build.sh once (SKIP_IMAGES=1 is enough). Stop: envtest-down.sh STATE_DIR
exec "$(dirname "$0")/control-plane-up.sh" "$@"
