"""A small, typed summary of a live Pod: the few fields the operator reasons about."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sampler_operator.replica.desired_pod import ANNOTATION_POD_GENERATION, ANNOTATION_TEMPLATE_HASH


@dataclass(frozen=True)
class PodView:
    name: str
    uid: str
    phase: str                 # Pending | Running | Succeeded | Failed | Unknown
    pod_ip: str | None
    ready: bool                # the kubelet's Ready condition (readiness probe)
    deleting: bool             # deletionTimestamp set: on its way out, no longer "live"
    template_hash: str | None
    generation: int | None
    owner_uids: tuple[str, ...]
    reason: str | None = None  # e.g. "Evicted"

    @property
    def finished(self) -> bool:
        """Failed or Succeeded pods never run again (restartPolicy does not apply): replace them."""
        return self.phase in ("Failed", "Succeeded")

    @classmethod
    def from_pod(cls, pod: Any) -> PodView:
        """Accepts a raw dict or a kopf body (both are Mappings with camelCase keys)."""
        meta = pod.get("metadata", {}) or {}
        status = pod.get("status", {}) or {}
        annotations = meta.get("annotations") or {}
        conditions = status.get("conditions") or []
        ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
        gen = annotations.get(ANNOTATION_POD_GENERATION)
        return cls(
            name=meta.get("name", ""),
            uid=meta.get("uid", ""),
            phase=status.get("phase") or "Pending",
            pod_ip=status.get("podIP") or None,
            ready=ready,
            deleting=meta.get("deletionTimestamp") is not None,
            template_hash=annotations.get(ANNOTATION_TEMPLATE_HASH),
            generation=int(gen) if gen is not None and str(gen).isdigit() else None,
            owner_uids=tuple(r.get("uid", "") for r in (meta.get("ownerReferences") or [])),
            reason=status.get("reason"),
        )
