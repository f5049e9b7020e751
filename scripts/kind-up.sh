#!/usr/bin/env bash
# For users WITH Docker and network access: a kind cluster running this project's images.
#   scripts/kind-up.sh            kind create cluster, build + kind load the images, helm install, apply an example
# CANNOT RUN on this project's CI machine: kind's node image (kindest/node) must be pulled from a registry,
# and there is none here. The project's own local cluster is the node tier: ./scripts/demo.sh.
# Needs: docker (with buildx or the classic builder), kind, kubectl, helm on PATH.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
CLUSTER=${KIND_CLUSTER:-sampler}
VERSION=$(awk -F'"' '/^appVersion:/{print $2}' "$ROOT/charts/sampler-operator/Chart.yaml")
REG=ghcr.io/sampler-operator
PY_BASE=python:3.11-slim-bookworm      # a public base with Debian's ABI, instead of build.sh's debootstrap

kind get clusters | grep -qx "$CLUSTER" || kind create cluster --name "$CLUSTER"

# The images, from the same Dockerfiles and locks CI builds (wheels from PyPI instead of a wheelhouse).
for name in operator sampler-cpu; do
  ctx=$(mktemp -d)
  cp "$ROOT/images/$name/Dockerfile" "$ROOT/images/$name/requirements.lock" "$ctx/"
  pip download --quiet --no-deps --dest "$ctx/wheels" -r "$ROOT/images/$name/requirements.lock" \
    --extra-index-url https://download.pytorch.org/whl/cpu
  src=$([ "$name" = operator ] && echo "$ROOT/operator/sampler_operator" || echo "$ROOT/sampler_pod")
  cp -r "$src" "$ctx/"
  docker build --build-arg "BASE_IMAGE=$PY_BASE" -t "$REG/$name:$VERSION" "$ctx"
  rm -rf "$ctx"
  kind load docker-image --name "$CLUSTER" "$REG/$name:$VERSION"
done

helm upgrade --install sampler-operator "$ROOT/charts/sampler-operator" -n sampler-system --create-namespace \
  --set image.pullPolicy=IfNotPresent --wait
# A replica on the CPU image with the deterministic fake engine (no GPU, no weights to download; an empty
# model directory). For real sampling: engine vllm, a hub id or a model volume, engineArgs.kvCacheMemoryBytes.
kubectl apply -f - <<YAML
apiVersion: sampler.rl.dev/v1alpha1
kind: SamplerReplica
metadata: {name: kind-fake-0}
spec:
  model: /models/fake
  image: $REG/sampler-cpu:$VERSION
  imagePullPolicy: IfNotPresent
  engine: fake
  pod:
    volumes: [{name: model, emptyDir: {}}]
    volumeMounts: [{name: model, mountPath: /models/fake}]
YAML
kubectl wait --for=jsonpath='{.status.phase}'=Ready sr/kind-fake-0 --timeout=300s
kubectl get sr
