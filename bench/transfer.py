"""KV transfer: data-plane bandwidth against its machine limits, and 1P1D TTFT against colocated, in one run.

Part 1, data planes (two real processes): a `multiprocessing` spawn child owns a KV pool per plane in the h256
layout ([blocks, 4 layers, 2, 2 KV heads, 16 tokens, 64] fp32 = 64 KiB a block; 256 MiB by default), pre-touched,
serves them with the shm and tcp data planes (allow-all authorizer), and runs a raw socket server. The parent reads
N blocks with `plane.connect(info).read_blocks(...)` into its own pre-touched pool and, in the same rounds:
  * memcpy: `dst.copy_(src)` of the same bytes between two pre-touched private tensors (the shm limit);
  * raw socket: a 16-byte request, then `sendall` of the same bytes straight from the child's pool, `recv_into`
    the parent's pool over loopback TCP (the tcp limit; default buffers and TCP_NODELAY like the plane; a
    variant with 4 MiB SO_SNDBUF / SO_RCVBUF for reference).
Block ids: consecutive; descending (what pdserve's allocator hands out once requests were freed tail first);
scattered (random on both sides). Every method reads its own random region each round, the order rotates, the
whole pool goes through every path first (page faults), rounds wait for a quiet machine and the ones other
processes disturbed are dropped when enough quiet ones remain. Once per torch thread count in --dp-threads.
Reported: bytes moved / s (each byte counted once), medians, shm / memcpy (target >= 0.8) and tcp / raw (target
>= 0.5), also per-round ("paired") and best; CPU s per GB on each side; 1-block latency; the cost of first touch
(a memfd pool is not populated until written); what-ifs (sorted pairs, other copy strategies).

Part 2, TTFT of 1P1D against colocated (h256 llama, prompts of 256, 1024, 2000 random token ids): per data plane
a producer P and a consumer D, plus a colocated instance C, all real `pdserve serve` processes. PD: POST P
(max_tokens 1, do_remote_decode), then POST D with P's kv_transfer_params and `stream: true`; TTFT(PD) = sending P's
request -> D's first streamed token; TTFT(colocated) = sending to C -> its first streamed token. C then gets the
same prompt again ("C hit": a prefix-cache hit, i.e. D's one-token step without a transfer). Every KV pool is
cycled once first (steady state), every mode warmed up; distinct seeded prompts every rep, modes shuffled each rep.
Breakdown: P leg, D leg (client), D's transfer seconds and bytes (/metrics deltas), each instance's own TTFT
(vllm:time_to_first_token_seconds), time outside the prefill, and a "denoised" ratio that uses one pooled prefill
time for P and C (prefill is the same work but swings with other processes' load).
`--profile` traces the servers (bench/procs.py wraps engine steps, the transfer agent and the data planes with
timestamps; no pdserve code changes) and splits each request into segments. `--experiment a,b` starts a second,
patched set of instances (variant "exp", see procs.EXPERIMENTS) measured in the same interleaved reps.

  .venv/bin/python bench/transfer.py --quick                # smoke run (~2-3 min)
  .venv/bin/python bench/transfer.py --json /tmp/transfer.json
  .venv/bin/python bench/transfer.py --only ttft --profile --experiment nodelay,nopoll,prefault,sortruns
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import random
import shutil
import signal
import socket
import statistics
import struct
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

_THREADS_DEFAULT = 2
if "--threads" in sys.argv[1:-1]:
    os.environ.setdefault("OMP_NUM_THREADS", sys.argv[sys.argv.index("--threads") + 1])
os.environ.setdefault("OMP_NUM_THREADS", str(_THREADS_DEFAULT))

sys.path.insert(0, str(Path(__file__).resolve().parent))
import procs  # noqa: E402  (bench/procs.py)

MiB = 1 << 20
TARGET_SHM = 0.8  # shm >= 0.8 x memcpy
TARGET_TCP = 0.5  # tcp >= 0.5 x raw socket
TARGET_PD = 1.15  # TTFT(PD) <= 1.15 x TTFT(colocated) at 2k tokens
TARGET_PD_LEN = 2000
QUIET_CORES = 0.3  # a round during which other processes used less than this counts as quiet
# h256 llama: 4 layers, 2 KV heads, head_dim 64; block_size 16
LAYERS, KV_HEADS, BLOCK_SIZE, HEAD_DIM = 4, 2, 16, 64
_REQ = struct.Struct("!QQ")  # raw socket request: offset, nbytes (0 closes)


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def fmt(v: float, spec: str = ".2f") -> str:
    return "-" if v is None or v != v else format(v, spec)


# ============================================================================= cleanup registry

_CLEANUP: list[Any] = []  # callables, run in reverse order


def once(fn):
    """A closer that runs at most once (it is both called in order and registered for the cleanup)."""
    done = []

    def run() -> None:
        if not done:
            done.append(True)
            fn()
    return run


def _cleanup() -> None:
    while _CLEANUP:
        fn = _CLEANUP.pop()
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - keep cleaning
            print(f"cleanup: {exc}", file=sys.stderr)


def _on_signal(signum, frame):  # noqa: ARG001
    raise KeyboardInterrupt(f"signal {signum}")


def work_dir(name: str) -> Path:
    """A temp folder for this run, removed with everything else the run started, at exit or on SIGTERM."""
    signal.signal(signal.SIGTERM, _on_signal)
    atexit.register(_cleanup)
    work = Path(tempfile.mkdtemp(prefix=f"pdserve-bench-{name}-"))
    _CLEANUP.append(lambda: shutil.rmtree(work, ignore_errors=True))
    return work


# ============================================================================= part 1: data planes


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    while view:
        n = sock.recv_into(view)
        if n == 0:
            raise ConnectionError("peer closed")
        view = view[n:]


def _raw_serve(conn: socket.socket, pool: memoryview) -> None:
    head = bytearray(_REQ.size)
    with conn:
        try:
            while True:
                _recv_exact(conn, memoryview(head))
                offset, nbytes = _REQ.unpack(head)
                if nbytes == 0:
                    return
                conn.sendall(pool[offset:offset + nbytes])
        except (OSError, ConnectionError):
            return


def _raw_accept(listener: socket.socket, pool: memoryview, sndbuf: int | None) -> None:
    while True:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if sndbuf:
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
        threading.Thread(target=_raw_serve, args=(conn, pool), daemon=True).start()


def pool_owner_main(shape: list[int], conn) -> None:
    """The spawn child: owns one pool per data plane (pre-touched), serves them, and a raw socket over the tcp one."""
    import torch

    from pdserve.kv_transfer.data_plane import make_data_plane
    from pdserve.kv_transfer.data_plane.base import byte_view

    planes, infos = {}, {}
    for name in ("shm", "tcp"):
        plane = make_data_plane(name, "127.0.0.1")
        kv = plane.allocate(tuple(shape), torch.float32)
        kv.fill_(1.0)  # touch every page
        kv[:, 0, 0, 0, 0, 0] = torch.arange(shape[0], dtype=torch.float32)  # block id, checked by the reader
        plane.start(lambda op, key, token, ids: None)
        planes[name], infos[name] = plane, plane.local_info()
    pool = byte_view(planes["tcp"].kv)
    ports = {}
    for variant, sndbuf in (("default", None), ("4MiB", 4 * MiB)):
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        ports[variant] = listener.getsockname()[1]
        threading.Thread(target=_raw_accept, args=(listener, pool, sndbuf), daemon=True).start()
    conn.send({"infos": infos, "raw_ports": ports, "pid": os.getpid()})
    try:
        conn.recv()  # any message (or EOF) means stop
    except EOFError:
        pass
    for plane in planes.values():
        plane.stop()


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


class RawClient:
    def __init__(self, port: int, pool: memoryview, rcvbuf: int | None) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if rcvbuf:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        self.sock.connect(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.pool = pool

    def read(self, src_offset: int, dst_offset: int, nbytes: int) -> None:
        self.sock.sendall(_REQ.pack(src_offset, nbytes))
        _recv_exact(self.sock, self.pool[dst_offset:dst_offset + nbytes])

    def close(self) -> None:
        try:
            self.sock.sendall(_REQ.pack(0, 0))
        except OSError:
            pass
        self.sock.close()


def bench_dataplane(args, contention: procs.Contention) -> dict[str, Any]:
    import multiprocessing as mp

    import torch

    from pdserve.kv_transfer.data_plane import make_data_plane
    from pdserve.kv_transfer.data_plane.base import byte_view

    block_bytes = LAYERS * 2 * KV_HEADS * BLOCK_SIZE * HEAD_DIM * 4
    num_blocks = args.pool_mib * MiB // block_bytes
    shape = [num_blocks, LAYERS, 2, KV_HEADS, BLOCK_SIZE, HEAD_DIM]
    sizes = [n for n in args.blocks if n <= num_blocks // 2]
    print(f"\n== Part 1: KV data planes, two processes | pool {args.pool_mib} MiB = {num_blocks} blocks x "
          f"{block_bytes // 1024} KiB (h256 layout {shape[1:]}, fp32) | copy threads {args.dp_threads}",
          flush=True)

    ctx = mp.get_context("spawn")
    parent_conn, child_conn = ctx.Pipe()
    child = ctx.Process(target=pool_owner_main, args=(shape, child_conn), daemon=True)
    child.start()

    @once
    def stop_child() -> None:
        try:
            parent_conn.send("stop")
        except OSError:
            pass
        child.join(10)
        if child.is_alive():
            os.kill(child.pid, signal.SIGKILL)
            child.join(5)

    _CLEANUP.append(stop_child)
    if not parent_conn.poll(120):
        raise RuntimeError("the pool owner did not start")
    hello = parent_conn.recv()
    contention.pids.append(hello["pid"])

    # Local side: each plane allocates the reader's pool as an instance would (shm: memfd; tcp: torch.zeros).
    local_planes, peers = {}, {}
    for name in ("shm", "tcp"):
        plane = make_data_plane(name, "127.0.0.1")
        kv = plane.allocate(tuple(shape), torch.float32)
        kv.fill_(0.5)
        local_planes[name] = plane
        peers[name] = plane.connect(hello["infos"][name])
        peers[name].close = once(peers[name].close)
        _CLEANUP.append(peers[name].close)
    src = torch.full(shape, 1.0)  # memcpy: two private, pre-touched tensors of the pool's size
    dst = torch.full(shape, 0.5)
    tcp_bytes = byte_view(local_planes["tcp"].kv)
    raws = {"default": RawClient(hello["raw_ports"]["default"], tcp_bytes, None),
            "4MiB": RawClient(hello["raw_ports"]["4MiB"], tcp_bytes, 4 * MiB)}
    for r in raws.values():
        r.close = once(r.close)
        _CLEANUP.append(r.close)

    def do_memcpy(remote: list[int], local: list[int]) -> None:
        n = len(remote)  # always one contiguous copy of the same size (the limit), also for scattered ids
        a, b = min(remote[0], num_blocks - n), min(local[0], num_blocks - n)
        dst[b:b + n].copy_(src[a:a + n])

    def do_plane(name):
        def run(remote: list[int], local: list[int]) -> None:
            peers[name].read_blocks("bench", "token", remote, local)
        return run

    def do_raw(variant):
        def run(remote: list[int], local: list[int]) -> None:
            n = len(remote)  # always one contiguous stream of the same size, also for scattered ids
            a, b = min(remote[0], num_blocks - n), min(local[0], num_blocks - n)
            raws[variant].read(a * block_bytes, b * block_bytes, n * block_bytes)
        return run

    # What-ifs for scattered ids on shm (ShmPeer copies run by run: one torch call per 64 KiB block, and a block is
    # below torch's parallel grain of 32768 elements, so each copy runs on one thread).
    from concurrent.futures import ThreadPoolExecutor

    from pdserve.kv_transfer.data_plane.base import block_runs

    shm_peer = peers["shm"]
    helper = ThreadPoolExecutor(1)
    _CLEANUP.append(lambda: helper.shutdown(wait=False))

    def shm_index(remote: list[int], local: list[int]) -> None:  # gather + scatter, two parallel passes
        shm_peer.local.index_copy_(0, torch.tensor(local), shm_peer.remote.index_select(0, torch.tensor(remote)))

    def shm_foreach(remote: list[int], local: list[int]) -> None:  # one torch call for all runs
        runs = block_runs(remote, local)
        torch._foreach_copy_([shm_peer.local[d:d + n] for _, d, n in runs],
                             [shm_peer.remote[s:s + n] for s, _, n in runs])

    def copy_runs(runs) -> None:
        for s, d, n in runs:
            shm_peer.local[d:d + n].copy_(shm_peer.remote[s:s + n])

    def shm_2threads(remote: list[int], local: list[int]) -> None:  # the runs split over two threads
        runs = block_runs(remote, local)
        half = len(runs) // 2
        other = helper.submit(copy_runs, runs[half:])
        copy_runs(runs[:half])
        other.result()

    methods = {"memcpy": do_memcpy, "shm": do_plane("shm"), "raw": do_raw("default"), "tcp": do_plane("tcp"),
               "raw_4MiB": do_raw("4MiB")}
    # per-block views made once (a real ShmPeer could keep them from connect()); each read only indexes lists
    local_views, remote_views = list(shm_peer.local.unbind(0)), list(shm_peer.remote.unbind(0))

    def foreach_views(remote: list[int], local: list[int]) -> None:
        torch._foreach_copy_([local_views[i] for i in local], [remote_views[i] for i in remote])

    def shm_views(remote: list[int], local: list[int]) -> None:  # cached views + one _foreach_copy_ call
        foreach_views(remote, local)

    def shm_views_2t(remote: list[int], local: list[int]) -> None:  # the same, halves on two threads
        half = len(remote) // 2
        other = helper.submit(foreach_views, remote[half:], local[half:])
        foreach_views(remote[:half], local[:half])
        other.result()

    def sorted_read(name):
        def run(remote: list[int], local: list[int]) -> None:  # pairs sorted by remote id: runs merge again
            pairs = sorted(zip(remote, local))
            peers[name].read_blocks("bench", "token", [r for r, _ in pairs], [loc for _, loc in pairs])
        return run

    what_ifs = {
        # pdserve's allocator frees a request's blocks tail first, so later requests get descending ids on both
        # sides; block_runs only merges ascending pairs, so every block becomes its own run (copy / send).
        "descending": {"shm_sorted": sorted_read("shm"), "tcp_sorted": sorted_read("tcp")},
        "scattered": {"shm_index": shm_index, "shm_foreach": shm_foreach, "shm_2threads": shm_2threads,
                      "shm_views": shm_views, "shm_views_2t": shm_views_2t},
    }
    owner_pid = hello["pid"]

    # Warm-up: every path reads the whole pool once (page faults on both sides), then a few timed-size reads.
    t0 = time.monotonic()
    chunk = 512
    for name, fn in methods.items():
        for start in range(0, num_blocks - chunk + 1, chunk):
            ids = list(range(start, start + chunk))
            fn(ids, ids)
    for name in ("shm", "tcp"):  # correctness: the block id written by the owner arrives where it should
        kv = local_planes[name].kv
        ids = random.Random(1).sample(range(num_blocks), 64)
        local = random.Random(2).sample(range(num_blocks), 64)
        peers[name].read_blocks("bench", "token", ids, local)
        got = kv[local, 0, 0, 0, 0, 0].tolist()
        if got != [float(i) for i in ids]:
            raise RuntimeError(f"{name} data plane moved the wrong blocks")
    print(f"  warm-up (whole pool through every path) {time.monotonic() - t0:.1f} s; block placement verified",
          flush=True)

    rng = random.Random(0)
    results: dict[str, Any] = {"pool_mib": args.pool_mib, "block_bytes": block_bytes, "num_blocks": num_blocks,
                               "torch_threads": torch.get_num_threads(), "cases": []}

    def ids_for(pattern: str, n: int) -> tuple[list[int], list[int]]:
        if pattern in ("consecutive", "descending"):
            a, b = rng.randrange(num_blocks - n), rng.randrange(num_blocks - n)
            remote, local = list(range(a, a + n)), list(range(b, b + n))
            return (remote, local) if pattern == "consecutive" else (remote[::-1], local[::-1])
        return rng.sample(range(num_blocks), n), rng.sample(range(num_blocks), n)

    for threads in args.dp_threads:  # torch intra-op threads for memcpy and the shm copies
        torch.set_num_threads(threads)
        for n in sizes:
            reps = args.dp_reps if n * block_bytes > 16 * MiB else args.dp_reps * 2
            for pattern in ("consecutive", "descending", "scattered"):
                run_now = dict(methods, **what_ifs.get(pattern, {}))
                order = list(run_now)
                times: dict[str, list[float]] = {m: [] for m in run_now}
                cpu: dict[str, list[float]] = {m: [0.0, 0.0] for m in run_now}  # parent, owner
                others = []
                for m in run_now:  # a few untimed reads of this exact shape
                    for _ in range(2):
                        run_now[m](*ids_for(pattern, n))
                rounds: list[tuple[float, dict[str, float]]] = []  # (others' cores, seconds per method)
                for rep in range(reps):
                    if args.dp_wait_idle > 0:
                        contention.wait_for_quiet(args.dp_wait_idle, window_s=0.2)
                    contention.mark()
                    rot = order[rep % len(order):] + order[:rep % len(order)]
                    one: dict[str, float] = {}
                    for m in rot:
                        remote, local = ids_for(pattern, n)
                        c_parent, c_owner = time.process_time(), procs.cpu_seconds(owner_pid)
                        t = time.perf_counter()
                        run_now[m](remote, local)
                        one[m] = time.perf_counter() - t
                        cpu[m][0] += time.process_time() - c_parent
                        cpu[m][1] += procs.cpu_seconds(owner_pid) - c_owner
                    rounds.append((contention.since_mark()["others"], one))
                # Prefer the rounds no other process disturbed (a descheduled torch thread stalls a whole copy).
                others = [o for o, _ in rounds]
                quiet = [r for o, r in rounds if o < QUIET_CORES]
                kept = quiet if len(quiet) >= max(3, reps // 3) else [r for _, r in rounds]
                for r in kept:
                    for m, v in r.items():
                        times[m].append(v)
                nbytes = n * block_bytes
                case = {"threads": threads, "blocks": n, "pattern": pattern, "bytes": nbytes, "reps": reps,
                        "rounds_kept": len(kept), "quiet_rounds_only": kept is quiet,
                        "others_cores_max": max(others), "others_cores_median": median(others)}
                for m in run_now:
                    case[f"{m}_GBps"] = nbytes / median(times[m]) / 1e9
                    case[f"{m}_ms"] = median(times[m]) * 1e3
                    total = nbytes * len(rounds) / 1e9
                    case[f"{m}_cpu_s_per_GB"] = {"reader": cpu[m][0] / total, "owner": cpu[m][1] / total}
                    case[f"{m}_GBps_best"] = nbytes / min(times[m]) / 1e9
                case["shm_over_memcpy"] = case["shm_GBps"] / case["memcpy_GBps"]
                case["tcp_over_raw"] = case["tcp_GBps"] / case["raw_GBps"]
                # the same ratios rep by rep (both measured within one round), then the median: steadier under noise
                case["shm_over_memcpy_paired"] = median([b / a for a, b in zip(times["shm"], times["memcpy"])])
                case["tcp_over_raw_paired"] = median([b / a for a, b in zip(times["tcp"], times["raw"])])
                results["cases"].append(case)
                for m in what_ifs.get(pattern, {}):
                    base = "raw" if m.startswith("tcp") else "memcpy"
                    case[f"{m}_over_{base}_paired"] = median([b / a for a, b in zip(times[m], times[base])])
    torch.set_num_threads(args.dp_threads[0])

    # Fixed cost: one block, many times.
    lat: dict[str, list[float]] = {m: [] for m in methods}
    for rep in range(args.dp_reps * 10):
        for m in methods:
            remote, local = ids_for("consecutive", 1)
            t = time.perf_counter()
            methods[m](remote, local)
            lat[m].append(time.perf_counter() - t)
    results["one_block_us"] = {m: median(v) * 1e6 for m, v in lat.items()}

    # First touch: a reader's pool as ShmDataPlane.allocate leaves it (memfd, never written) and/or a fresh mapping
    # of the owner's pool (page tables not yet filled), against the warm path. Each cold read hits new pages.
    from pdserve.kv_transfer.data_plane.shm import ShmPeer

    n_cold = min(125, num_blocks // 16)
    cold_rounds = min(num_blocks // n_cold, 4 if args.quick else 8)
    fresh_plane = make_data_plane("shm", "127.0.0.1")
    fresh_local = fresh_plane.allocate(tuple(shape), torch.float32)
    fresh_map = local_planes["shm"].connect(hello["infos"]["shm"])  # warm local pool, new mapping of the remote
    variants = {
        "warm": shm_peer,
        "cold local pool": ShmPeer(shm_peer.remote, fresh_local),
        "cold remote mapping": fresh_map,
        "cold both": fresh_plane.connect(hello["infos"]["shm"]),
    }
    cold: dict[str, list[float]] = {v: [] for v in variants}
    for i in range(cold_rounds):
        ids = list(range(i * n_cold, (i + 1) * n_cold))
        if args.dp_wait_idle > 0:
            contention.wait_for_quiet(args.dp_wait_idle, window_s=0.2)
        for v, peer in variants.items():
            t = time.perf_counter()
            peer.read_blocks("bench", "token", ids, ids)
            cold[v].append(time.perf_counter() - t)
    results["shm_first_touch"] = {"blocks": n_cold, "rounds": cold_rounds,
                                  **{v: median(x) * 1e3 for v, x in cold.items()}}
    fresh_map.close()
    variants["cold both"].close()
    fresh_plane.stop()
    del variants, fresh_local

    # Per-block Python work of the tcp path (both sides build one memoryview per run of consecutive ids).
    from pdserve.kv_transfer.data_plane.tcp import _Pool

    pool = _Pool(local_planes["tcp"].kv)
    py_cost = {}
    for n in sizes:
        ids = rng.sample(range(num_blocks), n)
        spans_s = min(_timed(lambda: pool.spans(ids, None)) for _ in range(20))  # min: CPU work, not noise
        runs_s = min(_timed(lambda: block_runs(ids, ids)) for _ in range(20))
        py_cost[n] = {"spans_us": spans_s * 1e6, "block_runs_us": runs_s * 1e6}
    results["tcp_python_us_scattered"] = py_cost

    for r in raws.values():
        r.close()
    for p in peers.values():
        p.close()
    stop_child()
    for plane in local_planes.values():
        plane.stop()
    del src, dst
    print_dataplane(results)
    return results


def print_dataplane(res: dict[str, Any]) -> None:
    print("\n  KV bytes moved per second (GB/s, median; each byte counted once). memcpy = one contiguous copy of "
          "the same bytes; raw = loopback TCP stream of the same bytes")
    head = (f"  {'blocks':>6} {'MiB':>6} {'ids':<11} {'memcpy':>7} {'shm':>7} {'shm/memcpy':>10} {'paired':>6}  "
            f"{'raw':>6} {'tcp':>6} {'tcp/raw':>8} {'paired':>6}  {'raw 4MiB-buf':>12}  {'rounds':>9}")
    for c in res["cases"]:
        if c is res["cases"][0] or c["threads"] != prev:
            print(f"  torch threads {c['threads']} (memcpy and shm copies):")
            print(head)
        prev = c["threads"]
        shm_ok = "PASS" if c["shm_over_memcpy"] >= TARGET_SHM else "MISS"
        tcp_ok = "PASS" if c["tcp_over_raw"] >= TARGET_TCP else "MISS"
        print(f"  {c['blocks']:>6} {c['bytes'] / MiB:>6.1f} {c['pattern']:<11} {c['memcpy_GBps']:>7.2f} "
              f"{c['shm_GBps']:>7.2f} {c['shm_over_memcpy']:>5.2f} {shm_ok} {c['shm_over_memcpy_paired']:>6.2f}  "
              f"{c['raw_GBps']:>6.2f} {c['tcp_GBps']:>6.2f} {c['tcp_over_raw']:>4.2f} {tcp_ok} "
              f"{c['tcp_over_raw_paired']:>6.2f}  {c['raw_4MiB_GBps']:>12.2f}  "
              f"{c['rounds_kept']:>3}/{c['reps']:<3}{'q' if c['quiet_rounds_only'] else '!':>2}")
    print("  best rep (GB/s): " + "; ".join(
        f"{c['threads']}t {c['blocks']} {c['pattern'][:6]}: " + " ".join(f"{m} {c[f'{m}_GBps_best']:.1f}"
                                                                   for m in ("memcpy", "shm", "raw", "tcp"))
        for c in res["cases"]))
    print(f"  targets: shm >= {TARGET_SHM} x memcpy, tcp >= {TARGET_TCP} x raw socket (ratio of medians; 'paired' = "
          f"median of per-round ratios). rounds: kept/run; q = only rounds where other processes used < {QUIET_CORES} "
          "cores, ! = not enough quiet rounds, all kept (noisy)")
    print("\n  CPU seconds per GB moved (reader process / pool owner process):")
    for c in res["cases"]:
        parts = "  ".join(f"{m} {c[f'{m}_cpu_s_per_GB']['reader']:.2f}/{c[f'{m}_cpu_s_per_GB']['owner']:.2f}"
                          for m in ("memcpy", "shm", "raw", "tcp"))
        print(f"  {c['threads']}t {c['blocks']:>6} {c['pattern']:<11} {parts}")
    desc = [c for c in res["cases"] if c["pattern"] == "descending" and "shm_sorted_GBps" in c]
    if desc:
        print("\n  what-if, descending ids (what the allocator hands out after a request is freed tail first): "
              "read_blocks with the (remote, local) pairs sorted by remote id (GB/s median; x limit, paired)")
        for c in desc:
            print(f"  {c['threads']}t {c['blocks']:>6} blocks: shm {c['shm_GBps']:.2f} "
                  f"({c['shm_over_memcpy_paired']:.2f}x memcpy) -> "
                  f"sorted {c['shm_sorted_GBps']:.2f} ({c['shm_sorted_over_memcpy_paired']:.2f}x);  tcp "
                  f"{c['tcp_GBps']:.2f} ({c['tcp_over_raw_paired']:.2f}x raw) -> sorted {c['tcp_sorted_GBps']:.2f} "
                  f"({c['tcp_sorted_over_raw_paired']:.2f}x)")
    wi = [c for c in res["cases"] if c["pattern"] == "scattered" and "shm_index_GBps" in c]
    if wi:
        print("\n  what-if, shm with scattered ids (GB/s median; x memcpy, paired): "
              "index = local.index_copy_(remote.index_select) (two parallel passes); foreach = torch._foreach_copy_ "
              "over the runs (one call);\n  2threads = the runs split over two Python threads; views = per-block views "
              "made once + one _foreach_copy_; views_2t = that, halves on two threads")
        for c in wi:
            alternatives = " ".join(f"{m[4:]} {c[f'{m}_GBps']:.2f} ({c[f'{m}_over_memcpy_paired']:.2f}x)"
                                    for m in ("shm_index", "shm_foreach", "shm_2threads", "shm_views", "shm_views_2t"))
            print(f"  {c['threads']}t {c['blocks']:>6} blocks: shm {c['shm_GBps']:.2f} "
                  f"({c['shm_over_memcpy_paired']:.2f}x) {alternatives}")
    ft = res.get("shm_first_touch")
    if ft:
        mib = ft["blocks"] * res["block_bytes"] / MiB
        print(f"\n  shm first touch, {ft['blocks']} consecutive blocks ({mib:.1f} MiB)"
              f" into pages never used before (ms, median of {ft['rounds']}): " + ", ".join(
                  f"{k} {v:.2f}" for k, v in ft.items() if k not in ("blocks", "rounds")))
    lat = res["one_block_us"]
    print("\n  one 64 KiB block, latency (us, median): " + ", ".join(f"{m} {v:.0f}" for m, v in lat.items()))
    print("  tcp per-block Python work for scattered ids (us, best of 20; both sides do it): " + ", ".join(
        f"{n} blocks: spans {v['spans_us']:.0f}, block_runs {v['block_runs_us']:.0f}"
        for n, v in res["tcp_python_us_scattered"].items()))


# ============================================================================= part 2: TTFT


def kv_config(role: str, plane: str) -> str:
    return json.dumps({"kv_connector": "PdConnector", "kv_role": role,
                       "kv_connector_extra_config": {"data_plane": plane}})


def metric_values(client, url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = client.get(f"{url}/metrics").text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


def stream_first(client, url: str, body: dict) -> tuple[float, dict]:
    """POST a streamed completion; returns (monotonic time of the first token chunk, that chunk). Drains the rest."""
    first_t, first = None, None
    for t, data in procs.sse_data(client, f"{url}/v1/completions", body):
        if first_t is None:
            first_t, first = t, json.loads(data)
            if "choices" not in first:
                raise RuntimeError(f"{url}: error in stream: {data[:500]}")
    if first_t is None:
        raise RuntimeError(f"{url}: the stream had no token")
    return first_t, first


class TtftBench:
    """P, D (per data plane) and C instances, per variant: "base" (pdserve as it is) and, with --experiment, "exp"
    (the same instances with what-if patches), all measured in the same interleaved reps."""

    def __init__(self, args, contention: procs.Contention, work: Path) -> None:
        self.args = args
        self.contention = contention
        self.work = work
        self.model_name = "h256"
        self.variants: dict[str, list[str]] = {"base": []}
        if args.experiment:
            self.variants["exp"] = list(args.experiment)
        self.procs: dict[tuple[str, str], Any] = {}  # (variant, instance name) -> process
        self.traces: dict[tuple[str, str], Path] = {}
        self.marks: list[dict[str, Any]] = []  # client-side timestamps of measured requests (for --profile)

    def start(self) -> None:
        from pdserve.launcher import start_instance
        from pdserve.modelgen import make_text_model

        model = make_text_model("llama", self.work / "h256", preset="h256")
        common = ["--max-model-len", "2048", "--num-kv-blocks", str(self.args.kv_blocks), "--threads",
                  str(self.args.threads), "--served-model-name", self.model_name, "--log-level", "warning"]
        specs = [("C", [])]
        for plane in self.args.planes:
            specs += [(f"P_{plane}", ["--kv-transfer-config", kv_config("kv_producer", plane)]),
                      (f"D_{plane}", ["--kv-transfer-config", kv_config("kv_consumer", plane)])]
        for variant, experiments in self.variants.items():
            for name, extra in specs:
                env = None
                if self.args.profile or experiments:
                    trace = None
                    if self.args.profile:
                        trace = self.traces[(variant, name)] = self.work / f"trace-{variant}-{name}.jsonl"
                    env = procs.child_env(self.work, trace, experiments)
                proc = start_instance(model, *common, *extra, name=f"{variant}-{name}", env=env, timeout=180)
                self.procs[(variant, name)] = proc
                _CLEANUP.append(proc.stop)
                self.contention.pids.append(proc.pid)
        print("  instances: " + ", ".join(f"{v}/{n} pid {p.pid}" for (v, n), p in self.procs.items()), flush=True)
        for variant, experiments in self.variants.items():
            if experiments:
                print(f"  variant {variant!r}: " + "; ".join(f"{e}: {procs.EXPERIMENTS[e]}" for e in experiments))

    def body(self, prompt: list[int]) -> dict:
        return {"model": self.model_name, "prompt": prompt, "max_tokens": self.args.max_tokens, "temperature": 0,
                "ignore_eos": True, "logprobs": 0, "stream": True}

    def colocated(self, client, variant: str, prompt: list[int]) -> dict[str, Any]:
        url = self.procs[(variant, "C")].url
        before = metric_values(client, url)
        t0 = time.monotonic()
        t1, first = stream_first(client, url, self.body(prompt))
        after = metric_values(client, url)
        server = _delta(after, before, "vllm:time_to_first_token_seconds_sum")
        return {"ttft": t1 - t0, "server_ttft": server, "text": first["choices"][0].get("text"), "t0": t0, "t1": t1}

    def pd(self, client, variant: str, plane: str, prompt: list[int]) -> dict[str, Any]:
        p, d = self.procs[(variant, f"P_{plane}")], self.procs[(variant, f"D_{plane}")]
        before_d, before_p = metric_values(client, d.url), metric_values(client, p.url)
        pbody = {"model": self.model_name, "prompt": prompt, "max_tokens": 1, "temperature": 0,
                 "kv_transfer_params": {"do_remote_decode": True}}
        t0 = time.monotonic()
        rp = client.post(f"{p.url}/v1/completions", json=pbody)
        if rp.status_code != 200:
            raise RuntimeError(f"P: HTTP {rp.status_code}: {rp.text[:500]}")
        params = rp.json()["kv_transfer_params"]
        t1 = time.monotonic()
        dbody = self.body(prompt)
        dbody["kv_transfer_params"] = params
        t2, first = stream_first(client, d.url, dbody)
        after_d = metric_values(client, d.url)
        # Let P's lease end (read-done travels after D's first token) so it cannot overlap the next request.
        deadline = time.monotonic() + 5
        after_p = metric_values(client, p.url)
        while after_p.get("pdserve:kv_leases_held", 0) > 0 and time.monotonic() < deadline:
            time.sleep(0.005)
            after_p = metric_values(client, p.url)
        return {
            "ttft": t2 - t0, "p_leg": t1 - t0, "d_leg": t2 - t1,
            "d_xfer": _delta(after_d, before_d, "pdserve:kv_transfer_load_seconds_total"),
            "d_bytes": _delta(after_d, before_d, "pdserve:kv_transfer_bytes_received_total"),
            "d_server_ttft": _delta(after_d, before_d, "vllm:time_to_first_token_seconds_sum"),
            "p_server_ttft": _delta(after_p, before_p, "vllm:time_to_first_token_seconds_sum"),
            "text": first["choices"][0].get("text"), "t0": t0, "t1": t1, "t2": t2,
        }

    def send(self, client, mode: tuple[str, str], prompt: list[int]) -> dict[str, Any]:
        variant, what = mode
        if what == "C":
            return self.colocated(client, variant, prompt)
        return self.pd(client, variant, what[3:], prompt)

    def run(self) -> dict[str, Any]:
        import httpx

        args = self.args
        gen = random.Random(1234)

        def prompt(n: int) -> list[int]:
            return [gen.randrange(100, 32000) for _ in range(n)]

        modes = [(v, m) for v in self.variants for m in ["C"] + [f"PD_{p}" for p in args.planes]]
        samples: dict[tuple[str, str, int], list[dict[str, Any]]] = {
            (v, m, n): [] for v in self.variants for m in ["C", "C_hit"] + [f"PD_{p}" for p in args.planes]
            for n in args.lengths}
        mismatches = 0
        transport = httpx.HTTPTransport(
            socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)] if args.client_nodelay else None)
        with httpx.Client(timeout=120, transport=transport) as client:
            t = time.monotonic()
            if args.touch_pools:
                # Cycle every instance's whole KV pool once (the free queue is least-recently-freed first): the shm
                # plane's memfd pools are not populated at start, so until then prefills and loads take page faults.
                touch_len = min(2000, max(args.lengths))
                for _ in range(-(-args.kv_blocks * BLOCK_SIZE // touch_len) + 1):
                    pr = prompt(touch_len)
                    for mode in modes:
                        self.send(client, mode, pr)
                print(f"  pools touched ({args.kv_blocks} blocks each): {time.monotonic() - t:.1f} s", flush=True)
                t = time.monotonic()
            for _ in range(args.warmup):
                for n in args.lengths:
                    for mode in modes:
                        pr = prompt(n)
                        self.send(client, mode, pr)
                        if mode[1] == "C":
                            self.send(client, mode, pr)  # the prefix-hit path too
            print(f"  warm-up: {args.warmup} request(s) per mode and length, {time.monotonic() - t:.1f} s", flush=True)
            order_rng = random.Random(7)
            others = []
            for rep in range(args.reps):
                lengths = list(args.lengths)
                order_rng.shuffle(lengths)
                for n in lengths:
                    waited = self.contention.wait_for_quiet(args.wait_idle) if args.wait_idle > 0 else 0.0
                    self.contention.mark()
                    pr = prompt(n)  # one fresh prompt per (rep, length), sent to every mode's own instances
                    order = list(modes)
                    order_rng.shuffle(order)
                    texts = {}
                    for variant, what in order:
                        time.sleep(0.02)
                        r = self.send(client, (variant, what), pr)
                        samples[(variant, what, n)].append(r)
                        self.marks.append({"variant": variant, "plane": "C" if what == "C" else what[3:], "len": n,
                                           **{k: r[k] for k in ("t0", "t1", "t2") if k in r}})
                        if what == "C":
                            time.sleep(0.02)
                            samples[(variant, "C_hit", n)].append(self.colocated(client, variant, pr))
                        texts[(variant, what)] = r["text"]
                    if len(set(texts.values())) > 1:
                        mismatches += 1
                    others.append({"rep": rep, "len": n, "others": self.contention.since_mark()["others"],
                                   "waited_s": waited})
                print(f"  rep {rep + 1}/{args.reps} done", flush=True)
        return self.summarize(samples, mismatches, others)

    def summarize(self, samples, mismatches, others) -> dict[str, Any]:
        res: dict[str, Any] = {"lengths": self.args.lengths, "reps": self.args.reps, "planes": self.args.planes,
                               "variants": self.variants, "first_token_mismatches": mismatches,
                               "contention": others, "rows": []}
        for variant in self.variants:
            for n in self.args.lengths:
                # Prefer the reps no other process disturbed (others' cores measured over each (rep, length)).
                conts = [c["others"] for c in others if c["len"] == n]
                quiet = [k for k, o in enumerate(conts) if o < QUIET_CORES]
                keep = quiet if len(quiet) >= max(3, len(conts) // 3) else list(range(len(conts)))
                pick = lambda xs: [xs[k] for k in keep if k < len(xs)]  # noqa: E731
                cs = pick(samples[(variant, "C", n)])
                c = [x["ttft"] for x in cs]
                c_server = [x["server_ttft"] for x in cs]
                c_http = [x["ttft"] - x["server_ttft"] for x in cs]
                hit = [x["ttft"] for x in pick(samples[(variant, "C_hit", n)])]
                # one reference prefill for the denoised ratio: every P's and C's own time to first token, pooled
                prefill_ref = median(c_server + [x["p_server_ttft"] for p in self.args.planes
                                                 for x in pick(samples[(variant, f"PD_{p}", n)])])
                for plane in self.args.planes:
                    s = pick(samples[(variant, f"PD_{plane}", n)])
                    outside = median([x["ttft"] - x["p_server_ttft"] for x in s])
                    row = {
                        "variant": variant, "plane": plane, "len": n, "reps": len(s), "quiet_reps_only": keep is quiet,
                        "colocated_ms": median(c) * 1e3, "colocated_server_ms": median(c_server) * 1e3,
                        "colocated_hit_ms": median(hit) * 1e3,
                        "pd_ms": median([x["ttft"] for x in s]) * 1e3,
                        "p_leg_ms": median([x["p_leg"] for x in s]) * 1e3,
                        "p_server_ms": median([x["p_server_ttft"] for x in s]) * 1e3,
                        "d_leg_ms": median([x["d_leg"] for x in s]) * 1e3,
                        "d_server_ms": median([x["d_server_ttft"] for x in s]) * 1e3,
                        "d_xfer_ms": median([x["d_xfer"] for x in s]) * 1e3,
                        "d_MiB": median([x["d_bytes"] for x in s]) / MiB,
                        # paired: the same rep's PD and C (same prompt, same moment)
                        "pd_over_colocated_paired": median([x["ttft"] / y["ttft"] for x, y in zip(s, cs)]),
                        # Prefill time swings with other processes' load; P's and C's prefills are the same work,
                        # so replace both by the pooled median and keep only each side's own time around it:
                        "pd_over_colocated_denoised": (prefill_ref + outside) / (prefill_ref + median(c_http)),
                        # time outside the prefill, within each request (insensitive to how long prefill took)
                        "pd_minus_p_server_ms": outside * 1e3, "colocated_minus_server_ms": median(c_http) * 1e3,
                        "prefill_ref_ms": prefill_ref * 1e3,
                        "pd_all_ms": [x["ttft"] * 1e3 for x in s], "colocated_all_ms": [x * 1e3 for x in c],
                    }
                    row["pd_over_colocated"] = row["pd_ms"] / row["colocated_ms"]
                    res["rows"].append(row)
        return res

    def profile(self) -> dict[str, Any]:
        """Split every measured request into segments using the servers' traces and the client's stamps."""
        out: dict[str, Any] = {}
        traces = {key: procs.read_trace(path) for key, path in self.traces.items()}
        for variant in self.variants:
            for n in self.args.lengths:
                rows = [seg for m in self.marks if m["variant"] == variant and m["plane"] == "C" and m["len"] == n
                        if (seg := _c_segments(m, traces.get((variant, "C"), []))) is not None]
                if rows:
                    out[f"{variant}:C/{n}"] = {k: median([r[k] for r in rows]) * 1e3 for k in rows[0]}
            for plane in self.args.planes:
                p_ev, d_ev = traces.get((variant, f"P_{plane}"), []), traces.get((variant, f"D_{plane}"), [])
                for n in self.args.lengths:
                    rows = [seg for m in self.marks
                            if m["variant"] == variant and m["plane"] == plane and m["len"] == n
                            if (seg := _segments(m, p_ev, d_ev)) is not None]
                    if rows:
                        out[f"{variant}:{plane}/{n}"] = {k: median([r[k] for r in rows if k in r]) * (
                            1 if k.startswith("#") else 1e3) for k in rows[0]}
        return out


def _delta(after: dict[str, float], before: dict[str, float], key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


def _window(events: list[dict], t0: float, t1: float) -> list[dict]:
    return [e for e in events if t0 <= e["t"] <= t1]


def _c_segments(mark: dict, events: list[dict]) -> dict[str, float] | None:
    t0, t1 = mark["t0"], mark["t1"]
    ev = _window(events, t0, t1)
    try:
        add = next(e for e in ev if e["ev"] == "add")["t"]
        step = next(e for e in ev if e["ev"] == "step")
        deliver = next(e["t"] for e in ev if e["ev"] == "deliver" and e["t"] >= step["t"])
    except StopIteration:
        return None
    return {"C http in (client -> engine add)": add - t0, "C add -> prefill step start": step["t"] - add,
            "C prefill step (start -> output delivered)": deliver - step["t"],
            "C deliver -> client has token": t1 - deliver, "total (client)": t1 - t0}


def _segments(mark: dict, p_ev: list[dict], d_ev: list[dict]) -> dict[str, float] | None:
    """One PD request's time line (seconds), from client stamps t0 (to P), t1 (P answered), t2 (D's first token)."""
    t0, t1, t2 = mark["t0"], mark["t1"], mark["t2"]
    p = _window(p_ev, t0, t1)
    d = _window(d_ev, t1, t2)
    try:
        p_add = next(e for e in p if e["ev"] == "add")["t"]
        p_step = next(e for e in p if e["ev"] == "step")
        p_deliver = next(e["t"] for e in p if e["ev"] == "deliver" and e["fin"])
        d_add = next(e for e in d if e["ev"] == "add")["t"]
        d_first_step = next(e for e in d if e["ev"] in ("step", "idle_step") and e["t"] >= d_add)
        d_submit = next(e for e in d if e["ev"] == "submit_load")
        grant = next(e for e in d if e["ev"] == "request" and e["msg"] == "ReadGrant")
        read = next(e for e in d if e["ev"] == "read_blocks")
        finish = next(e for e in d if e["ev"] == "finish_load")
        d_step = next(e for e in d if e["ev"] == "step" and e["t"] >= finish["t"])
        d_deliver = next(e["t"] for e in d if e["ev"] == "deliver" and e["t"] >= d_step["t"])
    except StopIteration:
        return None
    peer = [e for e in d if e["ev"] == "peer"]
    idle_between = [e for e in d if e["ev"] == "idle_step" and finish["t"] <= e["t"] < d_step["t"]]
    seg = {
        "P http in (client -> engine add)": p_add - t0,
        "P add -> prefill step start": p_step["t"] - p_add,
        "P prefill step (start -> output delivered)": p_deliver - p_step["t"],
        "P deliver -> client has JSON": t1 - p_deliver,
        "D http in (client -> engine add)": d_add - t1,
        "D add -> first step start": d_first_step["t"] - d_add,
        "D first step start -> load submitted": d_submit["t"] - d_first_step["t"],
        "D submitted -> ReadGrant sent": grant["t"] - d_submit["t"],
        "D ReadGrant round trip": grant["dur"],
        "D grant -> read start": read["t"] - (grant["t"] + grant["dur"]),
        "D read_blocks": read["dur"],
        "# D read: blocks": float(read.get("n", 0)),
        "# D read: runs of consecutive ids (one copy / send each)": float(read.get("runs", 0)),
        "# D read: runs if the pairs were sorted by remote id": float(read.get("runs_sorted", 0)),
        "D read end -> finish_load": finish["t"] - (read["t"] + read["dur"]),
        "D finish_load -> compute step start": d_step["t"] - finish["t"],
        "# D idle steps between finish_load and the compute step": float(len(idle_between)),
        "D 1-token step (start -> output delivered)": d_deliver - d_step["t"],
        "D deliver -> client has token": t2 - d_deliver,
        "D handshake (peer(), incl. cached)": sum(e["dur"] for e in peer),
        "total (client)": t2 - t0,
    }
    p_grant = [e for e in _window(p_ev, t1, t2) if e["ev"] == "handle" and e.get("msg") == "ReadGrant"]
    if p_grant:
        seg["P handles ReadGrant (incl. wait for hold)"] = p_grant[0]["dur"]
    answers = [e for e in _window(p_ev, t1, t2) if e["ev"] == "tcp_answer"]
    if answers:
        seg["P tcp _answer (serve bytes)"] = answers[0]["dur"]
    return seg


def print_ttft(res: dict[str, Any]) -> None:
    print(f"\n  TTFT, h256 llama, medians of {res['reps']} reps (ms). PD = send to P -> D's first streamed token; "
          f"colocated = send -> first streamed token")
    for variant, experiments in res["variants"].items():
        if experiments:
            print(f"  variant {variant!r} = every instance patched with: {', '.join(experiments)}")
    print(f"  {'var':<4} {'plane':<5} {'len':>5} {'coloc':>7} {'PD':>7} {'PD/coloc':>9} {'paired':>6} {'denoised':>8}  "
          f"{'P leg':>7} {'D leg':>7} {'D xfer':>7} {'MiB':>5}  {'P srv':>7} {'D srv':>7} {'C srv':>7} {'C hit':>7} "
          f"{'PD-Psrv':>8} {'C-Csrv':>7} {'reps':>5}")
    for r in res["rows"]:
        ok = ""
        if r["len"] == TARGET_PD_LEN:
            ok = "PASS" if r["pd_over_colocated"] <= TARGET_PD else "MISS"
        print(f"  {r['variant']:<4} {r['plane']:<5} {r['len']:>5} {r['colocated_ms']:>7.1f} {r['pd_ms']:>7.1f} "
              f"{r['pd_over_colocated']:>5.2f} {ok:<4}{r['pd_over_colocated_paired']:>6.2f} "
              f"{r['pd_over_colocated_denoised']:>8.2f}  {r['p_leg_ms']:>7.1f} "
              f"{r['d_leg_ms']:>7.1f} {r['d_xfer_ms']:>7.2f} {r['d_MiB']:>5.1f}  {r['p_server_ms']:>7.1f} "
              f"{r['d_server_ms']:>7.1f} {r['colocated_server_ms']:>7.1f} {r['colocated_hit_ms']:>7.1f} "
              f"{r['pd_minus_p_server_ms']:>8.1f} {r['colocated_minus_server_ms']:>7.1f} "
              f"{r['reps']:>3}{'q' if r['quiet_reps_only'] else '!':>2}")
    print(f"  target: PD/colocated <= {TARGET_PD} at {TARGET_PD_LEN} tokens. P leg = client's P request; D leg = P's "
          "answer -> D's first token;\n  D xfer = D's pdserve:kv_transfer_load_seconds (grant + read); "
          "srv = the instance's own vllm:time_to_first_token_seconds (engine arrival -> first token, no HTTP);\n"
          "  C hit = the same prompt again on C (prefix hit: one-token step, no transfer)\n"
          "  PD-Psrv / C-Csrv = time outside the prefill (median over requests of client TTFT minus the instance's own"
          " TTFT: HTTP, P's answer, the whole D leg)\n"
          "  paired = median of per-rep PD/C ratios; denoised = (F + median(PD - P srv)) / (F + median(C - C srv)), F = "
          "median of all P srv and C srv samples:\n  P's and C's prefills (the same work, which swings with other "
          "processes' load) replaced by one pooled median, so only each side's own overhead differs\n"
          f"  reps: kept; q = only reps where other processes used < {QUIET_CORES} cores, "
          "! = too few quiet reps, all kept")
    worst = max((c["others"] for c in res["contention"]), default=0.0)
    print(f"  first-token text differing between modes (same prompt): {res['first_token_mismatches']}; "
          f"other processes: up to {worst:.2f} cores during a rep")


def print_profile(prof: dict[str, Any]) -> None:
    if not prof:
        print("\n  (profile: no complete traces)")
        return

    def table(title: str, cols: list[str]) -> None:
        w = max(len(c) for c in cols) + 2
        print(f"\n  {title}")
        print(f"  {'segment (ms; # = count)':<58}" + "".join(f"{c:>{w}}" for c in cols))
        keys = list(dict.fromkeys(k for c in cols for k in prof[c]))
        for k in keys:
            spec = ".0f" if k.startswith("#") else ".2f"
            print(f"  {k[:58]:<58}" + "".join(f"{format(prof[c].get(k, float('nan')), spec):>{w}}" for c in cols))

    c_cols = [c for c in prof if ":C/" in c]
    if c_cols:
        table("colocated request time line (medians; server trace + client stamps)", c_cols)
    pd_cols = [c for c in prof if ":C/" not in c]
    if pd_cols:
        table("PD request time line (medians; server traces + client stamps)", pd_cols)


# ============================================================================= main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="short smoke run")
    ap.add_argument("--json", help="write all numbers here")
    ap.add_argument("--only", choices=("dataplane", "ttft"), help="run one part only")
    ap.add_argument("--planes", default="shm,tcp")
    ap.add_argument("--threads", type=int, default=_THREADS_DEFAULT, help="torch threads, here and in instances")
    ap.add_argument("--pool-mib", type=int, default=256)
    ap.add_argument("--blocks", default="125,2048", help="blocks per read (125 = one 2000-token prompt)")
    ap.add_argument("--dp-reps", type=int, default=None,
                    help="data-plane rounds (default 21, doubled for reads <= 16 MiB; quick 5)")
    ap.add_argument("--dp-threads", default="1,2",
                    help="torch threads for the memcpy and shm copies, one table each (default 1,2: with another "
                         "process on a 2-core box a 2-thread copy waits for its descheduled thread)")
    ap.add_argument("--dp-wait-idle", type=float, default=2.0,
                    help="before each data-plane round, wait up to S s for other processes to use < 0.25 cores")
    ap.add_argument("--lengths", default="256,1024,2000")
    ap.add_argument("--reps", type=int, default=None, help="TTFT reps (default 9; quick 3)")
    ap.add_argument("--warmup", type=int, default=None, help="TTFT warm-up requests per mode and length (default 2)")
    ap.add_argument("--max-tokens", type=int, default=2, help="tokens D and C generate (default 2)")
    ap.add_argument("--kv-blocks", type=int, default=1024, help="KV blocks of every instance")
    ap.add_argument("--no-touch-pools", dest="touch_pools", action="store_false",
                    help="skip cycling every KV pool once before measuring (shm pools then pay first-touch faults)")
    ap.add_argument("--wait-idle", type=float, default=5.0,
                    help="before each TTFT (rep, length), wait up to S s for other processes to use < 0.25 cores")
    ap.add_argument("--profile", action="store_true", help="trace the servers and print each PD request's time line")
    ap.add_argument("--experiment", default="",
                    help="comma-separated what-if patches applied to every instance (C, P and D alike): "
                         + "; ".join(f"{k}: {v}" for k, v in procs.EXPERIMENTS.items()))
    ap.add_argument("--no-client-nodelay", dest="client_nodelay", action="store_false",
                    help="leave Nagle on in the benchmark's HTTP client (default: TCP_NODELAY, as a proxy should)")
    args = ap.parse_args(argv)
    args.planes = [p for p in args.planes.split(",") if p]
    args.experiment = [e for e in args.experiment.split(",") if e]
    args.blocks = [int(x) for x in args.blocks.split(",")]
    args.dp_threads = [int(x) for x in args.dp_threads.split(",")]
    args.lengths = [int(x) for x in args.lengths.split(",")]
    if args.quick:
        args.dp_reps = args.dp_reps or 5
        args.reps = args.reps or 3
        args.warmup = args.warmup if args.warmup is not None else 1
        args.pool_mib = min(args.pool_mib, 128)
        args.blocks = [125, 512] if args.blocks == [125, 2048] else args.blocks
        args.lengths = [256, 2000] if args.lengths == [256, 1024, 2000] else args.lengths
        args.wait_idle = min(args.wait_idle, 1.0)
        args.dp_wait_idle = min(args.dp_wait_idle, 0.5)
    args.dp_reps = args.dp_reps or 21
    args.reps = args.reps or 9
    args.warmup = 2 if args.warmup is None else args.warmup
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    work = work_dir("transfer")
    contention = procs.Contention()
    results: dict[str, Any] = {"args": {k: v for k, v in vars(args).items()}, "host": os.uname().nodename,
                               "load_before": procs.loadavg()}
    print(f"bench/transfer.py | torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')} | load {results['load_before']}", flush=True)
    try:
        if args.only in (None, "dataplane"):
            results["dataplane"] = bench_dataplane(args, contention)
        if args.only in (None, "ttft"):
            print(f"\n== Part 2: TTFT, 1P1D vs colocated | planes {','.join(args.planes)} | lengths {args.lengths} | "
                  f"{args.reps} reps", flush=True)
            tb = TtftBench(args, contention, work)
            tb.start()
            results["ttft"] = tb.run()
            for proc in tb.procs.values():
                proc.stop()
            print_ttft(results["ttft"])
            if args.profile:
                results["profile"] = tb.profile()
                print_profile(results["profile"])
    finally:
        _cleanup()
    results["load_after"] = procs.loadavg()
    if "dataplane" in results:
        print("\n== Summary")
        for c in results["dataplane"]["cases"]:
            print(f"  {c['threads']}t {c['blocks']:>5} blocks {c['pattern']:<11}: shm/memcpy {c['shm_over_memcpy']:.2f} "
                  f"(paired {c['shm_over_memcpy_paired']:.2f}; >= {TARGET_SHM}), tcp/raw {c['tcp_over_raw']:.2f} "
                  f"(paired {c['tcp_over_raw_paired']:.2f}; >= {TARGET_TCP})"
                  f"{'' if c['quiet_rounds_only'] else '  [noisy: too few quiet rounds]'}")
    else:
        print("\n== Summary")
    for r in results.get("ttft", {}).get("rows", []):
        target = f" (<= {TARGET_PD})" if r["len"] == TARGET_PD_LEN else ""
        print(f"  TTFT {r['variant']} {r['plane']} {r['len']:>5} tokens: "
              f"PD/colocated {r['pd_over_colocated']:.2f}{target} "
              f"(paired {r['pd_over_colocated_paired']:.2f}, denoised {r['pd_over_colocated_denoised']:.2f}), "
              f"PD {r['pd_ms']:.1f} ms vs {r['colocated_ms']:.1f} ms")
    print(f"  load {results['load_before']} -> {results['load_after']}")
    procs.write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
