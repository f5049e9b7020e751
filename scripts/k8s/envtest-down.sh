#!/bin/bash
# Stop the envtest tier started by envtest-up.sh STATE_DIR (recorded PIDs only). PURGE=1 removes STATE_DIR.
exec "$(dirname "$0")/control-plane-down.sh" "$@"
