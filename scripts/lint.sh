#!/usr/bin/env bash
# Lint (ruff: style, bugs, import order) and types (mypy --strict on sampler_common, sampler_pod, sampler_gateway,
# sampler_client, the operator and the examples), both configured in pyproject.toml.
# Run by scripts/test.sh after the engine tier (beside the node tier's vLLM tests), before the other tiers.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
bash scripts/setup.sh
export PYTHONPATH="$ROOT:$ROOT/operator${PYTHONPATH:+:$PYTHONPATH}"
echo "=== ruff" >&2
.venv/bin/ruff check .
echo "=== mypy" >&2
.venv/bin/mypy
