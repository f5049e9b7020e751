#!/usr/bin/env bash
# THE demo command (README): sets everything up, then runs the local demo on the tiny model.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
exec "$ROOT/.venv/bin/python" "$ROOT/scripts/demo.py"
