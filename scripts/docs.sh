#!/bin/bash
# Render what the docs generate from their committed sources:
#   docs/architecture.dot -> docs/architecture.png (graphviz `dot`, Debian's package)
#   docs/reference/*.md   <- the CRDs, the config classes, docs/openapi.json, the metrics (scripts/gen_reference.py)
#   scripts/docs.sh           render (installs graphviz if missing)
#   scripts/docs.sh --check   exit 1 if a committed file differs from a fresh render (CI, tests/unit/test_docs.py,
#                             tests/unit/test_reference.py)
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
PYTHONPATH="$REPO_ROOT:$REPO_ROOT/operator" "$REPO_ROOT/.venv/bin/python" "$REPO_ROOT/scripts/gen_reference.py" \
  ${1:+"$1"} || status=1
exit $status
