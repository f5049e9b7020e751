"""The gateway's listening socket when it must share its port (`--reuse-port`).

A pool's gateway Deployment on the node's network (`spec.gateway.hostNetwork`) runs every replica
on the same port of its node. With the port declared, the scheduler puts at most one replica on a
node, so a node-sized cluster runs one gateway, and even that one never rolls (the new pod waits
for the old one's port forever, the old one waits for the new one to be ready). So the operator
declares no port for such a gateway and each replica listens with SO_REUSEPORT: the kernel spreads
new connections over every replica listening there, as a Service spreads them over its endpoints.
Linux lets only sockets of the same user join such a group.
"""

from __future__ import annotations

import socket


def shared_listener(host: str, port: int) -> socket.socket:
    """A bound socket (not yet listening: uvicorn calls listen) on host:port with SO_REUSEPORT."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                      flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(addr)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock
