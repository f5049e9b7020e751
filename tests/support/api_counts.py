"""Who asks the API server what: its own request counters, and a counting proxy per component.

The API server's `apiserver_request_total` counts every request by verb and resource, but not by
client: the kube-controller-manager, the test's own fake kubelet and the component under test all
land in one number. So each component under test reaches the API server through its own
`CountingProxy` (plain HTTP on 127.0.0.1, forwarded over TLS with the cluster's CA), which counts
what that component sends, named as the API server names it (`verb`, `resource`): a watch is a
`watch`, a GET of a collection a `list`. Both are read before and after a window and subtracted.

Writes are `create`, `update`, `patch`, `delete` and `deletecollection` (`WRITE_VERBS`).
"""
from __future__ import annotations

import asyncio
import collections
import re
import ssl
import threading
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from aiohttp import web

from sampler_pod.testing.net import free_port

WRITE_VERBS = frozenset({"create", "update", "patch", "delete", "deletecollection"})

Key = tuple[str, str]   # (verb, resource[/subresource])


def classify(method: str, path: str, query: dict[str, str]) -> Key:
    """(verb, resource) of one request, as the API server's own metrics name them.

    Paths: /api/v1/[namespaces/NS/]RESOURCE[/NAME[/SUB]] and /apis/GROUP/VERSION/[namespaces/NS/]RESOURCE[/NAME[/SUB]]
    (a namespace itself: /api/v1/namespaces[/NAME])."""
    parts = [p for p in path.split("/") if p]
    rest = parts[2:] if parts[:1] == ["api"] else parts[3:] if parts[:1] == ["apis"] else parts
    if len(rest) >= 2 and rest[0] == "namespaces" and len(rest) != 2:
        rest = rest[2:]
    resource = rest[0] if rest else "-"
    named = len(rest) >= 2
    if len(rest) >= 3:
        resource = f"{resource}/{rest[2]}"
    method = method.upper()
    if method == "GET":
        verb = "watch" if query.get("watch") in ("true", "1") else "get" if named else "list"
    else:
        verb = {"POST": "create", "PUT": "update", "PATCH": "patch",
                "DELETE": "delete" if named else "deletecollection"}.get(method, method.lower())
    return verb, resource


class CountingProxy:
    """Plain-HTTP reverse proxy to the API server (TLS, the cluster's CA) that counts requests, watches
    included (each watch once, when it starts). Runs in a thread of its own with its own event loop."""

    def __init__(self, upstream: str, ca_file: str) -> None:
        self.upstream, self.ca_file = upstream, ca_file
        self.counts: collections.Counter[Key] = collections.Counter()
        self.paths: collections.Counter[str] = collections.Counter()   # "METHOD /path" with names starred
        self.port = free_port()
        self._lock = threading.Lock()
        self._started = threading.Event()
        threading.Thread(target=self._run, daemon=True, name=f"api-proxy-{self.port}").start()
        if not self._started.wait(10):
            raise RuntimeError("counting proxy did not start")

    @classmethod
    def for_kubeconfig(cls, kubeconfig: str) -> CountingProxy:
        kc = yaml.safe_load(Path(kubeconfig).read_text())
        cluster = kc["clusters"][0]["cluster"]
        return cls(cluster["server"], cluster["certificate-authority"])

    def kubeconfig(self, kubeconfig: str, out: Path) -> str:
        """A copy of `kubeconfig` (same credentials) whose server is this proxy."""
        kc = yaml.safe_load(Path(kubeconfig).read_text())
        kc["clusters"][0]["cluster"] = {"server": f"http://127.0.0.1:{self.port}"}
        out.write_text(yaml.safe_dump(kc))
        return str(out)

    def snapshot(self) -> collections.Counter[Key]:
        with self._lock:
            return collections.Counter(self.counts)

    def total(self) -> int:
        with self._lock:
            return sum(self.counts.values())

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        ssl_ctx = ssl.create_default_context(cafile=self.ca_file)

        async def handle(request: web.Request) -> web.StreamResponse:
            key = classify(request.method, request.path, dict(request.query))
            with self._lock:
                self.counts[key] += 1
                self.paths[f"{request.method} {_starred(request.path)}"] += 1
            hop = ("host", "content-length", "transfer-encoding", "connection", "keep-alive")
            headers = {k: v for k, v in request.headers.items() if k.lower() not in hop}
            body = await request.read()
            async with session.request(request.method, self.upstream + request.path_qs, headers=headers,
                                       data=body if body else None, ssl=ssl_ctx,
                                       skip_auto_headers=("Content-Type",),
                                       timeout=aiohttp.ClientTimeout(total=None)) as up:
                resp = web.StreamResponse(status=up.status, headers={
                    k: v for k, v in up.headers.items()
                    if k.lower() not in ("content-length", "transfer-encoding", "connection")})
                await resp.prepare(request)
                try:
                    async for chunk in up.content.iter_any():
                        await resp.write(chunk)
                    await resp.write_eof()
                except (aiohttp.ClientError, ConnectionError):
                    pass  # a watch ended by either side mid-stream
                return resp

        async def main() -> None:
            nonlocal session
            session = aiohttp.ClientSession(auto_decompress=False,
                                            connector=aiohttp.TCPConnector(limit=0))
            app = web.Application(client_max_size=64 << 20)
            app.router.add_route("*", "/{tail:.*}", handle)
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", self.port).start()
            self._started.set()
            await asyncio.Event().wait()

        session: Any = None
        loop.run_until_complete(main())


def _starred(path: str) -> str:
    path = re.sub(r"/namespaces/[^/]+", "/namespaces/*", path)
    return re.sub(r"/(pods|samplerreplicas|samplerpools|events|leases|secrets|kopfpeerings)/[^/]+", r"/\1/*", path)


def apiserver_requests(kubeconfig: str) -> collections.Counter[Key]:
    """`apiserver_request_total` of the API server `kubeconfig` names, summed over the labels other than
    verb and resource (code, scope, component...), keyed as `classify` keys: (verb lowercased,
    resource[/subresource]). The API server counts a watch when it ends, and WATCH and LIST apart."""
    from prometheus_client.parser import text_string_to_metric_families

    kc = yaml.safe_load(Path(kubeconfig).read_text())
    server = kc["clusters"][0]["cluster"]["server"]
    ctx = ssl.create_default_context(cafile=kc["clusters"][0]["cluster"]["certificate-authority"])
    req = urllib.request.Request(server + "/metrics",
                                 headers={"Authorization": f"Bearer {kc['users'][0]['user']['token']}"})
    with urllib.request.urlopen(req, context=ctx, timeout=30) as r:
        text = r.read().decode()
    out: collections.Counter[Key] = collections.Counter()
    for family in text_string_to_metric_families(text):
        if family.name != "apiserver_request":
            continue
        for s in family.samples:
            if not s.name.endswith("_total"):
                continue
            resource = s.labels.get("resource", "-") or "-"
            if s.labels.get("subresource"):
                resource += "/" + s.labels["subresource"]
            out[(s.labels.get("verb", "?").lower(), resource)] += int(s.value)
    return out


def writes(counts: collections.Counter[Key]) -> collections.Counter[Key]:
    return collections.Counter({k: v for k, v in counts.items() if k[0] in WRITE_VERBS and v})
