"""What the operator spends on each watch event (issue #53): a rollout at 256 replicas brings thousands of
SamplerReplica, pod and Lease events, each run through every handler and index that selects it.

- Each of them is a coroutine: kopf runs a plain function in a thread of the loop's default executor,
  which also carries the API client's calls, so each event paid a thread hop per handler.
- kopf's "Handler '<name>' succeeded." line is dropped for the handlers run at every event, and for no
  other: the daemons' and the startup's still show.
"""

from __future__ import annotations

import inspect
import logging

import kopf

from sampler_operator import handlers


def _registered(registry: kopf.OperatorRegistry) -> dict[str, object]:
    handlers_ = [*registry._watching.get_all_handlers(), *registry._indexing.get_all_handlers()]
    return {h.id: h.fn for h in handlers_}


def test_every_event_handler_and_index_is_a_coroutine() -> None:
    found = _registered(kopf.get_default_registry())
    assert {"replica_pods", "replica_fleet", "pool_members", *handlers.PER_EVENT_HANDLERS} <= set(found)
    assert [name for name, fn in found.items() if not inspect.iscoroutinefunction(fn)] == []


def test_the_quiet_list_is_the_event_handlers() -> None:
    registry = kopf.get_default_registry()
    assert sorted(h.id for h in registry._watching.get_all_handlers()) == sorted(handlers.PER_EVENT_HANDLERS)


def _record(message: str) -> logging.LogRecord:
    return logging.LogRecord("kopf.objects", logging.INFO, __file__, 1, message, None, None)


def test_only_the_per_event_handlers_success_lines_are_dropped() -> None:
    quiet = handlers.QuietPerEventHandlers()
    for name in handlers.PER_EVENT_HANDLERS:
        assert not quiet.filter(_record(f"Handler '{name}' succeeded."))
    for kept in ("Daemon 'replica_loop' succeeded.", "Handler 'configure' succeeded.",
                 "Handler 'validate_spec' failed with an exception and will try again in 60 seconds: boom",
                 "loading declared weights step-2 in place"):
        assert quiet.filter(_record(kept)), kept
    assert any(isinstance(f, handlers.QuietPerEventHandlers) for f in logging.getLogger("kopf.objects").filters)
