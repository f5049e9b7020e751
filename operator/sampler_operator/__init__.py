"""sampler-operator: keeps one healthy sampler pod per SamplerReplica custom resource, and pools of them.

One controller per kind, as kubebuilder lays them out:
- replica/: the SamplerReplica controller (read its __init__ for the order);
- pool/: the SamplerPool controller (likewise).
Shared by both: api_keys.py (the pods' keys), health_probe.py and pod_client.py (how we look at and
talk to a pod), kube.py (the API calls), handlers.py (the kopf wiring), settings.py and __main__.py
(how it runs); pod_security.py (every created pod's security contexts and writable paths) and
network_policy.py (the pools' and lone replicas' NetworkPolicies); release_finalizers.py (a command:
deleting replicas while no operator runs).
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
