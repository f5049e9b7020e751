"""`python -m sampler_operator`: run the operator with the project's kopf settings.

Equivalent to `kopf run -m sampler_operator.handlers ...` plus sane defaults: a liveness
endpoint for the Deployment's probe, and peering (several operator replicas, one active).
"""
from __future__ import annotations

import argparse
import os
import random

import kopf

from sampler_common import rollout_trace


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    env = os.environ.get
    p = argparse.ArgumentParser(prog="python -m sampler_operator", description=__doc__)
    p.add_argument("-n", "--namespace", action="append", default=None,
                   help="namespace to watch (repeatable, globs allowed); default: $SAMPLER_OPERATOR_NAMESPACES "
                        "(comma-separated) or all namespaces")
    p.add_argument("-A", "--all-namespaces", action="store_true", help="watch the whole cluster")
    p.add_argument("--liveness", default=env("SAMPLER_OPERATOR_LIVENESS", "http://0.0.0.0:8080/healthz"),
                   help="URL kopf serves its liveness probe on ('' to disable)")
    peering = p.add_mutually_exclusive_group()
    peering.add_argument("--peering", default=env("SAMPLER_OPERATOR_PEERING", ""),
                         help="peering object name: replicas of the operator elect one active instance")
    peering.add_argument("--standalone", action="store_true", help="no peering (a single operator instance)")
    p.add_argument("--priority", type=int, default=int(env("SAMPLER_OPERATOR_PRIORITY") or 0) or None,
                   help="peering priority: the highest-priority instance is active. Default with --peering: "
                        "random, because kopf pauses ALL peers that share the top priority")
    p.add_argument("-v", "--verbose", action="store_true")
    p.add_argument("--debug", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    namespaces = args.namespace or [n for n in os.environ.get("SAMPLER_OPERATOR_NAMESPACES", "").split(",") if n]
    clusterwide = args.all_namespaces or not namespaces
    standalone = args.standalone or not args.peering
    kopf.configure(verbose=args.verbose, debug=args.debug, log_prefix=True)  # lines name their object
    rollout_trace.enable_from_env()
    from . import handlers  # noqa: F401  (registers the handlers with kopf)
    kopf.run(
        standalone=standalone,
        peering_name=None if standalone else args.peering,
        priority=args.priority if args.priority is not None else random.randint(1, 1_000_000),
        clusterwide=clusterwide,
        namespaces=[] if clusterwide else namespaces,
        liveness_endpoint=args.liveness or None,
    )


if __name__ == "__main__":
    main()
