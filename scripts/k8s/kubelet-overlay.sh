#!/bin/bash
# Make a `go build -overlay` file that patches 4 kubelet source files WITHOUT touching the source tree:
#  1) kubelet_node_status.go: allow --node-ip=127.0.0.1 (upstream rejects loopback node IPs)
#  2) dockershim sandbox (pause) container: oom_score_adj -998 -> 0
#  3) dockershim app containers: clamp oom_score_adj to >= 0 (Guaranteed QoS pods get -997/-998)
#  4) kubelet.go: container GC every 5 s instead of every minute. The API object of a deleted pod is only removed
#     once its dead containers are gone; kubelet's per-event container deleter often keeps the last one, so pod
#     deletion took ~55 s (next 1-min GC) instead of ~5-10 s.
#  (2,3): root on these VMs lacks CAP_SYS_RESOURCE, so runc cannot set a negative oom_score_adj:
#  "runc create failed: unable to start container process: can't get final child's PID from pipe: EOF"
# Usage: SRC=.. WORK=.. kubelet-overlay.sh OVERLAY_DIR  -> prints path of overlay.json
set -euo pipefail
SRC=$(readlink -f "${SRC:?unpacked Debian kubernetes source dir}")
WORK=${WORK:?scratch GOPATH dir}
O=$(mkdir -p "$1" && readlink -f "$1")
p1=pkg/kubelet/kubelet_node_status.go; p2=pkg/kubelet/dockershim/docker_sandbox.go; p3=pkg/kubelet/dockershim/helpers_linux.go
p4=pkg/kubelet/kubelet.go
mkdir -p "$O/$(dirname $p1)" "$O/$(dirname $p2)"
sed 's/if nodeIP.IsLoopback() {/if nodeIP.IsLoopback() \&\& false {/' "$SRC/$p1" > "$O/$p1"
sed 's/defaultSandboxOOMAdj int = -998/defaultSandboxOOMAdj int = 0/' "$SRC/$p2" > "$O/$p2"
sed 's/createConfig.HostConfig.OomScoreAdj = int(rOpts.OomScoreAdj)/if createConfig.HostConfig.OomScoreAdj = int(rOpts.OomScoreAdj); createConfig.HostConfig.OomScoreAdj < 0 { createConfig.HostConfig.OomScoreAdj = 0 }/' "$SRC/$p3" > "$O/$p3"
sed 's/ContainerGCPeriod = time.Minute/ContainerGCPeriod = 5 * time.Second/' "$SRC/$p4" > "$O/$p4"
for p in $p1 $p2 $p3 $p4; do cmp -s "$SRC/$p" "$O/$p" && { echo "patch did not apply: $p" >&2; exit 1; }; done
{ echo '{"Replace": {'; sep=
  for p in $p1 $p2 $p3 $p4; do for base in "$SRC" "$WORK/src/k8s.io/kubernetes"; do
    printf '%s"%s": "%s"\n' "$sep" "$base/$p" "$O/$p"; sep=,; done; done
  echo '}}'; } > "$O/overlay.json"
echo "$O/overlay.json"
