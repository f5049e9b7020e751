"""The replica set as the gateway sees it, as pure data: each replica's view (its membership, readiness
and weights: `view.py`), what its `/health` says about the LoRA adapters it holds (`adapter_health.py`),
and the ids that name their replica (`ids.py`). Every other package reads these; they import nothing of
the gateway."""
