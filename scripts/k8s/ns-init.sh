#!/bin/bash
# PID-recorded holder of the node tier's private network + mount namespace
# (started by node-up.sh via `unshare --net --mount --propagation private`): the only interface is `lo`,
# so nothing started in here can send traffic anywhere but 127.0.0.0/8 (and ::1).
# Redirects the few host paths kubelet 1.20 / dockershim hard-code into $S (the node state dir), so nothing is
# written outside it, hides the global sysctls kubelet would write, then sleeps forever.
set -euo pipefail
S=${S:?node state dir}
N=$S/ns
ip link set lo up
mkdir -p $N/varlog $N/varlib-upper $N/varlib-work $N/sysctl $N/containerd
# /var/log/pods + /var/log/containers are hard-coded in kubelet 1.20
mount --bind $N/varlog /var/log
# /var/lib/kubelet/device-plugins is hard-coded (device manager socket): copy-on-write overlay over /var/lib
mount -t overlay overlay -o lowerdir=/var/lib,upperdir=$N/varlib-upper,workdir=$N/varlib-work /var/lib
# never share a system containerd (dockerd would use /run/containerd/containerd.sock if it existed)
[ -d /run/containerd ] && mount --bind $N/containerd /run/containerd
# kubelet (protect-kernel-defaults=false) *writes* vm.overcommit_memory=1, kernel.panic=10, kernel.panic_on_oops=1 ...
# Hide the real (global, not namespaced) sysctls behind files that already hold kubelet's desired values.
for kv in vm/overcommit_memory=1 vm/panic_on_oom=0 kernel/panic=10 kernel/panic_on_oops=1 \
          kernel/keys/root_maxkeys=1000000 kernel/keys/root_maxbytes=25000000; do
  k=${kv%=*}; f=$N/sysctl/$(echo $k | tr / _); echo "${kv#*=}" > $f
  mount --bind $f /proc/sys/$k
done
echo ready > $N/ready
exec sleep infinity
