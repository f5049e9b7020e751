#!/bin/bash
# Stop what control-plane-up.sh started in STATE_DIR (recorded PIDs only) and drop the etcd data.
# FAST=1 sends SIGKILL at once (the state is throw-away anyway). PURGE=1 also removes STATE_DIR.
source "$(dirname "$0")/lib.sh"
D=$(readlink -f "${1:?usage: control-plane-down.sh STATE_DIR}")
[ -d "$D" ] || exit 0
for p in scheduler kcm apiserver etcd; do
  f="$D/$p.pid"; [ -f "$f" ] || continue
  pid=$(cat "$f")
  if [ -n "${FAST:-}" ]; then kill -9 "$pid" 2>/dev/null; fi
  stop_pid "$pid" 5
  rm -f "$f"
done
rm -rf "$D/etcd-data" "$D/env"
[ -n "${PURGE:-}" ] && rm -rf "$D"
exit 0
