"""What the sampler (`sampler_pod`) and the pool's gateway (`sampler_gateway`) both serve HTTP with.

The client-facing errors (each with its status and category) and their rendering, API-key auth, the
body-limit and disconnect middleware, and the flags base of both servers' configs. Both servers import
this package, never each other (`tests/unit/test_layers.py`), so the gateway's image carries no sampler
code, and a change here is visibly a change to both. Nothing in it imports vLLM or torch.
"""
