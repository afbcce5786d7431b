"""Live migration of running decode requests (pdserve.migration), through the client's clock and /metrics.

Processes: P (prefill), D1 and D2 (decode, reading each other's blocks over --plane) and a pull gateway with an
admin token, on the llama120m preset (12 layers, 4 KV heads: 24 KiB of fp32 KV per token) or --model-preset h256,
max_position_embeddings raised to --max-model-len.

1. stop vs sequence length: a streamed greedy request whose sequence holds L tokens when it is moved (a prompt of
   L - 40 tokens, moved once 32 tokens streamed) from the decode instance it runs on to the other, by live
   migration (a multi-stage copy while it decodes, then a stop for the last blocks), by stop-copy-resume (stop,
   copy everything, resume) and by recompute on the new instance (modes of POST /admin/migrate), rounds rotating the
   order. The stop seen by the client = the largest gap between two consecutive chunks of that request minus the
   request's median time per token (a chunk's gap over the tokens it carries). Also shown: the source's own stop
   (paused to handed over) and the stages.
2. drain: D1 runs --drain-requests generations of --drain-tokens tokens; once each streamed 32 tokens, D1 gets
   SIGTERM (it drains: its requests move to D2, the gateway picking where) and the time until D1 runs none of them
   (and until its process exits) is set against the time the same generations take to finish unmoved.
3. bystanders: --bystanders streams on each of D1 and D2 (sent to them directly), and a 2k-token request moved from
   D1 to D2: the bystanders' mean inter-token time while the move runs against the same stretch just before it
   (and just after it: the moved request's load is D2's from then on), each step of the move on both Ds, and the
   cores the box, each server and the streaming clients used during the move.

  .venv/bin/python bench/migration.py --quick                           # smoke run (h256, short)
  .venv/bin/python bench/migration.py --json bench/out/migration.json   # the recorded run
  .venv/bin/python bench/migration.py --parts drain,bystanders           # some of the measurements
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness as H  # noqa: E402
from proc_cpu import box_busy_s, sched_seconds  # noqa: E402
from ttft import make_model  # noqa: E402

ADMIN = "bench-migration-admin"
AUTH = {"Authorization": f"Bearer {ADMIN}"}
MODES = ("live", "stop-copy", "recompute")
PARTS = ("stops", "drain", "bystanders")


class Streamer(threading.Thread):
    """One streamed request, read on its own thread: the arrival time of each token's chunk."""

    def __init__(self, url: str, body: dict, request_id: str | None = None) -> None:
        super().__init__(daemon=True)
        self.url, self.body = url, body
        self.request_id = request_id or uuid.uuid4().hex
        self.times: list[float] = []  # one entry per token (a loaded instance may send several in one chunk)
        self.chunks: list[tuple[float, int]] = []  # (arrival, tokens) per chunk
        self.error = ""
        self.closed = False
        self.client: Any = None
        self.start()

    def run(self) -> None:
        client = self.client = H.http_client(600)
        try:
            for t, data in H.sse_data(client, self.url, self.body, {"X-Request-Id": self.request_id}):
                chunk = json.loads(data)
                if "choices" not in chunk:
                    self.error = data[:300]
                elif chunk["choices"]:
                    count = sum(len(c.get("token_ids") or []) for c in chunk["choices"])
                    self.chunks.append((t, count))
                    self.times.extend([t] * count)
        except Exception as exc:  # noqa: BLE001 - reported with the run
            if not self.closed:
                self.error = f"{type(exc).__name__}: {exc}"
        finally:
            client.close()

    def close(self) -> None:
        """Leave: the instance aborts the request."""
        self.closed = True
        self.client.close()
        self.join(60)

    def wait_tokens(self, n: int, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while len(self.times) < n and self.is_alive() and time.monotonic() < deadline:
            time.sleep(0.002)

    def gaps(self) -> list[float]:
        """The time between consecutive chunks, each over the tokens its later chunk carries: one token a chunk,
        unless the instance fell behind the client and sent several at once."""
        return [(b - a) / max(n, 1) for (a, _), (b, n) in zip(self.chunks, self.chunks[1:])]

    def largest_gap(self) -> float:
        return max(b - a for (a, _), (b, _) in zip(self.chunks, self.chunks[1:]))


class Fleet:
    def __init__(self, servers: H.Servers, model: Path, args: argparse.Namespace) -> None:
        common = ["--max-model-len", str(args.max_model_len), "--num-kv-blocks", str(args.kv_blocks),
                  "--threads", "1", "--max-num-batched-tokens", "2048", "--served-model-name", "m"]
        self.servers, self.model, self.common = servers, model, [*common, "--no-enable-prefix-caching"]
        self.kv = H.kv_config("kv_consumer", args.plane)
        servers.instance("P", model, *self.common, "--kv-transfer-config", H.kv_config("kv_producer"))
        for name in ("D1", "D2"):
            servers.instance(name, model, *self.common, "--drain-timeout", "120", "--kv-transfer-config", self.kv)
        self.gw = servers.gateway("G", "--protocol", "pull", "--prefill", servers.url("P"), "--decode",
                                  servers.url("D1"), servers.url("D2"), "--admin-token", ADMIN,
                                  "--idle-timeout", "600").url

    def url(self, name: str) -> str:
        return self.servers.url(name)

    def admin(self, client: Any, path: str, body: dict) -> Any:
        return client.post(f"{self.gw}{path}", json=body, headers=AUTH, timeout=600)

    def only(self, client: Any, name: str) -> None:
        """Route new requests to decode instance `name` alone (the other is deregistered)."""
        gone = "D2" if name == "D1" else "D1"
        self.admin(client, "/deregister", {"url": self.url(gone)})

    def both(self, client: Any) -> None:
        for name in ("D1", "D2"):
            self.admin(client, "/register", {"url": self.url(name), "role": "decode"})

    def restart_d1(self, client: Any) -> None:
        """D1 exited after its drain: a new D1 takes its place (at a new address)."""
        old = self.url("D1")
        self.servers.instance("D1", self.model, *self.common, "--drain-timeout", "120", "--kv-transfer-config", self.kv)
        self.admin(client, "/deregister", {"url": old})
        self.admin(client, "/register", {"url": self.url("D1"), "role": "decode"})

    def serving(self, client: Any, request_id: str) -> str:
        events = H.timeline_events(client, self.gw, request_id)
        url = [attrs["url"] for name, _, attrs in events if name == "leg_start" and attrs.get("leg") == "decode"][-1]
        return "D1" if url == self.url("D1") else "D2"


def body(prompt: list[int], max_tokens: int) -> dict:
    return {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}


def prompt_of(gen: random.Random, n: int) -> list[int]:
    return [gen.randrange(100, 30000) for _ in range(n)]


def stop_run(fleet: Fleet, client: Any, gen: random.Random, length: int, mode: str, meter: H.CpuMeter,
             after: int = 32) -> dict[str, Any]:
    stream = Streamer(f"{fleet.gw}/v1/completions", body(prompt_of(gen, length - 40), 96))
    stream.wait_tokens(after)
    source = fleet.serving(client, stream.request_id)
    meter.mark()
    r = fleet.admin(client, "/admin/migrate", {"request_id": stream.request_id, "mode": mode,
                                               "to": fleet.url("D2" if source == "D1" else "D1")})
    others = meter.since_mark()["others"]
    stream.join(600)
    answer = r.json()["data"][0] if r.status_code == 200 else {"outcome": f"status {r.status_code}: {r.text}"}
    step, largest = statistics.median(stream.gaps()), stream.largest_gap()
    return {"length": length, "mode": mode, "outcome": answer["outcome"], "error": stream.error,
            "tokens": len(stream.times), "stop_ms": (largest - step) * 1e3,
            "max_gap_ms": largest * 1e3, "step_ms": step * 1e3,
            "source_stop_ms": answer.get("stop_s", 0.0) * 1e3, "stages": answer.get("stages", 0), "others": others}


def drain_run(fleet: Fleet, client: Any, gen: random.Random, args: argparse.Namespace, move: bool) -> dict[str, Any]:
    """D1 drains (SIGTERM: its running requests move to D2) against no drain (they finish on D1): the time until
    D1 runs none of them, and (drained) until its process exited."""
    fleet.only(client, "D1")
    streams = [Streamer(f"{fleet.gw}/v1/completions", body(prompt_of(gen, 200), args.drain_tokens))
               for _ in range(args.drain_requests)]
    for stream in streams:
        stream.wait_tokens(32)
    fleet.both(client)
    d1 = fleet.servers.procs["D1"]
    started = time.monotonic()
    if move:
        d1.popen.send_signal(signal.SIGTERM)
    while H.scrape(client, d1.url).get("vllm:num_requests_running", 1) > 0:
        time.sleep(0.01)
    seconds = time.monotonic() - started
    exited = float("nan")
    if move:
        d1.popen.wait(120)
        exited = time.monotonic() - started
        fleet.restart_d1(client)
    for stream in streams:
        stream.join(600)
    return {"moved": move, "seconds": seconds, "exit_s": exited, "errors": [s.error for s in streams if s.error],
            "tokens": [len(s.times) for s in streams]}


def bystander_run(fleet: Fleet, client: Any, gen: random.Random, args: argparse.Namespace) -> dict[str, Any]:
    """Bystanders' mean inter-token time while a request moves from D1 to D2, and in as long a stretch before."""
    long_enough = min(4000, args.max_model_len - 101)  # past the move, within the context
    bystanders = {name: [Streamer(f"{fleet.url(name)}/v1/completions", body(prompt_of(gen, 100), long_enough))
                         for _ in range(args.bystanders)] for name in ("D1", "D2")}
    fleet.only(client, "D1")
    moving = Streamer(f"{fleet.gw}/v1/completions", body(prompt_of(gen, min(2000, args.max_model_len - 300)), 200))
    moving.wait_tokens(32)
    fleet.both(client)
    time.sleep(1.0)  # the bystanders' steady state
    pids = {name: proc.pid for name, proc in fleet.servers.procs.items()}
    cpu0, busy0, own0 = {name: sched_seconds(pid) for name, pid in pids.items()}, box_busy_s(), sum(os.times()[:2])
    t0 = time.monotonic()
    pace = {} if args.max_mib_per_s is None else {"max_mib_per_s": args.max_mib_per_s}
    r = fleet.admin(client, "/admin/migrate", {"request_id": moving.request_id, "to": fleet.url("D2"), **pace})
    t1 = time.monotonic()
    cpu1, busy1, own1 = {name: sched_seconds(pid) for name, pid in pids.items()}, box_busy_s(), sum(os.times()[:2])
    time.sleep(max(t1 - t0, 0.3))  # as long a stretch after the move, for the load it left on each side
    moving.join(600)
    outcome = r.json()["data"][0]["outcome"] if r.status_code == 200 else f"status {r.status_code}: {r.text[:200]}"
    # Cores in use during the move: the whole box, each server, and this process (the streaming clients).
    cores = {name: round((cpu1[name] - cpu0[name]) / (t1 - t0), 2) for name in pids}
    cores |= {"clients": round((own1 - own0) / (t1 - t0), 2), "box": round((busy1 - busy0) / (t1 - t0), 2)}
    out: dict[str, Any] = {"move_ms": (t1 - t0) * 1e3, "outcome": outcome, "cores": cores,
                           "bystander_errors": [s.error for ss in bystanders.values() for s in ss if s.error],
                           "bystander_tokens": [len(s.times) for ss in bystanders.values() for s in ss]}
    for name, streams in bystanders.items():
        during = _mean_gap(streams, t0, t1)
        before = _mean_gap(streams, t0 - max(t1 - t0, 0.3), t0)
        after = _mean_gap(streams, t1, t1 + max(t1 - t0, 0.3))
        out[name] = {"before_ms": before * 1e3, "during_ms": during * 1e3, "after_ms": after * 1e3,
                     "ratio": during / before, "steps_during_ms": _step_gaps(streams, t0, t1)}
    for streams in bystanders.values():
        for stream in streams:
            stream.close()
    return out


def _step_gaps(streams: list[Streamer], t0: float, t1: float) -> list[float]:
    """The instance's step-to-step gaps in [t0, t1] (ms), read off its first bystander: whether a slower stretch is
    every step a little slower or one step much longer."""
    times = streams[0].times
    return [round((b - a) * 1e3, 1) for a, b in zip(times, times[1:]) if t0 <= b <= t1]


def _mean_gap(streams: list[Streamer], t0: float, t1: float) -> float:
    """The mean time between two tokens of the streams, over the tokens that arrived in [t0, t1]."""
    gaps = [b - a for s in streams for a, b in zip(s.times, s.times[1:]) if t0 <= b <= t1]
    return statistics.fmean(gaps) if gaps else float("nan")


def run(args: argparse.Namespace, servers: H.Servers, model: Path, meter: H.CpuMeter) -> dict[str, Any]:
    fleet = Fleet(servers, model, args)
    client = H.http_client(600)
    gen = random.Random(2024)
    warm = stop_run(fleet, client, gen, args.lengths[0], "live", meter)
    print(f"  warm-up: {warm['outcome']}, step {warm['step_ms']:.1f} ms", flush=True)
    stops = []
    for rep, order in H.rotations(list(args.modes), args.reps if "stops" in args.parts else 0):
        for length in args.lengths:
            for mode in order:
                stops.append({**stop_run(fleet, client, gen, length, mode, meter), "rep": rep})
                print(f"  [{rep + 1}/{args.reps}] L={length:5d} {mode:9s} stop {stops[-1]['stop_ms']:8.1f} ms "
                      f"(step {stops[-1]['step_ms']:.1f}, source {stops[-1]['source_stop_ms']:.1f}, stages "
                      f"{stops[-1]['stages']}, {stops[-1]['outcome']}) others {stops[-1]['others']:.2f}", flush=True)
    drains = [drain_run(fleet, client, gen, args, move) for move in (True, False) if "drain" in args.parts]
    for d in drains:
        print(f"  {args.drain_requests} x {args.drain_tokens} tokens, {'drained' if d['moved'] else 'not drained'}: "
              f"D1 runs none after {d['seconds']:.2f} s, exits after {d['exit_s']:.2f} s {d['errors'][:2]}", flush=True)
    bystanders = [bystander_run(fleet, client, gen, args)
                  for _ in range(args.bystander_rounds if "bystanders" in args.parts else 0)]
    for b in bystanders:
        print(f"  bystanders: move {b['move_ms']:.0f} ms ({b['outcome']}); D1 {b['D1']['ratio']:.2f}x, D2 {b['D2']['ratio']:.2f}x"
              f" (tokens {b['bystander_tokens']}{', errors ' + str(b['bystander_errors'][:2]) if b['bystander_errors'] else ''})",
              flush=True)
        for name in ("D1", "D2"):
            print(f"    {name}: ms per token before / during / after {b[name]['before_ms']:.1f} / "
                  f"{b[name]['during_ms']:.1f} / {b[name]['after_ms']:.1f}; steps during the move "
                  f"{b[name]['steps_during_ms']}", flush=True)
        print(f"    cores in use during the move (of {os.cpu_count()}): {b['cores']}", flush=True)
    return {"stops": stops, "rows": rows(stops, args), "drains": drains, "bystanders": bystanders}


def rows(stops: list[dict[str, Any]], args: argparse.Namespace) -> list[dict[str, Any]]:
    out = []
    for length in args.lengths:
        row: dict[str, Any] = {"length": length}
        for mode in args.modes:
            runs = [s for s in stops if s["length"] == length and s["mode"] == mode and s["outcome"] == "handed_over"]
            row[mode] = H.median([s["stop_ms"] for s in runs])
            row[f"{mode}_steps"] = H.median([s["stop_ms"] / s["step_ms"] for s in runs])
            row[f"{mode}_source"] = H.median([s["source_stop_ms"] for s in runs])
        out.append(row)
    return out


def report(result: dict[str, Any], args: argparse.Namespace) -> None:
    if result["stops"]:
        print("\nstop seen by the client (median over rounds; ms, and in decode steps):")
        print("  length | " + " | ".join(f"{m:>22s}" for m in args.modes) + " | live source stop")
    for row in result["rows"] if result["stops"] else []:
        cells = " | ".join(f"{H.fmt(row[m], '.1f'):>9s} ms {H.fmt(row[m + '_steps'], '.1f'):>6s} st" for m in args.modes)
        print(f"  {row['length']:6d} | {cells} | {H.fmt(row.get('live_source'), '.1f')} ms")
    if result["drains"]:
        moved, finished = result["drains"]
        print(f"\ndrain of a D running {args.drain_requests} generations of {args.drain_tokens} tokens: its requests "
              f"gone after {moved['seconds']:.2f} s (process exited after {moved['exit_s']:.2f} s, the 2 s linger "
              f"included); finishing them takes {finished['seconds']:.2f} s "
              f"({finished['seconds'] / moved['seconds']:.0f}x)")
    if result["bystanders"]:
        ratios = {name: H.median([b[name]["ratio"] for b in result["bystanders"]]) for name in ("D1", "D2")}
        print(f"bystanders' TPOT during a move / before it (median of {len(result['bystanders'])}): "
              f"D1 {ratios['D1']:.2f}x, D2 {ratios['D2']:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-preset", default="llama120m", choices=["llama120m", "h256"])
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--kv-blocks", type=int, default=2048)
    parser.add_argument("--plane", default="tcp", help="the data plane D1 and D2 read each other's blocks over")
    parser.add_argument("--lengths", type=lambda v: [int(x) for x in v.split(",")], default=[256, 1024, 2048, 4000])
    parser.add_argument("--modes", type=lambda v: v.split(","), default=list(MODES))
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--drain-requests", type=int, default=16)
    parser.add_argument("--drain-tokens", type=int, default=1000)
    parser.add_argument("--bystanders", type=int, default=4)
    parser.add_argument("--bystander-rounds", type=int, default=5)
    parser.add_argument("--max-mib-per-s", type=float, default=None,
                        help="bystanders: the moves' bulk copy pace (default: the instances' own, unpaced)")
    parser.add_argument("--parts", type=lambda v: v.split(","), default=list(PARTS),
                        help="which measurements to run (default: all): " + ",".join(PARTS))
    parser.add_argument("--quick", action="store_true", help="h256, short lengths, one round: a smoke run")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.quick:
        args.model_preset, args.max_model_len, args.lengths, args.reps = "h256", 2048, [256, 1024], 1
        args.drain_requests, args.drain_tokens, args.bystander_rounds = 4, 300, 1
    cleanup = H.Cleanup()
    meter = H.CpuMeter()
    servers = H.Servers(cleanup, meter)
    try:
        model = make_model(cleanup.work_dir("migration"), args.max_model_len, args.model_preset)
        hardware = H.probe_hardware(1, copy_bytes=H.GiB // 4, rounds=1)
        print(f"{hardware.describe()}\nmodel {args.model_preset}, plane {args.plane}, load {H.loadavg()}", flush=True)
        result = run(args, servers, model, meter)
        report(result, args)
        H.write_json(args.json, {"args": vars(args), "hardware": hardware, **result})
    finally:
        servers.stop()
        cleanup.run()


if __name__ == "__main__":
    main()
