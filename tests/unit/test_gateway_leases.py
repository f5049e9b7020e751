"""A pool's gateway Leases as the operator and a LoRA push read them (sampler_common/gateway_leases.py):
each annotation read on its own, and who is waited for: live Leases behind, never expired ones."""
from __future__ import annotations

from typing import Any

from sampler_common.gateway_leases import (
    ADAPTERS_ACK,
    CLOCK_SKEW_S,
    ROUTING_ACK,
    GatewayAck,
    adapters_waiting_for,
    waiting_for,
)
from sampler_common.timestamps import epoch_seconds

RENEWED = "2026-12-04T10:00:00.000000Z"


def lease(name: str, routing: str | None, adapters: str | None, renewed: str | None = RENEWED,
          duration: Any = 10) -> dict[str, Any]:
    ann = {k: v for k, v in ((ROUTING_ACK, routing), (ADAPTERS_ACK, adapters)) if v is not None}
    spec: dict[str, Any] = {"holderIdentity": name, "leaseDurationSeconds": duration}
    if renewed is not None:
        spec["renewTime"] = renewed
    return {"metadata": {"name": f"{name}-routing", "annotations": ann}, "spec": spec}


def test_each_acknowledgement_is_read_on_its_own() -> None:
    a = GatewayAck.from_lease(lease("a", "4", "17"))
    assert (a.name, a.generation, a.adapters_serial, a.duration_s) == ("a", 4, 17, 10.0)
    assert a.renewed == epoch_seconds(RENEWED)
    b = GatewayAck.from_lease(lease("b", "4", None))          # a gateway that routes by no adapters yet
    assert (b.generation, b.adapters_serial) == (4, None)
    c = GatewayAck.from_lease(lease("c", "x", "seven", duration="10"))   # unreadable: not said
    assert (c.generation, c.adapters_serial, c.duration_s) == (None, None, 0.0)


def test_a_push_waits_for_live_gateways_behind_and_never_for_an_expired_one() -> None:
    t0 = epoch_seconds(RENEWED)
    assert t0 is not None
    acks = [GatewayAck.from_lease(x) for x in (
        lease("ahead", "1", "9"), lease("even", "1", "7"), lease("behind", "1", "6"), lease("silent", "1", None),
        lease("never-renewed", "1", "0", renewed=None), lease("short", "1", "0", duration=2))]
    assert adapters_waiting_for(acks, 7, t0 + 1) == ["behind", "short", "silent"]
    # Expired at renewTime + duration + the skew allowance, not before.
    assert adapters_waiting_for(acks, 7, t0 + 2 + CLOCK_SKEW_S) == ["behind", "short", "silent"]
    assert adapters_waiting_for(acks, 7, t0 + 2 + CLOCK_SKEW_S + 0.01) == ["behind", "silent"]
    assert adapters_waiting_for(acks, 7, t0 + 10 + CLOCK_SKEW_S + 0.01) == []
    # The routing switch's wait reads the other annotation only.
    assert waiting_for(acks, 1, t0 + 1) == []
