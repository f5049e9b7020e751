"""`python -m sampler_client push URL --checkpoint DIR --label LABEL [--step N] [--wait]`,
`python -m sampler_client push-adapter URL --run RUN --path DIR --label LABEL --step N [--servable all]`
and `python -m sampler_client status URL`: the client from a shell or a training script's hook.

The admin key comes from `--admin-key` or `SAMPLER_ADMIN_API_KEY` (the environment keeps it out of
`ps` and shell history). Exit status: 0 done, 1 the rollout stopped, was superseded or timed out,
2 the push was refused or the gateway unreachable (the pool is unchanged; for an adapter push, a
refusal: a 4xx naming the field).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict
from typing import Any

from .errors import PoolError
from .pool import (
    ADAPTER_PUSH_TIMEOUT_S,
    DEFAULT_TIMEOUT_S,
    Pool,
    RolloutStopped,
    RolloutSuperseded,
    RolloutTimeout,
)

ENV_ADMIN_KEY = "SAMPLER_ADMIN_API_KEY"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sampler_client",
                                description="Push weights or adapters to a sampler pool.")
    sub = p.add_subparsers(dest="command", required=True)
    push = sub.add_parser("push", help="set the pool's weights (POST /v1/pool/weights)")
    push.add_argument("url", help="the pool's gateway, e.g. http://policy-gateway:8080")
    push.add_argument("--checkpoint", required=True, help="checkpoint directory inside the replicas' pods")
    push.add_argument("--label", required=True, help="version label every sample on these weights carries")
    push.add_argument("--step", type=int, default=None, help="the trainer's step (reported back by status)")
    push.add_argument("--wait", action="store_true", help="return once every replica serves the label")
    push.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds to wait (with --wait)")
    adapter = sub.add_parser("push-adapter", help="declare a run's LoRA adapter version (POST /v1/pool/adapters); "
                                                  "returns once it is servable")
    adapter.add_argument("url", help="the pool's gateway")
    adapter.add_argument("--run", required=True, help="the training run whose adapter this is")
    adapter.add_argument("--path", required=True, help="the PEFT adapter directory inside the replicas' pods")
    adapter.add_argument("--label", required=True, help="the version's label (tinker://RUN/sampler_weights/LABEL)")
    adapter.add_argument("--step", type=int, required=True, help="the training step: newer than the run's newest")
    adapter.add_argument("--pinned", action="store_true", help="kept when the run's version cap drops old ones")
    adapter.add_argument("--servable", choices=["one", "all"], default="one",
                         help="return once loaded on one replica, or on every replica holding the run")
    adapter.add_argument("--timeout", type=float, default=ADAPTER_PUSH_TIMEOUT_S, help="seconds to wait")
    status = sub.add_parser("status", help="the pool's rollout (GET /v1/pool/rollout), as JSON")
    status.add_argument("url")
    for s in (push, adapter, status):
        s.add_argument("--admin-key", default=os.environ.get(ENV_ADMIN_KEY),
                       help=f"the pool's admin key (default: ${ENV_ADMIN_KEY})")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    pool = Pool(args.url, args.admin_key)
    try:
        if args.command == "status":
            out: dict[str, Any] = asdict(pool.status())
        elif args.command == "push-adapter":
            out = asdict(pool.push_adapter(args.run, args.path, args.label, args.step, pinned=args.pinned,
                                           servable=args.servable, timeout=args.timeout))
        else:
            out = asdict(pool.push(args.checkpoint, args.label, args.step, wait=args.wait, timeout=args.timeout))
    except (RolloutStopped, RolloutSuperseded, RolloutTimeout) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except PoolError as e:  # refused (RequestRefused) or unreachable: the pool is unchanged
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
