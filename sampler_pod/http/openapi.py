"""Write the server's OpenAPI spec to docs/openapi.json (or stdout with `-`), generated from the app.

The committed spec is what clients and the fuzz tests read; tests/unit/test_openapi.py fails when
it drifts from the code. Regenerate after changing a route or a request model:
    .venv/bin/python -m sampler_pod.http.openapi
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from ..config import ServerConfig
from ..core.sampler import SamplerCore
from .app import create_app

SPEC_PATH = Path(__file__).resolve().parents[2] / "docs" / "openapi.json"


def spec() -> dict[str, Any]:
    async def no_start(_core: SamplerCore) -> None:
        return None

    # The spec depends on the code only, never on the configuration.
    openapi: dict[str, Any] = create_app(ServerConfig(model="model", engine="fake"), no_start).openapi()
    return openapi


def render() -> str:
    return json.dumps(spec(), indent=2, sort_keys=True) + "\n"


if __name__ == "__main__":
    if sys.argv[1:] == ["-"]:
        sys.stdout.write(render())
    else:
        SPEC_PATH.write_text(render())
        print(f"wrote {SPEC_PATH}")
