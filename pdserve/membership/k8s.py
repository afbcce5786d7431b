"""The gateway's Kubernetes backend: pods by label selector, list + watch (with bookmarks), on kubernetes_asyncio.

Selectors as vllm-router's (`--prefill-selector app=p`, `--decode-selector app=d`, ...: the selector gives the
role), or one `--selector` whose pods say their role in a label: `pdserve.io/role`, or llm-d's `llm-d.ai/role`
(`prefill`, `decode`, `prefill-decode`/`both`, `encode`). A pod is a member only while it is Running, Ready, not
being deleted and matches; one that turns NotReady or stops matching leaves (its record says `not_ready`, or it
disappears from the selector's watch). Every watch ends after `relist_s` and the loop lists again, and a watch
whose resource version is too old (410 Gone) goes straight back to a list: a missed event lasts one period at most.

Read from each pod: its IP, the port (annotation `pdserve.io/port`, else `--discovery-port`, else 8000), the
model (label or annotation `pdserve.io/model`, else `llm-d.ai/model`), its labels, and where it publishes KV
events (annotation `pdserve.io/kv-events-config`: vLLM's `--kv-events-config` JSON).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from typing import Any

from pdserve.membership.discovery import DEFAULT_RELIST_S, LEFT, Discovery, View
from pdserve.membership.record import NOT_READY, READY, MemberRecord, RecordError, check_record, kv_events_from_vllm

log = logging.getLogger(__name__)
ROLE_LABELS = ("pdserve.io/role", "llm-d.ai/role")
_ROLES = {"prefill": "prefill", "decode": "decode", "both": "both", "prefill-decode": "both", "encode": "encode"}
_SA_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
DEFAULT_PORT = 8000


def pod_record(pod: dict[str, Any], role: str | None, default_port: int | None) -> MemberRecord | None:
    """The record a pod stands for (state not_ready unless it is Running and Ready), or None when it cannot be
    one (no IP yet, no role); RecordError for annotations that cannot be read."""
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    labels, notes = meta.get("labels") or {}, meta.get("annotations") or {}
    if role is None:
        named = next((labels[k] for k in ROLE_LABELS if k in labels), None)
        role = _ROLES.get(named or "")
        if role is None:
            return None
    ip = status.get("podIP")
    if not ip:
        return None
    port = notes.get("pdserve.io/port") or default_port or DEFAULT_PORT
    ready = status.get("phase") == "Running" and not meta.get("deletionTimestamp") and any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
    model = labels.get("pdserve.io/model") or notes.get("pdserve.io/model") or labels.get("llm-d.ai/model")
    host = f"[{ip}]" if ":" in ip else ip
    return check_record(MemberRecord(url=f"http://{host}:{port}", role=role, model=model, labels=dict(labels),
                                     kv_events=kv_events_from_vllm(notes.get("pdserve.io/kv-events-config")),
                                     state=READY if ready else NOT_READY, source="k8s"))


class KubernetesDiscovery(Discovery):
    name = "k8s"

    def __init__(self, selector: str | None, role_selectors: dict[str, str], namespace: str | None,
                 port: int | None, relist_s: float = DEFAULT_RELIST_S, retry_s: float = 1.0) -> None:
        super().__init__(relist_s)
        self.selectors: list[tuple[str | None, str]] = [(role, sel) for role, sel in role_selectors.items()]
        if selector is not None or not self.selectors:
            self.selectors.append((None, selector or ROLE_LABELS[0]))  # default: pods that have pdserve's label
        self.namespace = namespace
        self.port = port
        self.retry_s = retry_s
        self.pods: dict[int, dict[str, MemberRecord]] = {}  # per selector: pod key -> record
        self._warned: set[tuple[str, str]] = set()
        self._listed: set[int] = set()  # selectors listed once: a later list that differs corrects a missed event
        self._client: Any = None

    async def run(self, view: View) -> None:
        from kubernetes_asyncio import client

        self._client = await _api_client()
        api = client.CoreV1Api(self._client)
        namespace = self.namespace or _own_namespace()
        log.info("membership: following pods in namespace %s (%s)", namespace,
                 "; ".join(f"{role or 'role from labels'}: {sel}" for role, sel in self.selectors))
        await asyncio.gather(*(self._follow(api, namespace, i, role, sel, view)
                               for i, (role, sel) in enumerate(self.selectors)))

    async def _follow(self, api: Any, namespace: str, index: int, role: str | None, selector: str,
                      view: View) -> None:
        from kubernetes_asyncio.client.exceptions import ApiException

        while True:
            try:
                version = await self._list(api, namespace, index, role, selector, view)
                view.set_stale(self.name, None)
                relist_at = asyncio.get_running_loop().time() + self.relist_s
                while (left := relist_at - asyncio.get_running_loop().time()) > 0:
                    version = await self._watch(api, namespace, index, role, selector, version, left, view)
            except ApiException as exc:
                if exc.status == 410:
                    log.info("membership: pod watch from an expired version (410 Gone); listing again")
                    continue
                view.set_stale(self.name, f"API server answered {exc.status} {exc.reason}")
                await asyncio.sleep(self.retry_s)
            except Exception as exc:  # noqa: BLE001 - the client raises plain Exception for a malformed event
                view.set_stale(self.name, f"{type(exc).__name__}: {exc}")
                await asyncio.sleep(self.retry_s)

    async def _list(self, api: Any, namespace: str, index: int, role: str | None, selector: str,
                    view: View) -> str:
        response = await api.list_namespaced_pod(namespace, label_selector=selector, _preload_content=False,
                                                 _request_timeout=10)
        data = json.loads(await response.read())
        pods = {}
        for pod in data.get("items") or []:
            record = self._record(pod, role)
            if record is not None:
                pods[_pod_key(pod)] = record
        self.pods[index] = pods
        self._report(view, index, relist=index in self._listed)
        self._listed.add(index)
        return (data.get("metadata") or {}).get("resourceVersion", "")

    async def _watch(self, api: Any, namespace: str, index: int, role: str | None, selector: str, version: str,
                     seconds: float, view: View) -> str:
        """Follow changes from `version` for at most `seconds` (the server ends the watch), or until the stream
        is cut; returns the last version seen (events and bookmarks), to watch on from there."""
        import aiohttp
        from kubernetes_asyncio import watch

        async with watch.Watch() as stream:
            try:
                async for event in stream.stream(api.list_namespaced_pod, namespace, label_selector=selector,
                                                 resource_version=version, allow_watch_bookmarks=True,
                                                 timeout_seconds=max(1, int(seconds))):
                    if event["type"] != "BOOKMARK":
                        self._apply(view, index, role, event["type"], event["raw_object"])
            except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError) as exc:
                log.info("membership: pod watch cut (%s); watching on from version %s", type(exc).__name__,
                         stream.resource_version or version)
            return stream.resource_version or version

    def _apply(self, view: View, index: int, role: str | None, kind: str, pod: dict[str, Any]) -> None:
        pods = dict(self.pods.get(index, {}))
        record = self._record(pod, role) if kind in ("ADDED", "MODIFIED") else None
        key = _pod_key(pod)
        causes = None
        if record is None:
            causes = {key: LEFT} if pods.pop(key, None) is not None else None
        else:
            pods[key] = record
        self.pods[index] = pods
        self._report(view, index, relist=False, causes=causes)

    def _record(self, pod: dict[str, Any], role: str | None) -> MemberRecord | None:
        try:
            return pod_record(pod, role, self.port)
        except RecordError as exc:
            meta = pod.get("metadata") or {}
            key = (_pod_key(pod), meta.get("resourceVersion", ""))
            if key not in self._warned:
                self._warned.add(key)
                log.warning("membership: skipping pod %s: %s", key[0], exc)
            return None

    def _report(self, view: View, index: int, relist: bool, causes: dict[str, str] | None = None) -> None:
        """One view of every selector's pods (keys carry the selector's index: a pod two selectors match is
        listed by each)."""
        merged = {f"{i}/{key}": record for i, pods in self.pods.items() for key, record in pods.items()}
        view.replace(self.name, merged, relist=relist,
                     causes={f"{index}/{key}": cause for key, cause in (causes or {}).items()})

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()


def client_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("kubernetes_asyncio") is not None


def _pod_key(pod: dict[str, Any]) -> str:
    meta = pod.get("metadata") or {}
    return f"{meta.get('namespace', '')}/{meta.get('name', '')}"


def _own_namespace() -> str:
    try:
        with open(_SA_NAMESPACE) as f:
            return f.read().strip()
    except OSError:
        return "default"


async def _api_client() -> Any:
    """In a pod: its service account; elsewhere: the kubeconfig ($KUBECONFIG or ~/.kube/config)."""
    from kubernetes_asyncio import client, config

    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        configuration = client.Configuration()
        config.load_incluster_config(client_configuration=configuration)
        return client.ApiClient(configuration)
    return await config.new_client_from_config()
