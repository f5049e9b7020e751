"""Every API call of a gateway's routing renewal carries a timeout (sampler_gateway.routing.switch.call_timeout_s):
on a silent network a call without one hangs for as long as TCP takes to give up, and every renewal
behind it, so the gateway would come back minutes after the network does. The calls are recorded
on stand-ins for the kubernetes client (the real renewal against a real API server: the envtest
tier's test_pool_switch.py)."""

from __future__ import annotations

import datetime as dt
from types import SimpleNamespace
from typing import Any

from sampler_gateway.routing.switch import KubeRoutingLease, Switch, call_timeout_s
from tests.support.gateway import NoAdapters


class Recorder:
    """A kubernetes API stand-in: every method call is recorded with its keyword arguments."""

    def __init__(self, answers: dict[str, Any]) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.answers = answers

    def __getattr__(self, name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls.append((name, kwargs))
            answer = self.answers[name]
            if isinstance(answer, BaseException):
                raise answer
            return answer
        return call


def lease(duration_s: int, leases: Recorder, custom: Recorder) -> KubeRoutingLease:
    # Built without __init__, which loads a kubeconfig; the attributes are the ones __init__ sets.
    g = object.__new__(KubeRoutingLease)
    g.pool, g.namespace, g.holder, g.duration_s, g.renew_s = "p", "ns", "gw-a", duration_s, 1.0
    g.switch, g.on_change, g.reconnected, g.adapters, g.peer_url = Switch(), lambda: None, None, NoAdapters(), None
    g._leases, g._custom, g._timeout_s = leases, custom, call_timeout_s(duration_s)
    g._pool_uid, g._version, g._acked = None, None, -1
    g._who, g._where = "gateway/gw-a", "ns/p"
    return g


def test_every_call_of_a_renewal_has_a_timeout_within_the_lease() -> None:
    from kubernetes.client.exceptions import ApiException

    meta = SimpleNamespace(metadata=SimpleNamespace(resource_version="7"))
    leases = Recorder({"read_namespaced_lease": ApiException(status=404), "create_namespaced_lease": meta,
                       "replace_namespaced_lease": meta})
    custom = Recorder({"get_namespaced_custom_object": {"metadata": {"uid": "u"}}})
    g = lease(10, leases, custom)
    now = dt.datetime.now(dt.UTC)
    g._write(0, None, now)      # no Lease yet: read (404), then create
    g._write(0, 3, now)         # then replace
    g._read_pool()
    calls = leases.calls + custom.calls
    assert [name for name, _ in calls] == ["read_namespaced_lease", "create_namespaced_lease",
                                           "replace_namespaced_lease", "get_namespaced_custom_object"]
    assert all(kwargs.get("_request_timeout") == 5.0 for _, kwargs in calls), calls


def test_the_timeout_is_half_the_lease_and_never_below_a_second() -> None:
    assert call_timeout_s(10) == 5.0 and call_timeout_s(1) == 1.0
