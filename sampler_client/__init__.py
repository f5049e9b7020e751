"""The trainer's side of a sampler pool: push new weights through the pool's gateway and wait for them.

A training job has the gateway's address and the pool's admin key, not Kubernetes credentials. This
package is what it needs besides its sampling SDK (Tinker, Twinkle or the native routes): a push of
`spec.weights` (`POST /v1/pool/weights`), the rollout's progress (`GET /v1/pool/rollout`), and a clear
exception when the rollout stops. The Python standard library only: importable in any trainer's
environment, without vLLM, kopf or the Kubernetes client (tests/unit/test_sampler_client.py checks).

    from sampler_client import Pool
    pool = Pool("http://policy-gateway:8080", admin_key)
    pool.push("/checkpoints/step-120", "step-120", step=120)   # returns once every replica serves it
    pool.push_adapter("math-rl", "/checkpoints/math-rl/120", "step-120", 120).model_path  # a LoRA version

Weights over the network, no checkpoint (needs torch and vLLM; `sampler_client.weight_transfer`, imported
only then): `Pool(replica_url, admin_key).push_weights(model, "step-121", step=121, in_flight="keep")`.

Or `python -m sampler_client push URL --checkpoint ... --label ... --wait`, and
`python -m sampler_client push-adapter URL --run R --path P --label L --step N`.
"""

from .errors import PoolError, RequestRefused
from .pool import (
    AdapterPushed,
    Pool,
    ReplicaRollout,
    Rollout,
    RolloutStopped,
    RolloutSuperseded,
    RolloutTimeout,
    progress_lines,
)

__all__ = ["AdapterPushed", "Pool", "PoolError", "ReplicaRollout", "RequestRefused", "Rollout", "RolloutStopped",
           "RolloutSuperseded", "RolloutTimeout", "progress_lines"]
__version__ = "0.1.0"
