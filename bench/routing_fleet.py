"""The instances and routers bench/routing.py measures: four pdserve instances publishing KV events (colocated, or
2P2D pull), and one router at a time in front of them (a pdserve gateway with a policy, or vllm-router)."""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path
from typing import Any

import gateway as G
import harness as H
from peers import wait_healthy
from routing_reference import BS

MAX_MODEL_LEN = 8192


def start_router(policy: str, topology: str, insts: dict[str, Any], model: Path, servers: H.Servers,
                 cleanup: H.Cleanup, explain: bool = False, base: str | None = None, conditional: bool = False
                 ) -> tuple[str, int, Any, Path | None]:
    """(url, pid whose process tree is the router, a stopper, the log kv_aware explains its picks in). A policy
    named `base:POLICY` runs POLICY in the gateway of the checkout `base`. `conditional`: pdserve's pull gateways
    send a request to D alone where D holds most of its prompt (vllm-router has no such mode)."""
    colocated = topology == "colocated"
    root = None
    if policy.startswith("base:"):
        if not base:
            raise ValueError(f"{policy} wants --base DIR")
        root, policy = base, policy.removeprefix("base:")
    policy, _, weight = policy.partition("@")
    if policy.startswith("vllm-router"):
        port = H.free_port()
        members = (["--worker-urls", *[i.url for i in insts.values()], "--policy", "cache_aware"] if colocated else
                   ["--vllm-pd-disaggregation", "--prefill", insts["P1"].url, "--prefill", insts["P2"].url,
                    "--decode", insts["D1"].url, "--decode", insts["D2"].url, "--prefill-policy", "cache_aware",
                    "--decode-policy", "round_robin"])
        proc = subprocess.Popen([G.peer_exe("vllm-router"), "--host", "127.0.0.1", "--port", str(port), *members,
                                 "--prometheus-host", "127.0.0.1", "--prometheus-port", str(H.free_port()),
                                 "--log-level", "warning"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        stop = G.Proc("vllm-router", proc, url, Path("/tmp")).stop
        cleanup.add(stop)
        wait_healthy(url, proc, 90)
        return url, proc.pid, stop, None
    members = (["--protocol", "colocated", "--both", *[i.url for i in insts.values()]] if colocated else
               ["--protocol", "pull", "--prefill", insts["P1"].url, insts["P2"].url, "--decode", insts["D1"].url,
                insts["D2"].url, *(["--conditional"] if conditional else [])])
    explained = explain and policy == "kv_aware"
    tuned = ["--kv-overlap-weight", weight] if weight else []
    # `python -m` puts the working directory first on sys.path, ahead of PYTHONPATH: a base gateway runs in its own
    # checkout (`env` execs it, so its PID is still the one measured).
    wrap = ["env", f"--chdir={root}", f"PYTHONPATH={root}"] if root else None
    gw = servers.gateway(f"gw-{'base-' if root else ''}{policy}{weight}", *members, "--policy", policy, "--tokenizer",
                         str(model), *tuned, "--disable-log-requests", log_level="debug" if explained else "warning",
                         wrap=wrap)
    if policy == "kv_aware":
        wait_live(gw.url, len(insts))
    return gw.url, gw.pid, gw.stop, gw.log_path if explained else None


def wait_live(url: str, count: int, timeout: float = 60) -> None:
    """A kv_aware gateway is measured once every instance's subscription is live."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if httpx.get(url + "/metrics", timeout=5).text.count('state="live"} 1.0') >= count:
            return
        time.sleep(0.2)
    raise RuntimeError("the kv_aware gateway's subscriptions did not come up")


def start_instances(topology: str, model: Path, args: argparse.Namespace, servers: H.Servers) -> dict[str, Any]:
    events = json.dumps({"enable_kv_cache_events": True, "endpoint": "tcp://*:0", "replay_endpoint": "tcp://*:0"})
    roles = {"colocated": {f"C{n}": None for n in range(1, 5)},
             "pull": {"P1": "kv_producer", "P2": "kv_producer", "D1": "kv_consumer", "D2": "kv_consumer"}}[topology]
    insts = {}
    for name, role in roles.items():
        extra = ["--kv-transfer-config", H.kv_config(role)] if role else []
        insts[name] = servers.instance(name, model, "--max-model-len", str(min(MAX_MODEL_LEN, args.blocks * BS)),
                                       "--num-kv-blocks", str(args.blocks), "--threads", "1", "--dtype", args.dtype,
                                       "--kv-events-config", events, "--served-model-name", "m",
                                       "--disable-log-requests", *extra)
    return insts
