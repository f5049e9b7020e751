"""Weights over the network: what a replica, a pool's gateway and a trainer share of vLLM's weight-transfer
protocol.

`digest` defines the sha256 digests every side computes (pure, standard library). `session` is the order of
the control calls, which a replica and a gateway both enforce (pure). `gloo` is the `gloo` backend of vLLM's
protocol, both sides of it (torch and vLLM, imported only by the processes that move weights: a replica's
engine worker and a trainer). The protocol, its phases and invariants: docs/design/weights-over-network.md.
"""
