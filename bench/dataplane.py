"""KV data planes against their machine limits, on one host and across simulated hosts: shm and nixl against a
memcpy, tcp, nixl and mooncake (over its TCP transport) against a raw socket, in the same rounds.

One pass per (where, block size), each with two processes started from this file: the pool owner (one pool per data
plane, pre-touched, each block's first element its id, served with an allow-all authorizer, and a raw socket server
over the tcp plane's pool) and the reader, which moves blocks through each plane's public seam into its own pool:
`plane.connect(info).read_blocks(...)` (pull), and `write_blocks(...)` for the methods ending in `_w` (push). Limits,
the same bytes in the same rounds:
  memcpy: `dst.copy_(src)` between two private tensors of the reader (what a one-host plane can reach);
  raw: a 16-byte request, then `sendall` straight from the owner's pool, `recv_into` the reader's, TCP_NODELAY;
  cma (one host): one `process_vm_readv` from the owner's pool, the kernel copy UCX's cross-memory attach makes.
Where: `host` = both processes in the root namespaces on 127.0.0.1 (UCX may use cross-memory attach); `netns` = the
owner in its own network and PID namespace, the reader in another (tests/netns.py), joined by a bridge: every byte,
the raw socket's too, crosses the same veth path, as between two hosts (shm cannot, and is left out).
Blocks: 64 KiB (the h256 model's: 4 layers x K/V x 2 heads x 16 tokens x 64 dims, fp32) and 2 MiB (a Llama-3-8B bf16
block's size: 32 layers x K/V x 8 heads x 16 tokens x 64 fp32 here). Every round moves --read-mib per method with ids
consecutive or scattered at random on both sides (and one block alone: the fixed cost); the order rotates, each method its own random region each round;
rounds others disturbed are dropped when enough quiet ones remain.

  .venv/bin/python bench/dataplane.py --quick                                 # smoke run (~1 min)
  .venv/bin/python bench/dataplane.py --json bench/out/dataplane.json         # the tables in docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import random
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "2")
sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness as H  # noqa: E402
from pdserve.kv_transfer.data_plane.tcp import recv_exact  # noqa: E402

TARGETS = {"host": ("nixl", "memcpy", 0.8), "netns": ("nixl", "raw", 0.5)}  # where -> (method, limit, ratio)
SHAPES = {64: (4, 2, 2, 16, 64), 2048: (32, 2, 8, 16, 64)}  # block KiB -> [layers, K/V, heads, tokens, dims] fp32
LIMITS = {"host": ("memcpy", "raw", "cma"), "netns": ("raw",)}
_REQ = struct.Struct("!QQ")  # raw socket request: offset, nbytes (0 closes)


def planes_at(where: str) -> list[str]:
    from pdserve.kv_transfer.data_plane import DATA_PLANES

    return [p for p in ("shm", "tcp", "nixl", "mooncake") if p in DATA_PLANES and (p != "shm" or where == "host")]


def methods_at(where: str) -> list[str]:
    return [*LIMITS[where], *(m for p in planes_at(where) for m in (p, f"{p}_w") if m != "shm_w")]


def limits_for(where: str, method: str) -> tuple[str, ...]:
    """The limits a method is judged against: memcpy and cma only where both ends share a host's memory."""
    if where == "netns" or method.startswith(("tcp", "mooncake")):
        return ("raw",)
    return ("memcpy", "cma") if method == "shm" else LIMITS[where]


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def cma_read(pid: int, remote_addr: int, local_addr: int, nbytes: int) -> None:
    """One process_vm_readv of a contiguous span: the kernel copy UCX's cross-memory-attach transport makes."""
    local, remote = _Iovec(local_addr, nbytes), _Iovec(remote_addr, nbytes)
    if ctypes.CDLL(None, use_errno=True).process_vm_readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1,
                                                          0) != nbytes:
        raise OSError(ctypes.get_errno(), "process_vm_readv")


def _raw_serve(listener: socket.socket, pool: memoryview) -> None:
    conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    head = bytearray(_REQ.size)
    with conn:
        try:
            while True:
                recv_exact(conn, memoryview(head))
                offset, nbytes = _REQ.unpack(head)
                if nbytes == 0:
                    return
                conn.sendall(pool[offset:offset + nbytes])
        except (OSError, ConnectionError):
            return


def owner_main(args: argparse.Namespace) -> None:
    """Serve one pool per plane and a raw socket; announce them in a ready line; run until SIGTERM."""
    import torch

    from pdserve.kv_transfer.data_plane import make_data_plane
    from pdserve.kv_transfer.data_plane.base import byte_view

    planes, infos = {}, {}
    for name in planes_at(args.where):
        plane = make_data_plane(name, args.host)
        kv = plane.allocate((args.num_blocks, *args.shape), torch.float32)
        kv.fill_(1.0)
        kv.view(args.num_blocks, -1)[:, 0] = torch.arange(args.num_blocks, dtype=torch.float32)
        plane.start(lambda op, key, token, ids: None)
        planes[name], infos[name] = plane, plane.local_info()
    listener = socket.create_server((args.host, 0))
    threading.Thread(target=_raw_serve, args=(listener, byte_view(planes["tcp"].kv)), daemon=True).start()
    print(json.dumps({"event": "ready", "infos": infos, "raw": [args.host, listener.getsockname()[1]]}), flush=True)
    stop = {signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop)
    signal.sigwait(stop)


class Paths:
    """Every way the reader moves N blocks, each a callable (remote ids, local ids)."""

    def __init__(self, args: argparse.Namespace, hello: dict[str, Any]) -> None:
        import torch

        from pdserve.kv_transfer.data_plane import make_data_plane
        from pdserve.kv_transfer.data_plane.base import byte_view

        self.n, self.block_bytes = args.num_blocks, args.block_bytes
        self.planes, self.peers = {}, {}
        for name in planes_at(args.where):  # the reader's pool allocated as an instance would (shm: memfd)
            self.planes[name] = make_data_plane(name, "127.0.0.1")
            self.planes[name].allocate((self.n, *args.shape), torch.float32).fill_(0.5)
            self.peers[name] = self.planes[name].connect(hello["infos"][name])
        self.src, self.dst = torch.full((self.n, *args.shape), 1.0), torch.full((self.n, *args.shape), 0.5)
        self.sock = socket.create_connection(tuple(hello["raw"]))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.raw_pool = byte_view(self.planes["tcp"].kv)
        self.owner_pid, self.cma_from = hello["owner_pids"][0], int((hello["infos"].get("nixl", {}).get("bases") or [0])[0])  # the pool starts at layer 0 of block 0

    def run(self, method: str, remote: list[int], local: list[int]) -> None:
        n, bb = len(remote), self.block_bytes  # the limits move one contiguous span of the same size, always
        a, b = min(remote[0], self.n - n), min(local[0], self.n - n)
        if method == "memcpy":
            self.dst[b:b + n].copy_(self.src[a:a + n])
        elif method == "raw":
            self.sock.sendall(_REQ.pack(a * bb, n * bb))
            recv_exact(self.sock, self.raw_pool[b * bb:(b + n) * bb])
        elif method == "cma":  # from the owner's nixl pool into ours, what UCX moves on one host
            cma_read(self.owner_pid, self.cma_from + a * bb, self.planes["nixl"].kv.data_ptr() + b * bb, n * bb)
        elif method.endswith("_w"):
            self.peers[method[:-2]].write_blocks("bench", "token", local, remote)
        else:
            self.peers[method].read_blocks("bench", "token", remote, local)

    def verify(self) -> None:
        """Blocks arrive where they should through every plane: the owner's ids by a read, then ours written back
        over them and read again."""
        for name, plane in self.planes.items():
            remote, local = random.Random(1).sample(range(self.n), 8), random.Random(2).sample(range(self.n), 8)
            first = plane.kv.view(self.n, -1)[:, 0]
            self.run(name, remote, local)
            ok = first[local].tolist() == [float(i) for i in remote]
            if name != "shm":
                first[local] = first[local] + 0.5
                self.run(f"{name}_w", remote, local)
                self.run(name, remote, local[::-1])
                ok = ok and first[local[::-1]].tolist() == [i + 0.5 for i in remote]
            if not ok:
                raise RuntimeError(f"{name} data plane moved the wrong blocks")

    def close(self) -> None:
        for peer in self.peers.values():
            peer.close()
        self.sock.sendall(_REQ.pack(0, 0))
        for plane in self.planes.values():
            plane.stop()


def ids_for(rng: random.Random, pattern: str, n: int, total: int) -> tuple[list[int], list[int]]:
    if pattern == "scattered":
        return rng.sample(range(total), n), rng.sample(range(total), n)
    a, b = rng.randrange(total - n + 1), rng.randrange(total - n + 1)
    return list(range(a, a + n)), list(range(b, b + n))


def measure_case(paths: Paths, meter: H.CpuMeter, args: argparse.Namespace, pattern: str) -> dict[str, Any]:
    rng, methods = random.Random(0), methods_at(args.where)
    n = 1 if pattern == "one" else args.read_blocks
    for m in methods:  # a few untimed moves of this exact shape
        for _ in range(2):
            paths.run(m, *ids_for(rng, pattern, n, paths.n))
    rounds: list[tuple[float, dict[str, float]]] = []  # (others' cores, seconds per method)
    cpu = {m: [0.0, 0.0] for m in methods}  # reader, owner
    for _, order in H.rotations(methods, args.reps):
        if args.wait_idle > 0:
            meter.wait_for_quiet(args.wait_idle, window_s=0.2)
        meter.mark()
        one = {}
        for m in order:
            ids = ids_for(rng, pattern, n, paths.n)
            c0, o0, t = time.process_time(), sum(map(H.cpu_seconds, meter.pids)), time.perf_counter()
            paths.run(m, *ids)
            one[m] = time.perf_counter() - t
            cpu[m][0] += time.process_time() - c0
            cpu[m][1] += sum(map(H.cpu_seconds, meter.pids)) - o0
        rounds.append((meter.since_mark()["others"], one))
    # Prefer the rounds no other process disturbed (a descheduled thread stalls a whole transfer).
    quiet = [r for o, r in rounds if o < H.QUIET_CORES]
    kept = quiet if len(quiet) >= max(3, args.reps // 3) else [r for _, r in rounds]
    nbytes, total_gb = n * args.block_bytes, n * args.block_bytes * len(rounds) / 1e9
    case: dict[str, Any] = {"where": args.where, "block_kib": args.block_kib, "blocks": n, "pattern": pattern,
                            "bytes": nbytes, "reps": args.reps, "rounds_kept": len(kept),
                            "quiet_rounds_only": kept is quiet, "others_cores_max": max(o for o, _ in rounds)}
    for m in methods:
        case[f"{m}_GBps"] = nbytes / H.median([r[m] for r in kept]) / 1e9
        case[f"{m}_us"] = H.median([r[m] for r in kept]) * 1e6
        case[f"{m}_cpu_s_per_GB"] = [cpu[m][0] / total_gb, cpu[m][1] / total_gb]
    for m in methods:
        for limit in LIMITS[args.where]:  # ratio of medians, and the median of the per-round ratios (steadier under noise)
            case[f"{m}/{limit}"] = case[f"{m}_GBps"] / case[f"{limit}_GBps"]
            case[f"{m}/{limit} paired"] = H.median([r[limit] / r[m] for r in kept])
    return case


def reader_main(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(args.threads)
    hello = json.loads(Path(args.hello).read_text())
    meter = H.CpuMeter()
    meter.pids = hello["owner_pids"]  # host PIDs; /proc is the host's in our PID namespace too
    paths = Paths(args, hello)
    t0, step = time.monotonic(), max(1, min(args.num_blocks // 2, 8 * H.MiB // args.block_bytes))
    for m in methods_at(args.where):  # every path moves the whole pool once (page faults on both sides)
        for start in range(0, args.num_blocks - step + 1, step):
            paths.run(m, list(range(start, start + step)), list(range(start, start + step)))
    paths.verify()
    print(f"  [{args.where}, {args.block_kib} KiB] warm-up {time.monotonic() - t0:.1f} s; placement verified",
          flush=True)
    cases = [measure_case(paths, meter, args, pattern) for pattern in args.patterns]
    paths.close()
    Path(args.out).write_text(json.dumps(H.to_jsonable(cases)))


def run_pass(args: argparse.Namespace, argv: list[str], where: str, kib: int, net: Any, work: Path,
             cleanup: H.Cleanup) -> list[dict[str, Any]]:
    """Start the owner, then the reader (each where `where` puts it); the reader's cases."""
    from pdserve.launcher import start_command

    wrap_o, wrap_r, host = ([], [], "127.0.0.1") if where == "host" else (
        net["owner"].wrap(), net["reader"].wrap(), net["owner"].address)
    me = [sys.executable, str(Path(__file__).resolve()), *argv, "--where", where, "--block-kib", str(kib)]
    owner = start_command(f"owner-{where}-{kib}", [*wrap_o, *me, "--role", "owner", "--host", host],
                          signal_group=bool(wrap_o))
    cleanup.add(owner.stop)
    hello, out = work / f"hello-{where}-{kib}.json", work / f"cases-{where}-{kib}.json"
    hello.write_text(json.dumps({**owner.ready, "owner_pids": H.descendants(owner.pid)}))
    subprocess.run([*wrap_r, *me, "--role", "reader", "--hello", str(hello), "--out", str(out)], check=True,
                   timeout=900)
    owner.stop()
    return json.loads(out.read_text())


def print_cases(cases: list[dict[str, Any]]) -> None:
    print("\n  GB/s moved (median; each byte counted once); x = ratio of medians (paired: median of per-round ratios)")
    for c in cases:
        unit, spec = ("us", ".0f") if c["pattern"] == "one" else ("GBps", ".2f")
        rates = " ".join(f"{m} {c[f'{m}_{unit}']:{spec}}" for m in methods_at(c["where"])) + f" ({unit})"
        method, limit, bound = TARGETS[c["where"]]
        ok = "-" if c["pattern"] == "one" else "PASS" if c[f"{method}/{limit}"] >= bound else "MISS"
        ratios = " ".join(f"{m}/{lim} {c[f'{m}/{lim}']:.2f} ({c[f'{m}/{lim} paired']:.2f})"
                          for m in methods_at(c["where"]) if m not in LIMITS[c["where"]]
                          for lim in limits_for(c["where"], m))
        cpu = ", ".join("{}: {:.2f}/{:.2f}".format(m, *c[f"{m}_cpu_s_per_GB"]) for m in methods_at(c["where"])
                        if m not in LIMITS[c["where"]])
        print(f"  {c['where']:<5} {c['block_kib']:>4} KiB x {c['blocks']:>4} {c['pattern']:<11} | {rates}\n"
              f"      {ratios} | target {method} >= {bound} x {limit}: {ok} | rounds {c['rounds_kept']}/{c['reps']}"
              f"{'' if c['quiet_rounds_only'] else ' (noisy: all kept)'}, others up to {c['others_cores_max']:.2f}"
              f" cores\n      CPU s/GB reader/owner: {cpu}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: 128 MiB pools, 8 MiB reads, 4 rounds")
    ap.add_argument("--json", help="write all numbers here")
    ap.add_argument("--where", default="host,netns", help="host, netns (simulated hosts: needs root)")
    ap.add_argument("--block-kib", default="64,2048", help=f"block sizes, of {sorted(SHAPES)}")
    ap.add_argument("--patterns", default="consecutive,scattered,one", help="one = a single block: the fixed cost")
    ap.add_argument("--pool-mib", type=int, default=256)
    ap.add_argument("--read-mib", type=int, default=32, help="bytes each method moves per round")
    ap.add_argument("--reps", type=int, default=None, help="rounds (default 15)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the reader (memcpy)")
    ap.add_argument("--wait-idle", type=float, default=1.0, help="before each round, wait up to S s for quiet")
    ap.add_argument("--role", choices=("owner", "reader"), help=argparse.SUPPRESS)
    for internal in ("--host", "--hello", "--out"):
        ap.add_argument(internal, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.quick:
        args.reps, args.pool_mib, args.read_mib = args.reps or 4, min(args.pool_mib, 128), min(args.read_mib, 8)
        args.wait_idle = min(args.wait_idle, 0.3)
    args.reps = args.reps or 15
    args.patterns = args.patterns.split(",")
    if args.role:  # one pass: one place, one block size
        args.block_kib = int(args.block_kib)
        args.shape = SHAPES[args.block_kib]
        args.block_bytes = args.block_kib * 1024
        args.num_blocks = args.pool_mib * H.MiB // args.block_bytes
        args.read_blocks = min(args.read_mib * H.MiB // args.block_bytes, args.num_blocks // 2)
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.role:
        owner_main(args) if args.role == "owner" else reader_main(args)
        return 0
    passthrough = [a for a, b in zip(argv, [None, *argv]) if "--json" not in (a, b) and not a.startswith("--json=")]
    cleanup = H.Cleanup()
    work = cleanup.work_dir("dataplane")
    res: dict[str, Any] = {"args": vars(args), "load_before": H.loadavg(), "cases": []}
    print(f"bench/dataplane.py | {args.where} | blocks {args.block_kib} KiB | {args.read_mib} MiB per round | "
          f"{args.reps} rounds | load {res['load_before']}", flush=True)
    net = H.simulated_hosts(cleanup, "owner", "reader") if "netns" in args.where else None
    try:
        for kib in (int(k) for k in args.block_kib.split(",")):
            for where in args.where.split(","):
                res["cases"] += run_pass(args, passthrough, where, kib, net, work, cleanup)
    finally:
        cleanup.run()
    print_cases(res["cases"])
    print(f"  load {res['load_before']} -> {H.loadavg()}")
    H.write_json(args.json, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
