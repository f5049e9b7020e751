"""Everything the tests share: real servers (`server`), in-process fake cores (`inproc`), checkpoints
and their corruptions, the Kubernetes tiers (`k8s`), and the operator harness (`operator_harness`).

`tests/` is a package: import these as `tests.support.X`, and never put `tests/` itself on
sys.path (`tests/operator/` would shadow the stdlib `operator`).
"""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
