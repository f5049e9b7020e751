#!/bin/bash
# Stop everything node-up.sh started: kube-proxy, kubelet, all containers, dockerd (+ its containerd), the
# control plane, anything else still inside the private netns (started by us, e.g. an operator run via
# node-exec.sh), and finally the namespace holder (its mounts go with it). Only recorded PIDs / processes in OUR netns are killed.
# Keeps docker's data-root (imported images) for a fast next start; PURGE=1 removes the whole state dir.
# Usage: node-down.sh [STATE_DIR]
source "$(dirname "$0")/lib.sh"
S=${1:-${K8S_NODE_STATE:-$K8S_CACHE/node}}
[ -d "$S" ] || { echo "nothing to stop ($S missing)"; exit 0; }
S=$(readlink -f "$S"); R=$S/run
NSP=$(cat "$R/ns.pid" 2>/dev/null || true)
# (kube-proxy's iptables rules and route live in the netns: they go with it)
[ -f "$R/kube-proxy.pid" ] && stop_pid "$(cat "$R/kube-proxy.pid")" 5
[ -f "$R/kubelet.pid" ] && stop_pid "$(cat "$R/kubelet.pid")" 10
if [ -S "$R/docker.sock" ] && [ -f "$R/dockerd.pid" ] && alive "$(cat "$R/dockerd.pid")"; then
  export DOCKER_HOST=unix://$R/docker.sock
  ids=$(timeout 20 docker ps -aq 2>/dev/null); [ -n "$ids" ] && timeout 60 docker rm -f $ids >/dev/null 2>&1
fi
[ -f "$R/dockerd.pid" ] && stop_pid "$(cat "$R/dockerd.pid")" 15
"$K8S_SCRIPTS/control-plane-down.sh" "$S/state"
# anything else still inside our network namespace was started by us (node-exec.sh, a stray containerd-shim ...)
if alive "$NSP"; then
  nsino=$(stat -Lc %i "/proc/$NSP/ns/net")
  for p in $(ls /proc | grep -E '^[0-9]+$'); do
    [ "$p" = "$NSP" ] && continue
    [ "$(stat -Lc %i "/proc/$p/ns/net" 2>/dev/null)" = "$nsino" ] && { echo "[node] stopping leftover: $p $(tr '\0' ' ' < "/proc/$p/cmdline" 2>/dev/null | cut -c1-120)"; stop_pid "$p" 5; }
  done
  stop_pid "$NSP" 5
fi
rm -rf "$R" "$S/env" "$S/ns/ready" "$S/kubelet/pods" "$S/dockershim" "$S/logs.prev"
[ -d "$S/logs" ] && mv "$S/logs" "$S/logs.prev"
if [ -n "${PURGE:-}" ]; then rm -rf "$S"; fi
echo "[node] stopped"
