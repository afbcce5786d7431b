"""The membership flags of `pdserve gateway`, and `pdserve register`, the sidecar for instances that cannot
register themselves (vLLM)."""

from __future__ import annotations

import argparse

from pdserve.membership.discovery import DEFAULT_RELIST_S

DISCOVERY_KEYS = ("discovery", "discovery_relist_s", "selector", "prefill_selector", "decode_selector",
                  "both_selector", "encode_selector", "discovery_namespace", "discovery_port")


def add_discovery_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--discovery", default=None, metavar="URL",
                   help="follow the fleet's membership: etcd://HOST:PORT[,HOST:PORT...]/PREFIX, or k8s (pods of this "
                        "namespace), k8s://NAMESPACE; with etcd, /register writes through to it")
    p.add_argument("--discovery-relist-seconds", dest="discovery_relist_s", type=float, default=None,
                   metavar="SECONDS", help=f"list the whole membership at least this often, besides following "
                                           f"changes (default {DEFAULT_RELIST_S:g})")
    p.add_argument("--selector", default=None, metavar="K=V[,K=V]",
                   help="k8s: pods matching this label selector; role from pdserve.io/role or llm-d.ai/role")
    for role in ("prefill", "decode", "both", "encode"):
        p.add_argument(f"--{role}-selector", default=None, metavar="K=V[,K=V]",
                       help=f"k8s: pods matching this label selector are {role} instances")
    p.add_argument("--discovery-namespace", default=None, metavar="NAMESPACE",
                   help="k8s: the namespace to watch (default: the gateway pod's own)")
    p.add_argument("--discovery-port", type=int, default=None, metavar="PORT",
                   help="k8s: the instances' port when no pdserve.io/port annotation says (default 8000)")
