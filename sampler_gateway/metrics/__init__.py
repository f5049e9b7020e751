"""What the gateway measures: its Prometheus metrics, a registry per app (`registry.py`), and the latency
it adds to a request (`added_latency.py`: the histogram, and the middleware and per-exchange timing that
fill it)."""
