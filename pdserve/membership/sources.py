"""The gateway's discovery backends, from its configuration: the static list first, then the store it follows.

Without a store, `POST /register` keeps registrations in this gateway (PushDiscovery); with etcd it writes them
through to etcd, so every gateway following the prefix sees them. Kubernetes takes no writes: there `/register`
stays local to the gateway, beside the pods it discovers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.membership.discovery import DEFAULT_RELIST_S, Discovery, PushDiscovery, StaticDiscovery
from pdserve.membership.record import MemberRecord
from pdserve.membership.url import parse_discovery


@dataclass(frozen=True)
class KubernetesOptions:
    selector: str | None = None  # every matching pod; its role from labels
    role_selectors: dict[str, str] = field(default_factory=dict)  # role -> label selector (vllm-router's flags)
    namespace: str | None = None
    port: int | None = None  # the instances' port when no label or annotation says


def discovery_sources(static: list[MemberRecord], url: str | None, relist_s: float = DEFAULT_RELIST_S,
                      k8s: KubernetesOptions | None = None) -> list[Discovery]:
    """Raises ValueError (a startup error) for a `--discovery` URL that cannot be parsed."""
    sources: list[Discovery] = [StaticDiscovery(static, relist_s)] if static else []
    spec = parse_discovery(url) if url else None
    if spec is not None and spec.kind == "etcd":
        from pdserve.membership.etcd_client import EtcdClient
        from pdserve.membership.etcd_discovery import EtcdDiscovery

        sources.append(EtcdDiscovery(EtcdClient(list(spec.endpoints), timeout_s=1.0), spec.prefix, relist_s))
        return sources
    if spec is not None and spec.kind == "k8s":
        from pdserve.membership.k8s import KubernetesDiscovery, client_installed

        if not client_installed():
            raise ValueError("--discovery k8s needs the Kubernetes client: pip install 'pdserve[kubernetes]'")

        options = k8s or KubernetesOptions()
        sources.append(KubernetesDiscovery(options.selector, options.role_selectors,
                                           options.namespace or spec.namespace, options.port, relist_s))
    sources.append(PushDiscovery(relist_s))
    return sources
