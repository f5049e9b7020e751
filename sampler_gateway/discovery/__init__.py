"""Where the replica set comes from. A source lists the members (name, address, draining) and says
when they may have changed; the refresh loop (`refresh.py`) acts on a change at once (`merge.py`)
and reads each member's `/health` for readiness and weights, publishing a `PoolView`.

- `static.py`: `--replica NAME=URL` flags or a JSON file (tests, running outside Kubernetes);
- `kube.py`: the pool's SamplerReplicas and their pods, watched on the API server (never DNS);
- `peers.py`: with kube discovery, the pool's gateways share those reads: each replica is read by one
  of them every interval, which serves the read to the others.
"""
