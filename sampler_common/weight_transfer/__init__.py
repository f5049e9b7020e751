"""Weights over the network: what a replica and a trainer share of vLLM's weight-transfer protocol.

`digest` defines the sha256 digests both sides compute (pure, standard library). `gloo` is the `gloo`
backend of vLLM's protocol, both sides of it (torch and vLLM, imported only by the processes that move
weights: a replica's engine worker and a trainer). The protocol, its phases and invariants:
docs/design/weights-over-network.md.
"""
