"""FakeKubeApiServer: a FAKE Kubernetes API server, because no real one can run on these machines.

It serves only what pod discovery uses, in the API server's own wire shapes: `GET /api/v1/namespaces/NS/pods`
as a list (a `PodList` with `metadata.resourceVersion`) and as a watch (`?watch=true&resourceVersion=N`: one JSON
event per line, `ADDED` / `MODIFIED` / `DELETED` / `BOOKMARK`, and for a compacted version an `ERROR` event whose
object is the `Status` with `code: 410, reason: Expired` that a real server sends), with label selectors
(`k=v`, `k!=v`, `k`; an object that stops matching is a `DELETED` for that watch, as the real watch cache does),
`timeoutSeconds`, and bookmarks. A test drives it: pods come, change and go; watch streams can be cut, events
dropped (a missed delete), and old versions compacted.

It runs on its own event loop in a thread, on 127.0.0.1 and a port the kernel picks.
"""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path
from typing import Any

from aiohttp import web


def make_pod(name: str, ip: str, port: int, labels: dict[str, str], ready: bool = True, phase: str = "Running",
             annotations: dict[str, str] | None = None, namespace: str = "fleet") -> dict[str, Any]:
    return {"kind": "Pod", "apiVersion": "v1",
            "metadata": {"name": name, "namespace": namespace, "uid": f"uid-{name}", "labels": labels,
                         "annotations": {"pdserve.io/port": str(port), **(annotations or {})}},
            "spec": {"containers": [{"name": "engine", "image": "pdserve"}]},
            "status": {"phase": phase, "podIP": ip, "conditions": [
                {"type": "Ready", "status": "True" if ready else "False"},
                {"type": "ContainersReady", "status": "True" if ready else "False"}]}}


def _matches(selector: str, labels: dict[str, str]) -> bool:
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if "!=" in term:
            key, value = term.split("!=", 1)
            if labels.get(key) == value:
                return False
        elif "=" in term:
            key, value = term.split("=", 1)
            if labels.get(key.rstrip("=")) != value:
                return False
        elif term not in labels:
            return False
    return True


class FakeKubeApiServer:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.pods: dict[str, dict[str, Any]] = {}
        self.version = 100
        self.compacted = 0  # watches from versions below this get 410 Gone
        self.history: list[tuple[int, dict | None, dict | None]] = []  # (version, before, after)
        self.drop_events = False
        self.lists = 0
        self.watches = 0
        self.gone = 0  # 410s sent
        self._changed: asyncio.Condition | None = None
        self._streams: set[asyncio.Transport] = set()  # of the open watches
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self.port = 0

    # -- lifecycle -------------------------------------------------------------------------------------------
    def start(self) -> FakeKubeApiServer:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the fake API server did not start")
        return self

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_get("/api/v1/namespaces/{namespace}/pods", self._pods)
        runner = web.AppRunner(app)
        self._loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]
        self._changed = asyncio.Condition()
        self._runner = runner
        self._ready.set()
        self._loop.run_forever()

    def stop(self) -> None:
        async def shutdown() -> None:
            await self._runner.cleanup()

        asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def kubeconfig(self) -> Path:
        path = self.root / "kubeconfig"
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {"server": f"http://127.0.0.1:{self.port}"}}],
            "users": [{"name": "fake", "user": {"token": "fake-token"}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake", "namespace": "fleet"}}]}))
        return path

    # -- what a test does ------------------------------------------------------------------------------------
    def _call(self, fn, *args) -> Any:
        async def run() -> Any:
            result = fn(*args)
            async with self._changed:
                self._changed.notify_all()
            return result

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(10)

    def put(self, pod: dict[str, Any]) -> None:
        self._call(self._record, pod["metadata"]["name"], pod)

    def delete(self, name: str) -> None:
        self._call(self._record, name, None)

    def compact(self) -> None:
        """Every version before now is gone: a watch from one of them gets 410."""
        self._call(lambda: setattr(self, "compacted", self.version))

    def cut_watches(self) -> None:
        """End every open watch stream, as a proxy or a restarted API server does."""
        def cut() -> None:
            for transport in list(self._streams):
                transport.close()
        self._call(cut)

    def _record(self, name: str, pod: dict[str, Any] | None) -> None:
        self.version += 1
        before = self.pods.pop(name, None)
        if pod is not None:
            pod = json.loads(json.dumps(pod))
            pod["metadata"]["resourceVersion"] = str(self.version)
            self.pods[name] = pod
        if not self.drop_events:
            self.history.append((self.version, before, pod))

    # -- the API -----------------------------------------------------------------------------------------------
    async def _pods(self, request: web.Request) -> web.StreamResponse:
        selector = request.query.get("labelSelector", "")
        if request.query.get("watch", "").lower() not in ("true", "1"):
            self.lists += 1
            items = [p for p in self.pods.values() if _matches(selector, p["metadata"].get("labels") or {})]
            return web.json_response({"kind": "PodList", "apiVersion": "v1",
                                      "metadata": {"resourceVersion": str(self.version)}, "items": items})
        self.watches += 1
        return await self._watch(request, selector, int(request.query.get("resourceVersion") or self.version),
                                 float(request.query.get("timeoutSeconds") or 300),
                                 request.query.get("allowWatchBookmarks", "").lower() == "true")

    async def _watch(self, request: web.Request, selector: str, since: int, timeout: float,
                     bookmarks: bool) -> web.StreamResponse:
        stream = web.StreamResponse(headers={"Content-Type": "application/json"})
        await stream.prepare(request)
        if since < self.compacted:
            self.gone += 1
            await _send(stream, "ERROR", {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                                          "message": f"too old resource version: {since} ({self.compacted + 1})",
                                          "reason": "Expired", "code": 410})
            return stream
        transport = request.transport
        self._streams.add(transport)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        try:
            while loop.time() < deadline:
                for version, before, after in [h for h in self.history if h[0] > since]:
                    since = version
                    await self._event(stream, selector, before, after)
                if bookmarks:  # the version up to which this stream has every event
                    await _send(stream, "BOOKMARK", {"kind": "Pod", "apiVersion": "v1",
                                                     "metadata": {"resourceVersion": str(since)}})
                async with self._changed:
                    try:
                        await asyncio.wait_for(self._changed.wait(), min(1.0, max(0.0, deadline - loop.time())))
                    except TimeoutError:
                        pass
        except (ConnectionResetError, RuntimeError):
            pass
        finally:
            self._streams.discard(transport)
        return stream

    async def _event(self, stream: web.StreamResponse, selector: str, before: dict | None,
                     after: dict | None) -> None:
        was = before is not None and _matches(selector, before["metadata"].get("labels") or {})
        now = after is not None and _matches(selector, after["metadata"].get("labels") or {})
        if now:
            await _send(stream, "MODIFIED" if was else "ADDED", after)
        elif was:
            await _send(stream, "DELETED", after or before)


async def _send(stream: web.StreamResponse, kind: str, obj: dict[str, Any]) -> None:
    await stream.write(json.dumps({"type": kind, "object": obj}).encode() + b"\n")
