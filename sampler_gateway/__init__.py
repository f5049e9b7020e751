"""The pool's single address: a gateway in front of N sampler replicas.

A trainer samples from many replicas at once. Behind a plain Service three things break: a future
submitted on replica A is retrieved from replica B (404), a replica being drained or reloaded
still gets traffic, and during a weights rollout a request may land on the old version. This
gateway fixes all three with the shape of the Gateway API Inference Extension (an InferencePool
of endpoints plus an endpoint picker), adding what it lacks: a weights-version policy and ids that
name their replica.

Read top-down: `config.py` -> `app.py` -> `forward.py` (the request's life: pick, send, retry)
-> `picker.py`, `versions.py`, `ids.py`, `sessions.py` (the pure decisions) -> `pool.py` (the
state they read) -> `discovery/` (where the replica set comes from). Every decision is a pure function; routes and
the pool only call them.
"""

__version__ = "0.1.0"
