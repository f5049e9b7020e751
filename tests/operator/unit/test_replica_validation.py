"""How a SamplerReplica's spec is validated: an event handler, once per generation, never a change
handler. kopf keeps the last handled spec of a resource with change handlers (create, update, resume,
delete) in an annotation, written again at each spec change: with them every rollout wrote each
replica once more than its pool did, and every watcher (the operator, each gateway) saw one more event
per replica (issue #53)."""

from __future__ import annotations

from typing import Any

import kopf

from sampler_operator import PLURAL, handlers


def _selects_replicas(handler: Any) -> bool:
    return bool(handler.selector.any_name == PLURAL or handler.selector.plural == PLURAL)


def test_no_change_handler_selects_replicas_so_kopf_writes_no_copy_of_their_spec() -> None:
    registry = kopf.get_default_registry()
    assert not [h.id for h in registry._changing.get_all_handlers() if _selects_replicas(h)]
    assert "validate_spec" in [h.id for h in registry._watching.get_all_handlers() if _selects_replicas(h)]


def test_each_generation_of_a_replica_s_spec_is_validated_once() -> None:
    validated = {"uid-a": 3}
    assert handlers.spec_unvalidated(validated, "uid-b", 1)       # a new replica, or the first event after a start
    assert handlers.spec_unvalidated(validated, "uid-a", 4)       # a spec change (a rollout, a fix)
    assert not handlers.spec_unvalidated(validated, "uid-a", 3)   # its own status writes, its pods' news
    assert not handlers.spec_unvalidated(validated, None, 1)      # nothing to key it by
