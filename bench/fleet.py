"""The fleet beyond one gateway: membership on etcd (and Kubernetes) side by side with the static setup.

Real processes on loopback: a three-member etcd (Debian's etcd-server), pdserve instances of a tiny model
registering themselves, gateways following etcd, and beside them a static gateway (flags, or `/register` without
a store) in front of the same instances. Everything is measured through public seams: the client's clock around
HTTP calls, the gateways' `/instances` and `/metrics`, the etcd key as a client sees it. Sections:

* `timing`: a SIGKILLed instance out of every gateway's routing (lease TTL 10 s and 2 s; static: its breaker);
  a drained instance out (etcd: the record says draining; static: its /health says so); a new instance routable
  after its registration (etcd: from the key's appearance; static: from `POST /register`).
* `missed`: a delete the watch never delivered (FakeKubeApiServer, a FAKE API server: none can run here) corrected
  by the next relist, against the relist period.
* `outage`: etcd fully down for `--outage` seconds (60) under steady load through an etcd gateway and a static
  one: failed requests, and how long the etcd gateway takes to follow etcd once it is back.
* `chaos`: three gateways on etcd, 2P2D (pull), a retrying client (the OpenAI SDK's policy: 2 retries on
  connection errors and 5xx, each on the next gateway as a load balancer would); one gateway SIGKILLed, one etcd
  member SIGKILLed, then a rolling restart of every P and D (a new one joins, the old one drains), every answer
  checked against a colocated instance, and KV blocks in use on every instance at the end. Side by side: the same
  load and rolling restart (each instance restarted on its port) behind one static gateway.
* `cpu`: gateway CPU per request on instant stub backends (bench/stub_backend.py), static flags against etcd
  membership, c=32 under wrk, rounds alternating.

    .venv/bin/python bench/fleet.py [--sections timing,missed,outage,chaos,cpu] [--outage 60] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCH), str(BENCH.parent / "tests")]
import harness as H  # noqa: E402
from etcd_cluster import EtcdCluster  # noqa: E402
from fake_kube_api import FakeKubeApiServer, make_pod  # noqa: E402

from pdserve.launcher import Process, start  # noqa: E402

PROMPTS = ["the fleet keeps serving", "one gateway fell", "a rolling restart", "etcd lost a member"]
SERVE = ("--num-kv-blocks", "128", "--max-model-len", "256", "--served-model-name", "tiny", "--admin-token",
         "adm1n", "--log-level", "warning", "--disable-log-requests")
ADMIN = {"Authorization": "Bearer adm1n"}


def body(prompt: str) -> dict:
    return {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}


class Fleet:
    """The processes of one section, stopped by PID at the end."""

    def __init__(self, model: Path, etcd: EtcdCluster | None, prefix: str) -> None:
        self.model, self.etcd, self.prefix = model, etcd, prefix
        self.procs: list[Process] = []

    def instance(self, role: str, ttl: int = 10, discovery: bool = True, port: int = 0, name: str = "") -> Process:
        kv = [] if role == "both" else ["--role", role]
        disc = ["--discovery", self.etcd.url(self.prefix), "--discovery-ttl", str(ttl)] if discovery else []
        proc = start(name or role, ["serve", str(self.model), "--host", "127.0.0.1", "--port", str(port), *kv,
                                    *SERVE, *disc])
        self.procs.append(proc)
        return proc

    def gateway(self, protocol: str, *flags: str, etcd: bool = True) -> Process:
        disc = ["--discovery", self.etcd.url(self.prefix)] if etcd else []
        proc = start("gateway", ["gateway", "--port", "0", "--protocol", protocol, "--admin-token", "adm1n",
                                 "--log-level", "warning", "--disable-log-requests", *disc, *flags])
        self.procs.append(proc)
        return proc

    def stop(self) -> None:
        for proc in self.procs:
            proc.stop()


def instances(g: Process) -> dict[str, bool]:
    try:
        return {i["url"]: i["healthy"] for i in httpx.get(g.url + "/instances", timeout=5).json()}
    except httpx.HTTPError:
        return {}


def until(predicate, timeout: float = 60.0, step: float = 0.01) -> float:
    """Seconds until `predicate` holds (polled every `step`), or raise after `timeout`."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if predicate():
            return time.monotonic() - t0
        time.sleep(step)
    raise TimeoutError("condition not met")


def firsts(conditions: dict[str, Any], timeout: float) -> dict[str, float]:
    """Seconds until each condition first held, all polled together."""
    t0, seen = time.monotonic(), {}
    while len(seen) < len(conditions) and time.monotonic() - t0 < timeout:
        for key, predicate in conditions.items():
            if key not in seen and predicate():
                seen[key] = time.monotonic() - t0
        time.sleep(0.01)
    if len(seen) < len(conditions):
        raise TimeoutError(f"not met within {timeout} s: {sorted(set(conditions) - set(seen))}")
    return seen


def routed(g: Process, url: str) -> bool:
    return instances(g).get(url, False)


def metric(g: Process, name: str, label: str = "") -> float:
    for line in httpx.get(g.url + "/metrics", timeout=5).text.splitlines():
        if line.startswith(name) and label in line:
            return float(line.rsplit(" ", 1)[1])
    return float("nan")


# ---------------------------------------------------------------------------------------------- timing


def timing(model: Path, etcd: EtcdCluster, reps: int) -> dict[str, Any]:
    fleet = Fleet(model, etcd, "/timing")
    out: dict[str, list[float]] = {}
    try:
        base = fleet.instance("both")
        g1, g2 = fleet.gateway("colocated"), fleet.gateway("colocated")
        gs = fleet.gateway("colocated", etcd=False)
        for rep in range(reps):
            for ttl in (10, 2):
                victim = fleet.instance("both", ttl)
                httpx.post(gs.url + "/register", headers=ADMIN, json={"url": victim.url, "role": "both"})
                until(lambda: all(routed(g, victim.url) for g in (g1, g2, gs)))
                victim.kill()
                seen = firsts({f"kill_ttl{ttl}_etcd_unrouted": lambda: not routed(g1, victim.url),
                               f"kill_ttl{ttl}_etcd_gone": lambda: victim.url not in instances(g1),
                               f"kill_ttl{ttl}_etcd_gone_g2": lambda: victim.url not in instances(g2),
                               f"kill_ttl{ttl}_static_unrouted": lambda: not routed(gs, victim.url)}, 30)
                for key, value in seen.items():
                    out.setdefault(key, []).append(value)
                httpx.post(gs.url + "/deregister", headers=ADMIN, json={"url": victim.url})
            out_join, out_drain = join_and_drain(fleet, g1, g2, gs)
            for key, value in {**out_join, **out_drain}.items():
                out.setdefault(key, []).append(value)
            print(f"[timing {rep + 1}/{reps}] " + ", ".join(f"{k} {v[-1]:.2f}" for k, v in out.items()), flush=True)
        assert base.alive()
    finally:
        fleet.stop()
    return {k: {"max": max(v), "median": H.median(v), "n": len(v)} for k, v in out.items()}


def join_and_drain(fleet: Fleet, g1: Process, g2: Process, gs: Process) -> tuple[dict, dict]:
    import asyncio

    from pdserve.membership.etcd_client import EtcdClient
    from pdserve.membership.record import member_key

    async def key_appears(url_holder: list) -> float:
        client = EtcdClient(fleet.etcd.endpoints.split(","))
        try:
            while not url_holder:
                await asyncio.sleep(0.005)
            key = member_key("/timing", url_holder[0]).encode()
            while True:
                kvs, _ = await client.get_prefix(key)
                if kvs:
                    return time.monotonic()
                await asyncio.sleep(0.005)
        finally:
            await client.close()

    holder: list = []
    port = H.free_port()
    holder.append(f"http://127.0.0.1:{port}")
    result: dict = {}
    watcher = threading.Thread(target=lambda: result.update(t=asyncio.run(key_appears(holder))), daemon=True)
    watcher.start()
    new = fleet.instance("both", 10, port=port, name="joiner")
    watcher.join(60)
    until(lambda: routed(g1, new.url) and routed(g2, new.url), 30, 0.005)
    joined = {"join_etcd_routable": time.monotonic() - result["t"]}
    static = fleet.instance("both", discovery=False, name="static-joiner")
    t0 = time.monotonic()
    httpx.post(gs.url + "/register", headers=ADMIN, json={"url": static.url, "role": "both"})
    until(lambda: routed(gs, static.url), 30, 0.005)
    joined["join_static_routable"] = time.monotonic() - t0
    httpx.post(gs.url + "/register", headers=ADMIN, json={"url": new.url, "role": "both"})
    until(lambda: routed(gs, new.url), 30, 0.005)
    httpx.post(new.url + "/admin/drain", headers=ADMIN, json={})
    drained = firsts({"drain_etcd_gone": lambda: new.url not in instances(g1) and new.url not in instances(g2),
                      "drain_static_unrouted": lambda: not routed(gs, new.url)}, 30)
    new.popen.wait(60)
    static.stop()
    for url in (new.url, static.url):
        httpx.post(gs.url + "/deregister", headers=ADMIN, json={"url": url})
    return joined, drained


# ---------------------------------------------------------------------------------------------- missed delete


def missed(work: Path, reps: int, relist_s: float = 5.0) -> dict[str, Any]:
    api = FakeKubeApiServer(work).start()
    proc = None
    try:
        api.put(make_pod("keep", "127.0.0.1", 41999, {"app": "d"}))
        proc = start("gateway", ["gateway", "--port", "0", "--discovery", "k8s://fleet", "--decode-selector",
                                 "app=d", "--discovery-relist-seconds", str(relist_s), "--log-level", "warning"],
                     env={"KUBECONFIG": str(api.kubeconfig())})
        seconds = []
        for rep in range(reps):
            name, url = f"gone-{rep}", f"http://127.0.0.1:{42000 + rep}"
            api.put(make_pod(name, "127.0.0.1", 42000 + rep, {"app": "d"}))
            until(lambda url=url: url in instances(proc), 20)
            time.sleep(relist_s * (rep + 1) / (reps + 1))  # the delete lands at different points of the period
            api.drop_events = True
            api.delete(name)
            api.drop_events = False
            seconds.append(until(lambda url=url: url not in instances(proc), 3 * relist_s))
        return {"relist_s": relist_s, "corrected_s": seconds, "max_s": max(seconds)}
    finally:
        if proc is not None:
            proc.stop()
        api.stop()


# ---------------------------------------------------------------------------------------------- load


class Load(threading.Thread):
    """Sequential requests round-robin over `gateways`, each retried as the OpenAI SDK does (2 retries, on
    connection errors and 5xx) on the next gateway; every answer compared with the oracle's."""

    def __init__(self, gateways: list[str], oracle: dict[str, str], retries: int = 2) -> None:
        super().__init__(daemon=True)
        self.gateways, self.oracle, self.retries = gateways, oracle, retries
        self.ok = self.failed = self.wrong = self.retried = 0
        self.errors: list[str] = []
        self.stop_at = float("inf")

    def run(self) -> None:
        i = 0
        with httpx.Client(timeout=60) as client:
            while time.monotonic() < self.stop_at:
                prompt = PROMPTS[i % len(PROMPTS)]
                self._one(client, prompt, i)
                i += 1

    def _one(self, client: httpx.Client, prompt: str, i: int) -> None:
        for attempt in range(self.retries + 1):
            url = self.gateways[(i + attempt) % len(self.gateways)]
            try:
                r = client.post(url + "/v1/completions", json=body(prompt))
            except httpx.HTTPError as exc:
                why = f"{url}: {type(exc).__name__}"
            else:
                if r.status_code == 200:
                    self.ok += 1
                    if r.json()["choices"][0]["text"] != self.oracle[prompt]:
                        self.wrong += 1
                    return
                why = f"{url}: {r.status_code} {r.text[:120]}"
                if r.status_code < 500:
                    break
            self.retried += attempt < self.retries
            time.sleep(0.2 * (attempt + 1))
        self.failed += 1
        self.errors.append(why)

    def finish(self) -> dict[str, Any]:
        self.stop_at = 0
        self.join(120)
        return {"ok": self.ok, "failed": self.failed, "wrong": self.wrong, "retried": self.retried,
                "errors": self.errors[:5]}


def oracle_answers(fleet: Fleet) -> tuple[dict[str, str], Process]:
    colocated = fleet.instance("both", discovery=False, name="oracle")
    return {p: httpx.post(colocated.url + "/v1/completions", json=body(p), timeout=60).json()["choices"][0]["text"]
            for p in PROMPTS}, colocated


def blocks_in_use(urls: list[str]) -> dict[str, float]:
    out = {}
    for url in urls:
        for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
            if line.startswith("pdserve:kv_blocks_in_use"):
                out[url] = float(line.rsplit(" ", 1)[1])
    return out


# ---------------------------------------------------------------------------------------------- outage


def outage(model: Path, etcd: EtcdCluster, seconds: float) -> dict[str, Any]:
    fleet = Fleet(model, etcd, "/outage")
    try:
        oracle, _ = oracle_answers(fleet)
        a, b = fleet.instance("both"), fleet.instance("both")
        ge = fleet.gateway("colocated", "--discovery-relist-seconds", "30")
        gs = fleet.gateway("colocated", "--both", a.url, b.url, etcd=False)
        until(lambda: routed(ge, a.url) and routed(ge, b.url) and routed(gs, a.url) and routed(gs, b.url))
        loads = {"etcd": Load([ge.url], oracle, retries=0), "static": Load([gs.url], oracle, retries=0)}
        for load in loads.values():
            load.start()
        time.sleep(3)
        for member in etcd.members:
            member.kill()
        down_at = time.monotonic()
        until(lambda: metric(ge, "pdserve:gateway_membership_stale", 'source="etcd"') == 1, 30, 0.05)
        time.sleep(max(0.0, seconds - (time.monotonic() - down_at)))
        for member in etcd.members:
            etcd.start_member(member, wait=False)
        etcd.wait_healthy(60)
        back = time.monotonic()
        caught_up = until(lambda: metric(ge, "pdserve:gateway_membership_stale", 'source="etcd"') == 0, 60, 0.02)
        time.sleep(3)
        results = {name: load.finish() for name, load in loads.items()}
        return {"down_s": back - down_at, "caught_up_after_etcd_healthy_s": caught_up, "load": results,
                "members_after": sorted(instances(ge)), "lease_survived": routed(ge, a.url) and routed(ge, b.url),
                "healthy_to_caught_up_note": "from the moment every member answered /health"}
    finally:
        fleet.stop()


# ---------------------------------------------------------------------------------------------- chaos


def chaos(model: Path, etcd: EtcdCluster) -> dict[str, Any]:
    return {"etcd": _chaos_etcd(model, etcd), "static": _chaos_static(model, etcd)}


def _chaos_etcd(model: Path, etcd: EtcdCluster) -> dict[str, Any]:
    fleet = Fleet(model, etcd, "/chaos")
    try:
        oracle, _ = oracle_answers(fleet)
        pd = {name: fleet.instance("prefill" if name[0] == "P" else "decode", 10, name=name)
              for name in ("P1", "P2", "D1", "D2")}
        gws = [fleet.gateway("pull") for _ in range(3)]
        until(lambda: all(all(routed(g, p.url) for p in pd.values()) for g in gws))
        load = Load([g.url for g in gws], oracle)
        load.start()
        time.sleep(3)
        gws[2].kill()
        time.sleep(2)
        etcd.members[0].kill()
        time.sleep(2)
        restarts = []
        for name, old in list(pd.items()):
            role = "prefill" if name[0] == "P" else "decode"
            new = fleet.instance(role, 10, name=f"{name}-new")
            until(lambda new=new: routed(gws[0], new.url) and routed(gws[1], new.url), 60)
            old.popen.send_signal(15)
            restarts.append({"instance": name, "exit": old.popen.wait(60)})
            pd[name] = new
            time.sleep(1)
        etcd.start_member(etcd.members[0])
        time.sleep(2)
        return _ended(load, restarts, pd)
    finally:
        fleet.stop()


def _chaos_static(model: Path, etcd: EtcdCluster) -> dict[str, Any]:
    fleet = Fleet(model, etcd, "/chaos-static")
    try:
        oracle, _ = oracle_answers(fleet)
        ports = {name: H.free_port() for name in ("P1", "P2", "D1", "D2")}
        role = {n: "prefill" if n[0] == "P" else "decode" for n in ports}
        pd = {n: fleet.instance(role[n], discovery=False, port=p, name=n) for n, p in ports.items()}
        gs = fleet.gateway("pull", "--prefill", pd["P1"].url, pd["P2"].url, "--decode", pd["D1"].url, pd["D2"].url,
                           etcd=False)
        until(lambda: all(routed(gs, p.url) for p in pd.values()))
        load = Load([gs.url], oracle)
        load.start()
        time.sleep(3)
        restarts = []
        for name in list(pd):
            old = pd[name]
            old.popen.send_signal(15)
            restarts.append({"instance": name, "exit": old.popen.wait(60)})
            pd[name] = fleet.instance(role[name], discovery=False, port=ports[name], name=f"{name}-new")
            until(lambda name=name: routed(gs, pd[name].url), 60)
            time.sleep(1)
        return _ended(load, restarts, pd)
    finally:
        fleet.stop()


def _ended(load: Load, restarts: list[dict], pd: dict[str, Process]) -> dict[str, Any]:
    """The load's outcome, and the KV blocks in use on every instance once it stopped."""
    result = load.finish()
    time.sleep(1)
    return {**result, "restarts": restarts, "blocks_in_use": blocks_in_use([p.url for p in pd.values()])}


# ---------------------------------------------------------------------------------------------- cpu


def cpu(etcd: EtcdCluster, rounds: int, seconds: int) -> dict[str, Any]:
    import asyncio

    import gateway as GW

    from pdserve.membership.etcd_client import EtcdClient
    from pdserve.membership.record import MemberRecord, encode_record, member_key

    cleanup = H.Cleanup()
    work = cleanup.work_dir("fleet-cpu")
    try:
        stubs = [GW.spawn(f"stub-{r[0].upper()}", [sys.executable, str(BENCH / "stub_backend.py"), "--port", "0"],
                          work, cleanup, ready_line=True) for r in ("prefill", "decode")]

        async def register() -> None:
            client = EtcdClient(etcd.endpoints.split(","))
            for stub, role in zip(stubs, ("prefill", "decode"), strict=True):
                record = MemberRecord(url=stub.url, role=role, model="stub", source="bench")
                await client.put(member_key("/cpu", stub.url).encode(), encode_record(record))
            await client.close()

        asyncio.run(register())
        common = ["--protocol", "pull", "--scheduling", "batch", "--policy", "round_robin", "--host", "127.0.0.1",
                  "--port", "0", "--log-level", "warning", "--disable-log-requests"]
        routers = {
            "static": GW.spawn("static", [sys.executable, "-m", "pdserve", "gateway", "--prefill", stubs[0].url,
                                          "--decode", stubs[1].url, *common], work, cleanup, ready_line=True),
            "etcd": GW.spawn("etcd", [sys.executable, "-m", "pdserve", "gateway", "--discovery", etcd.url("/cpu"),
                                      *common], work, cleanup, ready_line=True)}
        script = work / "c32.lua"
        script.write_text(GW.WRK_LUA.format(body=json.dumps(GW.BODY.decode())))
        bench = GW.Bench(stubs, routers, {"c32": script})
        runs: dict[str, list[dict]] = {"static": [], "etcd": []}
        for rnd in range(rounds):
            names = ["static", "etcd"] if rnd % 2 == 0 else ["etcd", "static"]
            for name in names:
                GW.run_wrk(routers[name].url, script, 32, 1)
                run = bench.run(name, routers[name].url, "c32", 32, seconds)
                runs[name].append(run)
                print(f"[cpu {rnd + 1}/{rounds}] {name:6s} {run['rps']:7.0f} req/s  gateway "
                      f"{run['router_us_per_req']:.0f} us/req  errors {run['errors']}  others "
                      f"{run['others_cores']:.2f}", flush=True)
        med = {n: H.median([r["router_us_per_req"] for r in v]) for n, v in runs.items()}
        return {"runs": runs, "median_us_per_req": med, "etcd_over_static": med["etcd"] / med["static"]}
    finally:
        cleanup.run()


# ---------------------------------------------------------------------------------------------- main


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sections", default="timing,missed,outage,chaos,cpu")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--outage", type=float, default=60.0)
    ap.add_argument("--cpu-rounds", type=int, default=4)
    ap.add_argument("--cpu-seconds", type=int, default=8)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    sections = args.sections.split(",")
    cleanup = H.Cleanup()
    work = cleanup.work_dir("fleet")
    from pdserve.modelgen import make_text_model

    model = make_text_model("llama", work / "tiny")
    etcd = EtcdCluster(work / "etcd", 3).start()
    cleanup.add(etcd.stop)
    print(f"# fleet ({H._cpu_info()[0]}, {os.cpu_count()} cores, load {H.loadavg()})", flush=True)
    results: dict[str, Any] = {}
    try:
        for section in sections:
            t0 = time.monotonic()
            if section == "timing":
                results[section] = timing(model, etcd, args.reps)
            elif section == "missed":
                results[section] = missed(work, args.reps)
            elif section == "outage":
                results[section] = outage(model, etcd, args.outage)
            elif section == "chaos":
                results[section] = chaos(model, etcd)
            elif section == "cpu":
                results[section] = cpu(etcd, args.cpu_rounds, args.cpu_seconds)
            print(f"## {section} ({time.monotonic() - t0:.0f} s)\n" + json.dumps(
                {k: v for k, v in results[section].items() if k != "runs"}, indent=1, default=str), flush=True)
        H.write_json(args.json, results)
        return 0
    finally:
        cleanup.run()


if __name__ == "__main__":
    sys.exit(main())
