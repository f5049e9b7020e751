"""sampler-operator: keeps one healthy sampler pod per SamplerReplica custom resource.

Read in this order: spec.py (what a user asks for), seams.py (what it may not ask for here),
api_keys.py (the pod's keys), desired_pod.py (the pod we build for it),
replacement_policy.py (when a pod must be swapped), status.py (what we report back),
health_probe.py (how we look at a pod), reconcile.py (the loop tying them together),
handlers.py (the kopf wiring), settings.py and __main__.py (how it runs);
release_finalizers.py (a command: deleting replicas while no operator runs).
The SamplerPool controller: pool_plan.py (pure decisions), pool_conditions.py (its conditions and
Events, pure), pool_gateway.py (the gateway's objects, pure), pool_loop.py (one step of the pool's loop).
"""

GROUP = "sampler.rl.dev"
VERSION = "v1alpha1"
PLURAL = "samplerreplicas"
KIND = "SamplerReplica"
POOL_PLURAL = "samplerpools"
POOL_KIND = "SamplerPool"
API_VERSION = f"{GROUP}/{VERSION}"
# kopf's finalizer on every SamplerReplica (settings.apply names it; release_finalizers.py removes it
# when no operator will).
FINALIZER = f"{GROUP}/finalizer"
