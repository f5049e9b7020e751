"""A request for a LoRA adapter version: what its model name means (`names.py`: the base model, or
exactly one version of one run), which replica takes it and what that replica unloads first
(`placement.py`, pure), and routing it there, loading the version on demand (`router.py`).

The rest of LoRA sits with its own concern: what a replica's `/health` says it holds
(replicas/adapter_health.py), the request's life around the placement (forwarding/adapter_forward.py),
a trainer's push (admin/)."""
