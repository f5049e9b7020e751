"""A TCP forwarder on 127.0.0.1 that a test cuts and restores: one process's path to a server (the
kube-apiserver) goes through it, so that process alone loses the server while everything else keeps it.

It forwards bytes, nothing more: TLS passes through unchanged (the client still checks the server's
certificate, issued for 127.0.0.1, whatever the port). `cut()` closes the listener and every
connection through it: the process's open requests and watches break, and each new connection is
refused, as when the server is unreachable. `restore()` listens again on the same port.
"""
from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator

from sampler_pod.testing.net import free_port


class TcpProxy:
    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.port = free_port()
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self._conns: set[socket.socket] = set()
        self.connections = 0   # accepted since the start: a test sees the process used the proxy

    def start(self) -> TcpProxy:
        self.restore()
        return self

    def restore(self) -> None:
        """Listen (again) on the same port."""
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", self.port))
        s.listen(128)
        with self._lock:
            assert self._listener is None, "restore() of a proxy that is not cut"
            self._listener = s
        threading.Thread(target=self._accept, args=(s,), daemon=True, name=f"proxy-{self.port}").start()

    def cut(self) -> None:
        """Close the listener and every connection through it. shutdown() first: on Linux a plain
        close() does not wake a thread blocked in accept() or recv() on that socket."""
        with self._lock:
            listener, self._listener = self._listener, None
            conns, self._conns = self._conns, set()
        for s in ([listener] if listener is not None else []) + list(conns):
            _close(s)

    def close(self) -> None:
        self.cut()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # cut
            try:
                upstream = socket.create_connection(self.target, timeout=5)
                upstream.settimeout(None)
            except OSError:
                _close(client)
                continue
            with self._lock:
                if self._listener is not listener:  # cut meanwhile
                    _close(client)
                    _close(upstream)
                    return
                self._conns |= {client, upstream}
                self.connections += 1
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            with self._lock:
                self._conns -= {src, dst}
            _close(src)
            _close(dst)


def _close(s: socket.socket) -> None:
    with contextlib.suppress(OSError):
        s.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        s.close()


@contextlib.contextmanager
def tcp_proxy(target_host: str, target_port: int) -> Iterator[TcpProxy]:
    proxy = TcpProxy(target_host, target_port).start()
    try:
        yield proxy
    finally:
        proxy.close()
