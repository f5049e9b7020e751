"""The SamplerReplica controller: one healthy sampler pod per SamplerReplica.

Read in this order: spec.py (what a user asks for), seams.py (what it may not ask for here),
desired_pod.py (the pod we build for it), replacement_policy.py (when a pod must be swapped),
weights_intent.py (which weights the pod must serve), status.py (what we report back),
reconcile.py (the loop tying them together), weights_sync.py (pushing declared weights to the pod);
context.py, fleet.py and pod_view.py are what the loop remembers and sees between steps.
"""
