"""Unit tests: the loopback port helper never hands one port to two callers of a process.

The kernel's bind(0) returns ports at random and can return one it returned before while nobody
has bound it yet (about 7% of 2,000 calls here); the node tier once gave a replica the port of
the operator's health server that way."""

import socket

from sampler_pod.testing.net import free_port, free_ports


def test_two_thousand_ports_handed_out_are_all_different() -> None:
    ports = [free_port() for _ in range(2000)]
    assert len(set(ports)) == len(ports)


def test_a_run_of_consecutive_ports_is_free_and_none_is_handed_out_again() -> None:
    first = free_ports(3)
    run = set(range(first, first + 3))
    for p in run:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))  # free: nobody listens there
    assert run.isdisjoint(free_port() for _ in range(2000))
