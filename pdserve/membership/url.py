"""`--discovery` URLs: `etcd://HOST:PORT[,HOST:PORT...]/PREFIX`, `k8s` or `k8s://NAMESPACE`, `static`.

A URL that cannot be parsed is a startup error (one line, exit status 2), never a gateway or instance that runs
without the membership its operator asked for.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

DEFAULT_PREFIX = "/pdserve"


@dataclass(frozen=True, slots=True)
class DiscoveryUrl:
    kind: str  # static, etcd or k8s
    endpoints: tuple[str, ...] = ()  # etcd: host:port of each member
    prefix: str = DEFAULT_PREFIX  # etcd: the key prefix
    namespace: str | None = None  # k8s: None = the pod's own namespace (in a cluster) or the kubeconfig's


def parse_discovery(url: str) -> DiscoveryUrl:
    text = url.strip()
    if text in ("static", "k8s", "kubernetes"):
        return DiscoveryUrl("k8s" if text != "static" else "static")
    scheme, sep, _ = text.partition("://")
    if not sep or scheme not in ("etcd", "k8s", "kubernetes"):
        raise ValueError(f"cannot parse --discovery {url!r}: expected etcd://HOST:PORT[,HOST:PORT...]/PREFIX, "
                         "k8s, k8s://NAMESPACE or static")
    parts = urlsplit(text)
    if scheme != "etcd":
        namespace = parts.netloc or None
        if namespace is not None and not _dns_label(namespace):
            raise ValueError(f"cannot parse --discovery {url!r}: {namespace!r} is not a Kubernetes namespace name")
        return DiscoveryUrl("k8s", namespace=namespace)
    if parts.query or parts.fragment:
        raise ValueError(f"cannot parse --discovery {url!r}: no query or fragment is taken")
    endpoints = tuple(_endpoint(url, e) for e in parts.netloc.split(","))
    prefix = parts.path.rstrip("/") or DEFAULT_PREFIX
    return DiscoveryUrl("etcd", endpoints, prefix)


def _endpoint(url: str, text: str) -> str:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"cannot parse --discovery {url!r}: etcd endpoint {text!r} is not HOST:PORT")
    return text


def _dns_label(name: str) -> bool:
    return 0 < len(name) <= 63 and name.replace("-", "a").isalnum() and name.islower() and name[0] != "-" \
        and name[-1] != "-"
