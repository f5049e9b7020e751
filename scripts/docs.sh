#!/bin/bash
# Render the documentation pictures from their committed sources (graphviz `dot`, Debian's package):
#   docs/architecture.dot -> docs/architecture.png
#   scripts/docs.sh           render (installs graphviz if missing)
#   scripts/docs.sh --check   exit 1 if a committed PNG differs from a fresh render (CI, tests/unit/test_docs.py)
set -euo pipefail
source "$(dirname "$0")/k8s/lib.sh"
command -v dot >/dev/null || apt_install graphviz
status=0
for src in "$REPO_ROOT"/docs/*.dot; do
  png=${src%.dot}.png
  if [ "${1:-}" = --check ]; then
    tmp=$(mktemp --suffix .png)
    dot -Tpng -o "$tmp" "$src"
    cmp -s "$tmp" "$png" || { echo "[docs] stale: ${png#$REPO_ROOT/} (run scripts/docs.sh)" >&2; status=1; }
    rm -f "$tmp"
  else
    dot -Tpng -o "$png" "$src"; echo "[docs] ${png#$REPO_ROOT/}" >&2
  fi
done
exit $status
