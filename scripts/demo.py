"""The local demo: a real vLLM sampler on the embedded tiny model, driven like an RL trainer would.

1. builds the tiny model locally (no download), 2. starts `python -m sampler_pod`,
3. sends 32 concurrent sampling requests, 4. pushes new weights (a checkpoint load),
5. samples again and shows the new weights version, 6. prints /health, then stops.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from sampler_pod.testing.tiny_model import cached_tiny_model
from tests.support.server import run_server


def main() -> None:
    model = cached_tiny_model()
    print(f"tiny model: {model}")
    ckpt_root = Path("/tmp/sampler-demo-checkpoints")
    ckpt_root.mkdir(exist_ok=True)
    print("starting the sampler server (vLLM CPU engine, ~20 s)...")
    with run_server(model, "--checkpoint-root", str(ckpt_root)) as server, server.client() as c:
        body = {"prompts": [[1, 20, 30, 40]], "num_samples": 4,
                "sampling_params": {"max_tokens": 64, "temperature": 1.0, "seed": 0}}
        t0 = time.perf_counter()
        with ThreadPoolExecutor(32) as pool:
            rs = list(pool.map(lambda _: c.post("/v1/sample", json=body), range(32)))
        wall = time.perf_counter() - t0
        toks = sum(len(s["tokens"]) for r in rs for res in r.json()["results"] for s in res["sequences"])
        print(f"32 concurrent requests x 4 samples: {toks} tokens in {wall:.2f}s ({toks / wall:.0f} tok/s)")
        seq = rs[0].json()["results"][0]["sequences"][0]
        print(f"first sample: tokens={seq['tokens'][:8]}... logprobs={[round(x, 2) for x in seq['logprobs'][:4]]}..."
              f" weights_version={seq['weights_version']}")
        demo_checkpoint_load(c, model, ckpt_root)
        print("health:", c.get("/health").json())
    print("server stopped; demo done")


def demo_checkpoint_load(c: httpx.Client, model: Path, ckpt_root: Path) -> None:
    try:
        from tests.support.checkpoints import perturbed_checkpoint
    except ImportError:
        return
    new = perturbed_checkpoint(model, ckpt_root / "step-1", scale=0.05, seed=1)
    r = c.post("/v1/checkpoints/load", json={"path": str(new), "version_label": "step-1"})
    print(f"checkpoint load: HTTP {r.status_code} {r.json()}")
    s = c.post("/v1/sample", json={"prompts": [[1, 2, 3]], "sampling_params": {"max_tokens": 8, "temperature": 0}})
    print(f"after load: weights_version={s.json()['weights_version']} label={s.json()['weights_label']}")


if __name__ == "__main__":
    main()
