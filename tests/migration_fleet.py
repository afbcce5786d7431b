"""A small pdserve fleet for the migration tests: a prefill instance, decode instances (started, restarted and
registered with the gateway as a test needs), a pull gateway with an admin token, and a streamed request read on a
thread, with the arrival time of every event."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx

from pdserve.launcher import Process, start, start_instance, stop_all
from server_utils import metric_values, wait_for, wait_until_idle

ADMIN = "migration-admin-token"
AUTH = {"Authorization": f"Bearer {ADMIN}"}
STEP_DELAY_S = 0.01  # decode instances step at ~100 tokens/s, so a request is still running when it is moved
COMMON = ["--max-model-len", "1024", "--num-kv-blocks", "256", "--max-num-batched-tokens", "64",
          "--served-model-name", "tiny", "--admin-token", ADMIN]


def kv_config(role: str, plane: str = "auto", lease_s: float | None = None) -> str:
    extra: dict = {"data_plane": plane, "fault_injection_api": True}
    if role == "kv_consumer":
        extra["fault_injection"] = {"step_delay_s": STEP_DELAY_S}
    if lease_s is not None:
        extra["kv_lease_duration"] = lease_s
    return json.dumps({"kv_connector": "PdConnector", "kv_role": role, "kv_connector_extra_config": extra})


class Fleet:
    def __init__(self, model: Path, decodes: dict[str, list[str]]) -> None:
        self.model = model
        self.procs: dict[str, Process] = {}
        self.flags: dict[str, list[str]] = {}
        self.gateway: Process | None = None
        with ThreadPoolExecutor(4) as pool:  # instances start side by side: most of it is waiting on imports
            # P caches no prefix: a request and its unmoved twin report the same usage (cached_tokens 0).
            jobs = {"P": pool.submit(self._start, "P", ["--no-enable-prefix-caching",
                                                        "--kv-transfer-config", kv_config("kv_producer")])}
            jobs.update({name: pool.submit(self._start, name, flags) for name, flags in decodes.items()})
            for job in jobs.values():
                job.result()
        decode_urls = [self.procs[name].url for name in decodes]
        self.gateway = start("gateway", ["gateway", "--port", "0", "--log-level", "warning", "--protocol", "pull",
                                         "--prefill", self.procs["P"].url, "--decode", *decode_urls,
                                         "--admin-token", ADMIN, "--idle-timeout", "30", "--retries", "2"])

    def _start(self, name: str, flags: list[str]) -> Process:
        self.flags[name] = flags
        self.procs[name] = start_instance(self.model, *COMMON, *flags, name=name)
        return self.procs[name]

    def __getitem__(self, name: str) -> Process:
        return self.procs[name]

    def name_of(self, url: str) -> str:
        return next(name for name, proc in self.procs.items() if proc.url == url)

    def add_decode(self, name: str, flags: list[str]) -> Process:
        proc = self._start(name, flags)
        r = httpx.post(f"{self.gateway.url}/register", json={"url": proc.url, "role": "decode"}, headers=AUTH)
        assert r.status_code == 200, r.text
        return proc

    def remove(self, name: str) -> None:
        proc = self.procs.pop(name)
        httpx.post(f"{self.gateway.url}/deregister", json={"url": proc.url}, headers=AUTH)
        proc.stop()

    def restart(self, name: str) -> Process:
        """A killed decode instance comes back (at a new address, which the gateway learns)."""
        old = self.procs.pop(name)
        old.stop()
        httpx.post(f"{self.gateway.url}/deregister", json={"url": old.url}, headers=AUTH)
        return self.add_decode(name, self.flags[name])

    @contextmanager
    def held_back(self, step_delay_s: float = 0.1) -> Iterator[None]:
        """Decode instances step slowly while a test arranges a move, so the request is still running when the move
        reaches it however loaded the box (at STEP_DELAY_S a whole-suite run once finished 600 tokens, 13 s, before
        its test, stalled among other workers, asked for the move); back to STEP_DELAY_S afterwards."""
        decodes = [name for name in self.procs if name != "P"]
        for name in decodes:
            self.faults(name, step_delay_s=step_delay_s)
        try:
            yield
        finally:
            for name in decodes:
                self.faults(name)

    def faults(self, name: str, **config: float) -> None:
        r = httpx.post(f"{self.procs[name].url}/v1/kv/faults", json={"step_delay_s": STEP_DELAY_S, **config},
                       headers=AUTH)
        assert r.status_code == 200, r.text

    def migrate(self, request_id: str, to: str, **extra) -> httpx.Response:
        return httpx.post(f"{self.gateway.url}/admin/migrate", json={"request_id": request_id,
                                                                      "to": self.procs[to].url, **extra},
                          headers=AUTH, timeout=120)

    def serving(self, request_id: str) -> str:
        """The decode instance the request runs on now, by the gateway's timeline."""
        events = httpx.get(f"{self.gateway.url}/v1/timeline/{request_id}").json()["data"][-1]["events"]
        legs = [e["attrs"]["url"] for e in events if e["name"] == "leg_start" and e["attrs"]["leg"].startswith("decode")]
        return self.name_of(legs[-1])

    def idle(self, timeout: float = 20.0) -> None:
        """Nothing held anywhere: no block in use, no lease, no request."""
        for name, proc in self.procs.items():
            metrics = wait_until_idle(proc.url, timeout)
            assert metrics.get("pdserve:kv_leases_held", 0) == 0, name

    def stop(self) -> None:
        stop_all([*self.procs.values(), *([self.gateway] if self.gateway else [])])


class Stream:
    """A streamed request through the gateway, read on its own thread."""

    def __init__(self, fleet: Fleet, body: dict, path: str = "/v1/completions", gateway_url: str | None = None) -> None:
        self.request_id = uuid.uuid4().hex
        self.events: list[tuple[float, dict | str]] = []
        self.status = 0
        url = (gateway_url or fleet.gateway.url) + path
        self._thread = threading.Thread(target=self._read, args=(url, body), daemon=True)
        self._thread.start()

    def _read(self, url: str, body: dict) -> None:
        with httpx.stream("POST", url, json=body, headers={"X-Request-Id": self.request_id}, timeout=120) as r:
            self.status = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: "):
                    data = line[len("data: "):]
                    self.events.append((time.monotonic(), data if data == "[DONE]" else json.loads(data)))
                elif line:
                    self.events.append((time.monotonic(), f"unexpected line: {line}"))

    def wait_for_events(self, count: int) -> None:
        wait_for(lambda: len(self.events) >= count or not self._thread.is_alive(), 60, f"{count} events")
        assert len(self.events) >= count, f"the request ended after {len(self.events)} events: {self.events[-2:]}"

    def result(self) -> dict:
        self._thread.join(120)
        assert not self._thread.is_alive(), "the stream did not end"
        return answer_of(self.events)


def answer_of(events: list[tuple[float, dict | str]]) -> dict:
    """What a client makes of a stream: its text, token ids, logprobs, usage and how it ended."""
    out = {"text": "", "token_ids": [], "logprobs": [], "usage": None, "finish_reason": None, "errors": [],
           "done": False, "chunks": 0}
    for _, event in events:
        if event == "[DONE]":
            out["done"] = True
        elif isinstance(event, str) or "error" in event:
            out["errors"].append(event)
        else:
            if event.get("usage"):
                out["usage"] = event["usage"]
            for choice in event["choices"]:
                out["chunks"] += 1
                out["text"] += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                out["token_ids"] += choice.get("token_ids") or []
                out["logprobs"] += _logprobs_of(choice.get("logprobs"))
                out["finish_reason"] = choice.get("finish_reason") or out["finish_reason"]
    return out


def _logprobs_of(logprobs: dict | None) -> list[float]:
    if not logprobs:
        return []
    if "content" in logprobs:
        return [item["logprob"] for item in logprobs["content"]]
    return logprobs["token_logprobs"]


def blocks_in_use(proc: Process) -> float:
    return metric_values(proc.url).get("pdserve:kv_blocks_in_use", -1)
