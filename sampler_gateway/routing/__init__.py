"""Which replicas may answer, and which one takes a request. `pool.py` holds the live state (the latest
view, the gateway's own in-flight counts, the label order, the replicas seen failing) and calls the pure
decisions: the version policy (`versions.py`), the endpoint scorer (`score.py`: prefix overlap from
its index, `prefix.py`, against load) or the least-loaded picker (`picker.py`) and, under kube
discovery, the pool's routing switch (`switch.py`: the gateway's side of
operator/sampler_operator/pool/routing.py, with the gateway's Lease). Sticky sessions (`sessions.py`)
say which replica a session prefers."""
