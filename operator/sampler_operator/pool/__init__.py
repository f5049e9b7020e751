"""The SamplerPool controller: N SamplerReplicas, one gateway, and the pool's weights rollouts.

Read in this order: plan.py (pure decisions: which replicas to create, roll, drain or delete),
conditions.py (its conditions and Events, pure), routing.py (the one-order switch, pure),
gateway.py (the gateway's objects, pure), loop.py (one step of the pool's loop, the only I/O).
"""
