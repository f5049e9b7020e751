"""The gateway's own Kubernetes client: its configuration, loaded in one place (`client.py`), and the
Events it posts on its SamplerPool (`events.py`). What it reads and writes there lives with its concern:
discovery/kube.py (the replicas), routing/switch.py (the switch's Lease), admin/ (the pool object, the
adapter acknowledgements)."""
