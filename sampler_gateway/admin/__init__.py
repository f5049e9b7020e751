"""The pool's admin side (the pool's admin key): what a trainer writes to its SamplerPool through the
gateway, and reads back. The SamplerPool object, behind a two-method port (`pool_object.py`); a
weights push and how far its rollout has come (`weights.py`, pure); an adapter push, decided
(`adapter_push.py`, pure), carried out on a replica and in the pool (`adapters.py`), and answered once
every live gateway routes by it (`adapter_acks.py`); a push over the network, decided (`transfer_plan.py`,
pure) and fanned out to the replicas, then declared in the pool (`transfer.py`). Their routes:
routes/pool.py, routes/adapter_push.py, routes/weight_transfer.py."""
