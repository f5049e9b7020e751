#!/usr/bin/env bash
# Idempotent setup: a Python venv with vLLM for the CPU and every test dependency.
#
# The venv lives in a cache OUTSIDE the repository, keyed by the hash of the
# requirement files, so a re-run on the same machine (or a fresh clone in CI)
# reuses it in about a second. `.venv` in the repo is a symlink to it.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
CACHE="${SAMPLER_CACHE_DIR:-$HOME/.cache/sampler-operator}"
PY="${PYTHON:-python3}"
# Bump VENV_RECIPE when the install steps below change in a way that needs a rebuild.
VENV_RECIPE=2
HASH="$( (echo "$VENV_RECIPE"; cat "$ROOT/requirements/runtime.txt" "$ROOT/requirements/test.txt" "$ROOT/requirements/twinkle-client.txt") | sha256sum | cut -c1-16)"
VENV="$CACHE/venv-$HASH"

if [[ ! -f "$VENV/.complete" ]]; then
    echo "[setup] building venv $VENV (first run: ~8 min)" >&2
    rm -rf "$VENV"
    mkdir -p "$CACHE"
    "$PY" -m venv "$VENV"
    # torchvision is pinned only so the resolver does not backtrack; it is removed below.
    # (grep drops pip's warnings about this machine's optional local mirrors.)
    "$VENV/bin/pip" install --quiet -r "$ROOT/requirements/runtime.txt" -r "$ROOT/requirements/test.txt" \
        torchvision==0.28.0 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }
    # PyPI's torchvision/torchaudio/torchcodec are not built against the CPU torch and make
    # `import vllm` fail; triton has no CPU backend and is 1 GB.
    "$VENV/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec triton || true
    # Twinkle's client without twinkle-kit's trainer dependencies (see requirements/twinkle-client.txt).
    "$VENV/bin/pip" install --quiet --no-deps -r "$ROOT/requirements/twinkle-client.txt" 2>&1 \
        | { grep -v "is ignored: it is neither a file nor a directory" || true; }
    "$VENV/bin/python" -c "import twinkle_client.sampler, twinkle_client.manager" >&2
    "$VENV/bin/python" -c "import vllm, torch, fastapi, kopf, tinker; print('[setup] vllm', vllm.__version__, 'torch', torch.__version__)" >&2
    touch "$VENV/.complete"
fi

# Light layers on top (lint/type tools; see each file's header): their own stamp, so adding one is a
# quick incremental pip install instead of a rebuild of the whole venv.
for layer in "$ROOT"/requirements/tools.txt; do
    [[ -f "$layer" ]] || continue
    STAMP="$VENV/.layer-$(basename "$layer" .txt)-$(sha256sum "$layer" | cut -c1-16)"
    if [[ ! -f "$STAMP" ]]; then
        echo "[setup] installing $(basename "$layer") into the venv" >&2
        "$VENV/bin/pip" install --quiet -r "$layer" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }
        rm -f "$VENV/.layer-$(basename "$layer" .txt)-"*
        touch "$STAMP"
    fi
done

# The project itself: a .pth file instead of `pip install -e .`, so switching
# between clones that share the cached venv is instant and needs no build backend.
SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
printf '%s\n%s\n' "$ROOT" "$ROOT/operator" > "$SITE/sampler_operator_dev.pth"
ln -sfn "$VENV" "$ROOT/.venv"
echo "[setup] ok: $ROOT/.venv -> $VENV" >&2
