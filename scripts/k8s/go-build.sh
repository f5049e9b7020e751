#!/bin/bash
# Build Kubernetes v1.20.2 binaries from Debian bookworm's `kubernetes` source package, fully offline,
# with Debian's Go 1.19 in GOPATH mode (GO111MODULE=off), as upstream's hack/ scripts did for 1.20.
# Adapted from the measured recipe (reference k8s-envtest/build-kube-apiserver.sh, real-node/build-k8s.sh).
# Usage: SRC=<unpacked source> OUT=<bin dir> WORK=<GOPATH scratch> [GOCACHE=..] [GOFLAGS=-overlay=..] go-build.sh TARGET...
set -euo pipefail
SRC=$(readlink -f "${SRC:?unpacked Debian kubernetes source dir}")
OUT=${OUT:?bin dir}
WORK=${WORK:?scratch GOPATH dir}
[ $# -gt 0 ] || { echo "usage: go-build.sh TARGET..." >&2; exit 2; }
mkdir -p "$OUT" "$WORK/src/k8s.io" "$WORK/bin"
ln -sfn "$SRC" "$WORK/src/k8s.io/kubernetes"
export GO111MODULE=off GOPATH="$WORK" GOPROXY=off CGO_ENABLED=0 GOFLAGS=${GOFLAGS:-}
export GOCACHE=${GOCACHE:-$WORK/gocache}
cd "$WORK/src/k8s.io/kubernetes"

# 0) vendored github.com/modern-go/reflect2 v1.0.1 crashes (SIGSEGV in mapiterinit, e.g. on the first
#    custom-resource create) when built with Go >= 1.18: swap in Debian's 1.0.2 (golang-github-modern-go-reflect2-dev)
R2=/usr/share/gocode/src/github.com/modern-go/reflect2
if [ ! -f vendor/github.com/modern-go/reflect2/go_above_118.go ]; then
  [ -f "$R2/go_above_118.go" ] || { echo "apt-get install golang-github-modern-go-reflect2-dev first" >&2; exit 1; }
  find vendor/github.com/modern-go/reflect2 -maxdepth 1 -type f \( -name '*.go' -o -name '*.s' \) -delete
  cp "$R2"/*.go vendor/github.com/modern-go/reflect2/
fi

# 1) the one generated file the tarball lacks: pkg/generated/openapi/zz_generated.openapi.go
#    (same inputs as Makefile.generated_files' KUBE openapi target)
OAPI=pkg/generated/openapi/zz_generated.openapi.go
if [ ! -s "$OAPI" ]; then
  GOFLAGS= go build -o "$WORK/bin/openapi-gen" ./vendor/k8s.io/kube-openapi/cmd/openapi-gen
  dirs=$(find -H . \( -path ./_\* -o -path ./.\* -o -path ./vendor \) -prune -o -type f -name '*.go' -print \
         | sed 's|^./staging/src|vendor|; s|^\./||' \
         | grep -v -e '^vendor/k8s.io/code-generator/' -e '^vendor/k8s.io/sample-apiserver/' \
         | xargs grep --color=never -l '^// *+k8s:openapi-gen=' | xargs -n1 dirname | LC_ALL=C sort -u \
         | sed 's|^|k8s.io/kubernetes/|' | paste -sd, -)
  "$WORK/bin/openapi-gen" --logtostderr -i "$dirs" -p k8s.io/kubernetes/pkg/generated/openapi \
     -O zz_generated.openapi -h vendor/k8s.io/code-generator/hack/boilerplate.go.txt \
     -r "$WORK/openapi_violations.report"
fi

# 2) version stamping, as hack/lib/version.sh does (both packages; /version is served from client-go's)
LDF="-s -w"
for V in k8s.io/kubernetes/vendor/k8s.io/client-go/pkg/version k8s.io/kubernetes/vendor/k8s.io/component-base/version; do
  LDF="$LDF -X $V.gitVersion=v1.20.2 -X $V.gitMajor=1 -X $V.gitMinor=20 -X $V.gitTreeState=clean"
  LDF="$LDF -X $V.gitCommit=faecb196815e248d3ecfb03c680a4507229c2a56 -X $V.buildDate=2021-01-13T13:20:00Z"
done
for t in "$@"; do
  t0=$(date +%s)
  go build -trimpath -ldflags "$LDF" -o "$OUT/$t.tmp" "./cmd/$t"
  mv -f "$OUT/$t.tmp" "$OUT/$t"
  echo "[k8s] built $t in $(( $(date +%s) - t0 ))s" >&2
done
