"""Where the replica set comes from. A source lists the members (name, address, draining); the
refresh loop reads each member's `/health` for readiness and weights and publishes a `PoolView`.

- `static.py`: `--replica NAME=URL` flags or a JSON file (tests, running outside Kubernetes);
- `kube.py`: the pool's SamplerReplicas and their pods, watched on the API server (never DNS).
"""
