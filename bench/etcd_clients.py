"""Which Python etcd client membership uses: pdserve's JSON-gateway client vs aetcd vs etcd3aio, one real etcd.

Each client runs in a process of its own (aetcd's and etcd3aio's generated protobufs cannot share one), against
the same etcd on loopback, in rotating order. Measured per client:

* put: the client's clock around `put` (sequential, small record-sized values), median and p99;
* watch: from just before a `put` until the prefix watch delivers the event, median and p99;
* CPU: the client process's user+system time (all its threads, gRPC's included) per put+watch pair;
* failover: the etcd is a three-member cluster and each client is given every member (aetcd takes one: the
  first); the member listed first is SIGKILLed for 2 s and started again on its data. Seconds from the kill until
  a `put` through the same client object succeeds, and until the already-open watch loop (which re-creates its
  watch when the stream breaks, as membership does) delivers the next event ("hung" when it never does in 15 s).
  Under 2 s: the client moved to another member; over 2 s: it waited for the killed one to come back.

    .venv/bin/python bench/etcd_clients.py [--ops 300] [--rounds 2] [--json bench/out/etcd_clients.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCH), str(BENCH.parent / "tests")]
import harness as H  # noqa: E402
from etcd_cluster import EtcdCluster  # noqa: E402

CLIENTS = ("pdserve", "aetcd", "etcd3aio")
VALUE = b'{"version":1,"url":"http://10.0.0.1:8000","role":"decode","model":"tiny","labels":{}}' * 4


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class PdserveClient:
    def __init__(self, endpoint: str) -> None:
        from pdserve.membership.etcd_client import EtcdClient

        self.client = EtcdClient(endpoint.split(","))

    async def put(self, key: bytes, value: bytes) -> None:
        await self.client.put(key, value)

    async def watch(self, prefix: bytes, on_event) -> None:
        from pdserve.membership.etcd_client import EtcdUnavailable

        _, revision = await self.client.get_prefix(prefix)
        while True:
            try:
                async for batch in self.client.watch_prefix(prefix, revision + 1):
                    for event in batch:
                        revision = event.kv.mod_revision
                        on_event(event.kv.key)
            except EtcdUnavailable:
                await asyncio.sleep(0.1)
                try:
                    _, revision = await self.client.get_prefix(prefix)
                except EtcdUnavailable:
                    pass


class AetcdClient:
    def __init__(self, endpoint: str) -> None:
        import aetcd

        host, port = endpoint.split(",")[0].split(":")
        self.client = aetcd.Client(host, int(port))

    async def put(self, key: bytes, value: bytes) -> None:
        await self.client.put(key, value)

    async def watch(self, prefix: bytes, on_event) -> None:
        while True:
            try:
                watch = await self.client.watch_prefix(prefix)
                async for event in watch:
                    on_event(event.kv.key)
            except Exception:  # noqa: BLE001 - any error ends this watch; make a new one, as a user would
                await asyncio.sleep(0.1)


class Etcd3aioClient:
    def __init__(self, endpoint: str) -> None:
        from etcd3aio import Etcd3Client

        self.client = Etcd3Client(endpoint.split(","))
        self.connected = False

    async def put(self, key: bytes, value: bytes) -> None:
        if not self.connected:
            await self.client.connect()
            self.connected = True
        await self.client.kv.put(key, value)

    async def watch(self, prefix: bytes, on_event) -> None:
        from etcd3aio import prefix_range_end

        if not self.connected:
            await self.client.connect()
            self.connected = True
        while True:
            try:
                async for response in self.client.watch.watch(prefix, prefix_range_end(prefix)):
                    for event in response.events:
                        on_event(event.kv.key)
            except Exception:  # noqa: BLE001
                await asyncio.sleep(0.1)


async def measure(name: str, endpoint: str, ops: int, control: Path) -> dict:
    client = {"pdserve": PdserveClient, "aetcd": AetcdClient, "etcd3aio": Etcd3aioClient}[name](endpoint)
    seen: dict[bytes, float] = {}
    waiting: dict[bytes, asyncio.Event] = {}

    def on_event(key: bytes) -> None:
        seen[key] = time.perf_counter()
        if key in waiting:
            waiting[key].set()

    prefix = f"/bench/{name}/{time.monotonic_ns()}/".encode()
    watcher = asyncio.create_task(client.watch(prefix, on_event))
    await client.put(prefix + b"warm", VALUE)
    await asyncio.sleep(0.5)
    puts, watches = [], []
    cpu0 = cpu_s()
    for i in range(ops):
        key = prefix + str(i).encode()
        waiting[key] = event = asyncio.Event()
        t0 = time.perf_counter()
        await client.put(key, VALUE)
        puts.append(time.perf_counter() - t0)
        await asyncio.wait_for(event.wait(), 10)
        watches.append(seen[key] - t0)
    cpu = (cpu_s() - cpu0) / ops
    result = {"put": asdict(H.Summary.of(puts)), "watch": asdict(H.Summary.of(watches)), "cpu_us": cpu * 1e6,
              "put_p99": sorted(puts)[int(0.99 * len(puts))], "watch_p99": sorted(watches)[int(0.99 * len(watches))]}
    result.update(await reconnect(client, prefix, waiting, control))
    watcher.cancel()
    return result


async def reconnect(client, prefix: bytes, waiting: dict, control: Path) -> dict:
    """Ask the parent to kill and restart etcd (through files), then time the recovery."""
    control.with_suffix(".kill").touch()
    while not control.with_suffix(".killed").exists():
        await asyncio.sleep(0.01)
    restarted = time.perf_counter()
    put_ok = None
    key = prefix + b"after"
    waiting[key] = event = asyncio.Event()
    while time.perf_counter() - restarted < 15:
        try:
            await asyncio.wait_for(client.put(key, VALUE), 2)
            put_ok = time.perf_counter() - restarted
            break
        except Exception:  # noqa: BLE001 - whatever the client raises while etcd is coming back
            await asyncio.sleep(0.05)
    watch_ok = None
    deadline = restarted + 15
    n = 0
    while watch_ok is None and time.perf_counter() < deadline:
        try:
            await asyncio.wait_for(event.wait(), 0.5)
            watch_ok = time.perf_counter() - restarted
        except TimeoutError:
            n += 1  # the first put may have landed before the watch came back: write again
            key = prefix + b"after%d" % n
            waiting[key] = event = asyncio.Event()
            try:
                await asyncio.wait_for(client.put(key, VALUE), 2)
            except Exception:  # noqa: BLE001
                pass
    return {"reconnect_put_s": put_ok, "reconnect_watch_s": watch_ok}


def child(name: str, endpoint: str, ops: int, control: str) -> None:
    print(json.dumps(asyncio.run(measure(name, endpoint, ops, Path(control)))), flush=True)


def run_one(name: str, cluster: EtcdCluster, ops: int, tmp: Path) -> dict:
    control = tmp / f"{name}-{time.monotonic_ns()}.ctl"
    proc = subprocess.Popen([sys.executable, __file__, "--child", name, cluster.endpoints, str(ops),
                             str(control)], stdout=subprocess.PIPE, text=True)
    while not control.with_suffix(".kill").exists():
        if proc.poll() is not None:
            raise RuntimeError(f"{name} client exited early")
        time.sleep(0.02)
    cluster.members[0].kill()
    control.with_suffix(".killed").touch()
    time.sleep(2)
    cluster.start_member(cluster.members[0])
    out, _ = proc.communicate(timeout=120)
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ops", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--child", nargs=4, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], args.child[1], int(args.child[2]), args.child[3])
        return
    results: dict[str, list[dict]] = {name: [] for name in CLIENTS}
    with tempfile.TemporaryDirectory(prefix="pdserve-etcd-bench-") as tmp:
        cluster = EtcdCluster(Path(tmp), 3).start()
        try:
            for r in range(args.rounds):
                for name in CLIENTS[r % len(CLIENTS):] + CLIENTS[:r % len(CLIENTS)]:
                    results[name].append(run_one(name, cluster, args.ops, Path(tmp)))
        finally:
            cluster.stop()
    print(f"{'client':10} {'put p50 ms':>10} {'p99':>7} {'watch p50 ms':>12} {'p99':>7} {'CPU us/op':>9} "
          f"{'put back s':>10} {'watch back s':>12}")
    for name, runs in results.items():
        def med(key: str, sub: str | None = None, runs=runs) -> float:
            values = [r[key][sub] if sub else r[key] for r in runs]
            return H.median([v for v in values if v is not None]) if any(v is not None for v in values) else None
        print(f"{name:10} {med('put', 'median') * 1e3:10.2f} {med('put_p99') * 1e3:7.2f} "
              f"{med('watch', 'median') * 1e3:12.2f} {med('watch_p99') * 1e3:7.2f} {med('cpu_us'):9.0f} "
              f"{H.fmt(med('reconnect_put_s')):>10} {H.fmt(med('reconnect_watch_s'), '.2f') if med('reconnect_watch_s') is not None else 'hung':>12}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"cpu": H._cpu_info()[0], "results": results}, indent=1))


if __name__ == "__main__":
    main()
