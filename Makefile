# Convenience targets; the scripts are the source of truth.
.PHONY: setup prepare lock demo demo-local test unit engine k8s-build images lint-images docs cluster-up cluster-down bench

setup:          ; bash scripts/setup.sh
# the venv, the Kubernetes binaries and the images (what demo.sh and test.sh build first)
prepare:        ; bash scripts/prepare.sh
# requirements/lock.txt from requirements/*.txt (docs/development.md, "Dependencies")
lock:           ; bash scripts/lock.sh
demo:           ; bash scripts/demo.sh
demo-local:     ; bash scripts/demo.sh --local
test:           ; bash scripts/test.sh
unit: setup     ; .venv/bin/python -m pytest tests/unit -q
engine: setup   ; .venv/bin/python -m pytest tests/engine -q
k8s-build:      ; bash scripts/k8s/build.sh
# the operator and CPU sampler images (cached by input hash); hadolint on all three Dockerfiles
images:         ; bash scripts/images/build.sh
lint-images:    ; bash scripts/images/hadolint.sh
docs:           ; bash scripts/docs.sh
# The real single-node cluster (kubelet + dockershim) in a private netns with only `lo`.
cluster-up: k8s-build ; bash scripts/k8s/node-up.sh
cluster-down:   ; bash scripts/k8s/node-down.sh
bench: setup
	.venv/bin/python -m bench.weight_swap
	.venv/bin/python -m bench.protocols
	.venv/bin/python -m bench.operator_replacement
	.venv/bin/python -m bench.lora_push
	.venv/bin/python -m bench.lora_throughput
	.venv/bin/python -m bench.fairness
