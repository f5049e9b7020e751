#!/usr/bin/env bash
# Idempotent setup: a Python venv with vLLM for the CPU and every test dependency.
#
# The venv lives in a cache OUTSIDE the repository, keyed by the hash of the
# dependency lock (requirements/lock.txt), so a re-run on the same machine (or a fresh clone in CI)
# reuses it in about a second. `.venv` in the repo is a symlink to it.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
CACHE="${SAMPLER_CACHE_DIR:-$HOME/.cache/sampler-operator}"
PY="${PYTHON:-python3}"
# The venv is requirements/lock.txt, nothing more and nothing less (scripts/lock.sh writes it; a test
# compares `pip freeze` with it). Bump VENV_RECIPE when the install steps below change.
VENV_RECIPE=4
# Comment lines (the header, the "# via" notes) do not change what is installed: not in the key.
HASH="$( (echo "$VENV_RECIPE"; grep -vE "^\s*#" "$ROOT/requirements/lock.txt") | sha256sum | cut -c1-16)"
VENV="$CACHE/venv-$HASH"

mkdir -p "$CACHE"
# Two setups at once (two clones, a test run and a shell) would build the same venv over each other.
exec 9>"$CACHE/.setup.lock"
flock -w 1800 9 || { echo "[setup] could not lock $CACHE/.setup.lock" >&2; exit 1; }
if [[ ! -f "$VENV/.complete" ]]; then
    echo "[setup] building venv $VENV from requirements/lock.txt (first run: a few minutes)" >&2
    rm -rf "$VENV"
    "$PY" -m venv "$VENV"
    # --no-deps: the lock is the whole closure, already resolved (with torchvision, torchaudio,
    # torchcodec and triton left out on purpose: scripts/lock.sh says why). --require-hashes: every
    # file is the one that was locked. The torch CPU wheel comes from $SAMPLER_TORCH_WHEELS (default
    # /opt/wheels), as when the lock was made.
    # uv installs it (the lock pins uv too): it downloads in parallel and byte-compiles on every core,
    # where pip took minutes on the fresh-machine critical path. pip installs uv itself first, from the
    # lock's own pin and hashes. (grep drops pip's warnings about this machine's optional local mirrors.)
    WHEELS="${SAMPLER_TORCH_WHEELS:-/opt/wheels}"
    FIND=(); [[ -d "$WHEELS" ]] && FIND=(--find-links "$WHEELS")
    "$VENV/bin/pip" install --quiet --no-deps --require-hashes \
        -r <(awk '/^uv==/ {p = 1} p {print} p && !/\\$/ {exit}' "$ROOT/requirements/lock.txt") 2>&1 \
        | { grep -v "is ignored: it is neither a file nor a directory" || true; }
    "$VENV/bin/uv" pip install --quiet --python "$VENV/bin/python" --no-deps --require-hashes --compile-bytecode \
        "${FIND[@]}" -r "$ROOT/requirements/lock.txt"
    "$VENV/bin/python" -c "import twinkle_client.sampler, twinkle_client.manager" >&2
    "$VENV/bin/python" -c "import vllm, torch, fastapi, kopf, tinker; print('[setup] vllm', vllm.__version__, 'torch', torch.__version__)" >&2
    touch "$VENV/.complete"
fi

# The project itself: a .pth file instead of `pip install -e .`, so switching
# between clones that share the cached venv is instant and needs no build backend.
SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
printf '%s\n%s\n' "$ROOT" "$ROOT/operator" > "$SITE/sampler_operator_dev.pth"
ln -sfn "$VENV" "$ROOT/.venv"
exec 9>&-
echo "[setup] ok: $ROOT/.venv -> $VENV" >&2
