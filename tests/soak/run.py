"""Soak test: a mixed, faulty workload through the gateway for a long time; answers checked, leaks and growth reported.

One prefill instance (P) and one decode instance (D), both with injected transfer faults at a low rate, a colocated
reference instance (C, no KV connector) on the same tiny model, and one gateway per protocol (pull, push,
decode-first) in front of the same P and D. `--concurrency` client threads send requests for `--duration` seconds,
each one drawn from a seeded RNG:

* gateway (protocol): uniform over `--protocols`;
* endpoint: /v1/completions (token-id prompt) or /v1/chat/completions (the text of random token ids);
* prompt: short (5-30 tokens) or long (100-400), random ids in [0, 4000); some prompts repeat an earlier one, or
  extend an earlier one's prefix, so the prefix cache and cached reference answers get used;
* streaming or not; max_tokens 4-32; greedy (temperature 0), `return_token_ids`;
* ~10 % are abandoned by the client: the connection is closed after the first SSE chunk, or after a random delay.

Every request that was not abandoned and got a 200 is compared with C's greedy answer to the same prompt (asked once
per prompt with max_tokens 32 and top-2 logprobs, cached). Plain answers: the token ids must equal C's first
max_tokens ids (fewer if C stopped at EOS) and the text must agree; a mismatch where C's top-2 logprobs are within
`--near-tie` is counted apart ("near ties": two correct computations may pick either). Streams: the concatenated text
must agree; streamed token ids that merely leave some ids out are counted apart (`stream_ids_missing`, a known pdserve
stream issue). Anything else is a wrong answer; after one, the same prompt is asked directly of P and D and again
through the gateway, to tell which instance holds bad state, and the summary lists the earlier requests that shared
its prompt or its first block. Repeated prompts are mostly recent ones, so a bad prefix-cache block is read back
before it is evicted. Non-200 answers with an OpenAI error body and SSE error events are clean errors (allowed under
injected faults); anything else (connection reset, truncated stream, missing error body) is unclean, and a request
with no byte for `--request-timeout` seconds is a timeout (a hang).

At the end the load stops, every instance must drain within `--drain-timeout` (no KV blocks in use, nothing running
or waiting, no leases, transfer-map entries or push registrations left; gateways with nothing in flight), and the
RSS (VmRSS, /proc/<pid>/status) of every process is compared with its value after warm-up. Exit status 1 if any
answer was wrong, anything is left held, a process died, a request ended uncleanly / hung, or an instance's RSS grew
by more than `--max-rss-growth` (25 %) from the end of warm-up to the end.

    .venv/bin/python tests/soak/run.py --duration 20              # smoke run (or: PDSERVE_SOAK_S=20 pytest tests/test_soak.py)
    .venv/bin/python tests/soak/run.py --duration 600 --json bench/out/soak.json   # or PDSERVE_SOAK_S=600

Only 127.0.0.1; every process started here is stopped by PID at the end (SIGTERM, then SIGKILL).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pdserve.launcher import Process, start, start_instance

MODEL_NAME = "tiny"
REF_MAX_TOKENS = 32
ALL_PROTOCOLS = ("pull", "push", "decode-first")
# Base fault probabilities on both P and D; --fault-rate scales them (message_delay_s is a duration, not scaled).
BASE_FAULTS = {"message_drop": 0.02, "message_delay": 0.05, "read_fail": 0.02, "block_fail": 0.01,
               "block_corrupt": 0.01, "write_fail": 0.02}
MESSAGE_DELAY_S = 0.05
HELD_GAUGES = ("pdserve:kv_blocks_in_use", "vllm:num_requests_running", "vllm:num_requests_waiting",
               "pdserve:num_requests_held", "pdserve:kv_leases_held", "pdserve:kv_transfer_map_size",
               "pdserve:kv_push_expected")
MiB = 1 << 20


# ----------------------------------------------------------------------------- processes and metrics


def metric_samples(url: str, timeout: float = 10.0) -> list[tuple[str, dict[str, str], float]]:
    text = httpx.get(f"{url}/metrics", timeout=timeout).text
    return [(s.name, dict(s.labels), s.value) for fam in text_string_to_metric_families(text) for s in fam.samples]


def metric_values(url: str) -> dict[str, float]:
    """Every sample of /metrics keyed by name, summed over label sets."""
    values: dict[str, float] = {}
    for name, _, value in metric_samples(url):
        values[name] = values.get(name, 0.0) + value
    return values


def proc_status(pid: int) -> dict[str, float]:
    """VmRSS, RssAnon, RssShmem of a process in MiB (empty if it is gone)."""
    out: dict[str, float] = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssShmem", "VmHWM"):
                out[key] = int(rest.split()[0]) / 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    return out


def kv_config(role: str, extra: dict[str, Any]) -> str:
    return json.dumps({"kv_connector": "PdConnector", "kv_role": role, "kv_connector_extra_config": extra})


# ----------------------------------------------------------------------------- workload


@dataclass
class Spec:
    """One client request, drawn before it is sent."""

    protocol: str
    kind: str  # "completion" | "chat"
    prompt: tuple[int, ...] | str
    prompt_len: int  # token ids drawn (chat: before the template)
    stream: bool
    max_tokens: int
    include_usage: bool
    abort: str | None  # None | "first_chunk" | "delay"
    abort_delay: float
    request_id: str = ""
    first_block: tuple[int, ...] = ()  # the first 16 drawn ids: requests that share it share a cached block

    @property
    def prefix_key(self) -> tuple:
        return (self.kind, self.first_block)

    @property
    def ref_key(self) -> tuple:
        return (self.kind, self.prompt)


class PromptPool:
    """Earlier prompts of each kind, so some requests repeat or extend one (prefix-cache hits on P, D and C)."""

    def __init__(self, limit: int = 256) -> None:
        self.limit = limit
        self.lock = threading.Lock()
        self.ids: dict[str, list[list[int]]] = {"completion": [], "chat": []}

    def add(self, kind: str, ids: list[int]) -> None:
        with self.lock:
            pool = self.ids[kind]
            pool.append(ids)
            if len(pool) > self.limit:
                del pool[0]

    def pick(self, kind: str, rng: random.Random) -> list[int] | None:
        """Mostly a recent prompt (its blocks are likely still in the instances' prefix caches, so a bad cached
        block gets read back while it lives), sometimes any earlier one."""
        with self.lock:
            pool = self.ids[kind]
            if not pool:
                return None
            recent = pool[-16:] if rng.random() < 0.7 else pool
            return list(rng.choice(recent))


class Workload:
    def __init__(self, args: argparse.Namespace, protocols: list[str], decode_text) -> None:
        self.args = args
        self.protocols = protocols
        self.decode_text = decode_text
        self.pool = PromptPool()
        self.count = 0
        self.probe_urls: dict[str, str] = {}  # instances asked directly after a wrong answer (P, D)
        self.history: dict[tuple, list[dict[str, Any]]] = {}  # earlier requests per prompt, for wrong answers
        self.prefix_history: dict[tuple, list[dict[str, Any]]] = {}  # the same, per first block of drawn ids
        self.t0 = time.monotonic()

    def remember(self, res: Result) -> list[dict[str, Any]]:
        """Record a finished request under its prompt; returns the prompt's earlier requests."""
        spec = res.spec
        entry = {"request_id": spec.request_id, "protocol": spec.protocol, "stream": spec.stream,
                 "max_tokens": spec.max_tokens, "abort": spec.abort, "outcome": res.outcome,
                 "t_end": round(res.end - self.t0, 2), "latency_s": round(res.latency, 3),
                 "prompt_len": spec.prompt_len, "same_prompt": True}
        with self.pool.lock:
            earlier = self.history.setdefault(spec.ref_key, [])
            before = list(earlier)
            earlier.append(entry)
            if len(earlier) > 30:
                del earlier[0]
            if spec.first_block:
                shared = self.prefix_history.setdefault(spec.prefix_key, [])
                ids = {e["request_id"] for e in before}
                before += [{**e, "same_prompt": False} for e in shared if e["request_id"] not in ids]
                shared.append(entry)
                if len(shared) > 30:
                    del shared[0]
        return sorted(before, key=lambda e: e["t_end"])

    def _new_ids(self, rng: random.Random) -> list[int]:
        n = rng.randint(5, 30) if rng.random() < 0.6 else rng.randint(100, 400)
        return [rng.randrange(4000) for _ in range(n)]

    def draw(self, rng: random.Random) -> Spec:
        kind = "chat" if rng.random() < 0.5 else "completion"
        r = rng.random()
        ids = None
        if r < 0.2:  # the same prompt again
            ids = self.pool.pick(kind, rng)
        elif r < 0.3:  # an earlier prompt's prefix, then new tokens
            base = self.pool.pick(kind, rng)
            if base is not None:
                keep = rng.randint(1, len(base))
                ids = base[:keep] + self._new_ids(rng)[: rng.randint(1, 100)]
        if ids is None:
            ids = self._new_ids(rng)
        self.pool.add(kind, ids)
        prompt: tuple[int, ...] | str = tuple(ids) if kind == "completion" else self.decode_text(ids)
        stream = rng.random() < 0.5
        abort = None
        if rng.random() < self.args.abort_fraction:
            abort = "first_chunk" if stream and rng.random() < 0.5 else "delay"
        with self.pool.lock:
            self.count += 1
            request_id = f"soak-{self.count}"
        return Spec(protocol=rng.choice(self.protocols), kind=kind, prompt=prompt, prompt_len=len(ids),
                    stream=stream, max_tokens=rng.randint(4, 32), include_usage=stream and rng.random() < 0.5,
                    abort=abort, abort_delay=rng.uniform(0.02, 2.0), request_id=request_id,
                    first_block=tuple(ids[:16]) if len(ids) >= 16 else ())


def request_body(kind: str, prompt: tuple[int, ...] | str, max_tokens: int, stream: bool) -> tuple[str, dict]:
    body: dict[str, Any] = {"model": MODEL_NAME, "max_tokens": max_tokens, "temperature": 0, "stream": stream,
                            "return_token_ids": True}
    if kind == "completion":
        body["prompt"] = list(prompt)
        return "/v1/completions", body
    body["messages"] = [{"role": "user", "content": prompt}]
    return "/v1/chat/completions", body


# ----------------------------------------------------------------------------- the reference (colocated) answers


@dataclass
class Reference:
    token_ids: list[int]
    text: str
    finish_reason: str
    gaps: list[float | None]  # top-1 minus top-2 logprob per position (None if unknown)


class References:
    """C's greedy answer per (kind, prompt), asked once (max_tokens 32, top-2 logprobs) and cached."""

    def __init__(self, url: str, timeout: float) -> None:
        self.url = url
        self.timeout = timeout
        self.lock = threading.Lock()
        self.cache: dict[tuple, Reference | None] = {}
        self.pending: dict[tuple, threading.Event] = {}
        self.errors: list[str] = []
        self.asked = 0

    def get(self, client: httpx.Client, key: tuple) -> Reference | None:
        while True:
            with self.lock:
                if key in self.cache:
                    return self.cache[key]
                event = self.pending.get(key)
                if event is None:
                    event = self.pending[key] = threading.Event()
                    mine = True
                else:
                    mine = False
            if not mine:
                event.wait(self.timeout + 10)
                continue
            ref = None
            try:
                ref = self._ask(client, key)
            finally:
                with self.lock:
                    self.cache[key] = ref
                    self.asked += 1
                    del self.pending[key]
                event.set()
            return ref

    def _ask(self, client: httpx.Client, key: tuple) -> Reference | None:
        kind, prompt = key
        path, body = request_body(kind, prompt, REF_MAX_TOKENS, False)
        if kind == "completion":
            body["logprobs"] = 2
        else:
            body.update(logprobs=True, top_logprobs=2)
        try:
            r = client.post(self.url + path, json=body, timeout=self.timeout)
        except httpx.HTTPError as exc:
            self._error(f"{type(exc).__name__}: {exc}")
            return None
        if r.status_code != 200:
            self._error(f"HTTP {r.status_code}: {r.text[:300]}")
            return None
        choice = r.json()["choices"][0]
        gaps: list[float | None] = []
        if kind == "completion":
            text = choice["text"]
            for top in (choice.get("logprobs") or {}).get("top_logprobs") or []:
                values = sorted(top.values(), reverse=True) if top else []
                gaps.append(values[0] - values[1] if len(values) >= 2 else None)
        else:
            text = choice["message"]["content"] or ""
            for item in (choice.get("logprobs") or {}).get("content") or []:
                values = sorted((t["logprob"] for t in item.get("top_logprobs") or []), reverse=True)
                gaps.append(values[0] - values[1] if len(values) >= 2 else None)
        return Reference(list(choice["token_ids"]), text, choice.get("finish_reason") or "", gaps)

    def _error(self, message: str) -> None:
        with self.lock:
            self.errors.append(message)


# ----------------------------------------------------------------------------- one client request


@dataclass
class Result:
    outcome: str  # completed | wrong | near_tie | clean_error | aborted | unclean | timeout | no_reference
    spec: Spec
    latency: float
    detail: str = ""
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""
    ids_missing: int = 0  # streams: token ids the stream left out (text complete)
    diagnosis: dict[str, Any] = field(default_factory=dict)  # wrong answers: direct answers of P and D, history
    end: float = 0.0  # time.monotonic() when it ended


def _error_message(response_text: str) -> str | None:
    """The message of an OpenAI error body, or None if it is not one."""
    try:
        body = json.loads(response_text)
        error = body["error"]
        if isinstance(error, dict) and isinstance(error.get("message"), str) and error["message"]:
            return error["message"]
    except (ValueError, KeyError, TypeError):
        pass
    return None


def send(client: httpx.Client, base_url: str, spec: Spec, request_timeout: float) -> Result:
    path, body = request_body(spec.kind, spec.prompt, spec.max_tokens, spec.stream)
    if spec.include_usage:
        body["stream_options"] = {"include_usage": True}
    headers = {"X-Request-Id": spec.request_id}
    t0 = time.monotonic()
    read_timeout = spec.abort_delay if spec.abort == "delay" else request_timeout
    timeout = httpx.Timeout(connect=10.0, read=read_timeout, write=10.0, pool=10.0)

    def result(outcome: str, detail: str = "", **kw: Any) -> Result:
        now = time.monotonic()
        return Result(outcome, spec, now - t0, detail, end=now, **kw)

    try:
        if not spec.stream:
            try:
                r = client.post(base_url + path, json=body, timeout=timeout, headers=headers)
            except httpx.ReadTimeout:
                return result("aborted" if spec.abort == "delay" else "timeout", "no answer in time")
            if r.status_code != 200:
                message = _error_message(r.text)
                if message is None:
                    return result("unclean", f"HTTP {r.status_code} without an OpenAI error body: {r.text[:200]}")
                return result("clean_error", f"HTTP {r.status_code}: {message}")
            choice = r.json()["choices"][0]
            text = choice["text"] if spec.kind == "completion" else (choice["message"]["content"] or "")
            return result("ok", token_ids=list(choice.get("token_ids") or []), text=text,
                          finish_reason=choice.get("finish_reason") or "")
        return _send_stream(client, base_url + path, body, timeout, headers, spec, result)
    except httpx.TimeoutException as exc:
        if spec.abort == "delay":
            return result("aborted", "timed out at the abort delay")
        return result("timeout", f"{type(exc).__name__}: {exc}")
    except httpx.HTTPError as exc:
        return result("unclean", f"{type(exc).__name__}: {exc}")


def _send_stream(client: httpx.Client, url: str, body: dict, timeout: httpx.Timeout, headers: dict[str, str],
                 spec: Spec, result) -> Result:
    t0 = time.monotonic()
    deadline = t0 + spec.abort_delay if spec.abort == "delay" else float("inf")
    with client.stream("POST", url, json=body, timeout=timeout, headers=headers) as r:
        if r.status_code != 200:
            raw = r.read().decode(errors="replace")
            message = _error_message(raw)
            if message is None:
                return result("unclean", f"HTTP {r.status_code} without an OpenAI error body: {raw[:200]}")
            return result("clean_error", f"HTTP {r.status_code}: {message}")
        text: list[str] = []
        token_ids: list[int] = []
        finish_reason = ""
        chunks = 0
        done = False
        try:
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    done = True
                    break
                try:
                    event = json.loads(data)
                except ValueError:
                    return result("unclean", f"undecodable SSE event: {data[:200]}")
                if "error" in event:
                    message = (event["error"] or {}).get("message") if isinstance(event["error"], dict) else None
                    if not message:
                        return result("unclean", f"SSE error event without a message: {data[:200]}")
                    return result("clean_error", f"SSE error after {chunks} chunks: {message}")
                chunks += 1
                for choice in event.get("choices") or []:
                    if spec.kind == "completion":
                        text.append(choice.get("text") or "")
                    else:
                        text.append((choice.get("delta") or {}).get("content") or "")
                    token_ids.extend(choice.get("token_ids") or [])
                    finish_reason = choice.get("finish_reason") or finish_reason
                if spec.abort == "first_chunk" or time.monotonic() >= deadline:
                    return result("aborted", f"closed after {chunks} chunks")  # leaving the block closes it
        except httpx.ReadTimeout:
            if spec.abort == "delay":
                return result("aborted", f"closed after {chunks} chunks (delay)")
            raise
        if not done:
            return result("unclean", f"stream ended without [DONE] or an error event after {chunks} chunks")
        return result("ok", token_ids=token_ids, text="".join(text), finish_reason=finish_reason)


def _text_agrees(text: str, ref: Reference, full: bool) -> bool:
    """The answer's text is the reference's (all of it), or a prefix of it (a partial character at the cut-off end
    may come out as U+FFFD)."""
    if full:
        return text == ref.text
    return ref.text.startswith(text.rstrip("\ufffd"))


def _is_subsequence(short: list[int], long: list[int]) -> bool:
    it = iter(long)
    return all(any(x == y for y in it) for x in short)


def check(res: Result, ref: Reference, near_tie: float) -> Result:
    """Compare a 200 answer with C's; sets outcome to completed / wrong / near_tie.

    Plain answers: token ids must equal C's first max_tokens ids (fewer if C stopped at EOS), and the text agree.
    Streams: the concatenated text must agree (the brief's rule). pdserve's streams leave out the ids of tokens that
    add no text yet (a partial UTF-8 character): those gaps are counted apart (`stream_ids_missing`) as long as the
    streamed ids are an in-order subsequence of the expected ones; any other id difference is a wrong answer."""
    n = res.spec.max_tokens
    expected = ref.token_ids[:n]
    full = len(expected) == len(ref.token_ids)
    got = res.token_ids
    if res.spec.stream:
        if not _text_agrees(res.text, ref, full):
            res.outcome = "wrong"
            res.detail = f"streamed text {res.text!r} differs from the reference {ref.text[:400]!r}"
        elif got == expected:
            res.outcome = "completed"
        elif _is_subsequence(got, expected) and len(got) < len(expected):
            res.outcome = "completed"
            res.ids_missing = len(expected) - len(got)
        else:
            res.outcome = "wrong"
            res.detail = f"streamed text agrees but streamed ids {got} are not a subsequence of {expected}"
        return res
    if got == expected:
        if _text_agrees(res.text, ref, full):
            res.outcome = "completed"
        else:
            res.outcome = "wrong"
            res.detail = f"token ids agree but text differs: {res.text!r} vs reference {ref.text!r}"
        return res
    i = next((k for k, (a, b) in enumerate(zip(got, expected)) if a != b), min(len(got), len(expected)))
    gap = ref.gaps[i] if i < len(ref.gaps) else None
    if i < len(got) and i < len(expected) and gap is not None and gap < near_tie:
        res.outcome = "near_tie"
        res.detail = f"first difference at token {i} where the reference's top-2 gap is {gap:.2e}"
    else:
        res.outcome = "wrong"
        res.detail = (f"first difference at token {i} (reference top-2 gap {gap}); got {len(got)} tokens {got}, "
                      f"expected {len(expected)} {expected} (reference finish {ref.finish_reason})")
    return res


# ----------------------------------------------------------------------------- the run


class Stats:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.outcomes: Counter[str] = Counter()
        self.by_protocol: dict[str, Counter[str]] = {}
        self.by_shape: Counter[str] = Counter()
        self.clean_errors: Counter[str] = Counter()
        self.problems: list[dict[str, Any]] = []  # wrong, unclean, timeout, near-tie details
        self.timeline: list[tuple] = []  # every request: id, protocol, kind, stream, abort, outcome, start, end
        self.latencies: list[float] = []
        self.clean_error_examples: list[str] = []
        self.stream_ids_missing = 0  # streams whose text was right but that left out some token ids
        self.stream_ids_missing_tokens = 0
        self.window_end = float("inf")  # results that end after this are the tail (not in the rate)
        self.in_window: Counter[str] = Counter()

    def add(self, res: Result) -> None:
        spec = res.spec
        with self.lock:
            self.outcomes[res.outcome] += 1
            if len(self.timeline) < 50_000:
                self.timeline.append((spec.request_id, spec.protocol, spec.kind, spec.stream, spec.abort,
                                      res.outcome, spec.prompt_len, spec.max_tokens,
                                      round(res.end - res.latency, 3), round(res.end, 3)))
            if res.end <= self.window_end:
                self.in_window[res.outcome] += 1
            if res.ids_missing:
                self.stream_ids_missing += 1
                self.stream_ids_missing_tokens += res.ids_missing
            self.by_protocol.setdefault(spec.protocol, Counter())[res.outcome] += 1
            self.by_shape[f"{spec.kind}/{'stream' if spec.stream else 'plain'}"] += 1
            if res.outcome == "clean_error":
                self.clean_errors[_bucket(res.detail)] += 1
                if len(self.clean_error_examples) < 50:
                    self.clean_error_examples.append(f"{spec.request_id} {spec.protocol} {spec.kind} "
                                                     f"{'stream' if spec.stream else 'plain'}: {res.detail}")
            if res.outcome in ("wrong", "unclean", "timeout", "near_tie", "no_reference") and len(self.problems) < 200:
                self.problems.append({"outcome": res.outcome, "detail": res.detail, "request_id": spec.request_id,
                                      "protocol": spec.protocol,
                                      "kind": spec.kind, "stream": spec.stream, "max_tokens": spec.max_tokens,
                                      "prompt_len": spec.prompt_len, "abort": spec.abort,
                                      "prompt": list(spec.prompt) if spec.kind == "completion" else spec.prompt,
                                      "latency_s": round(res.latency, 3), "diagnosis": res.diagnosis})
            if res.outcome == "completed":
                self.latencies.append(res.latency)


def _bucket(detail: str) -> str:
    """Group error messages by their shape: digits and ids dropped, first 120 characters."""
    out = []
    for word in detail.split():
        out.append("#" if any(c.isdigit() for c in word) and len(word) > 2 else word)
    return " ".join(out)[:120]


def client_loop(index: int, args: argparse.Namespace, workload: Workload, gateways: dict[str, str],
                refs: References, stats: Stats, stop: threading.Event, budget: list[int] | None) -> None:
    rng = random.Random(args.seed * 1000 + index)
    with httpx.Client(limits=httpx.Limits(max_connections=4, max_keepalive_connections=2)) as client:
        while not stop.is_set():
            if budget is not None:
                with stats.lock:
                    if budget[0] <= 0:
                        return
                    budget[0] -= 1
            spec = workload.draw(rng)
            res = send(client, gateways[spec.protocol], spec, args.request_timeout)
            if res.outcome == "ok":
                ref = refs.get(client, spec.ref_key)
                if ref is None:
                    res.outcome, res.detail = "no_reference", "the colocated instance gave no answer"
                else:
                    check(res, ref, args.near_tie)
                    if res.outcome == "wrong":
                        res.diagnosis = diagnose(client, workload, gateways, spec, ref)
            earlier = workload.remember(res)
            if res.outcome == "wrong":
                res.diagnosis["earlier_requests_with_this_prompt"] = earlier
            stats.add(res)


def diagnose(client: httpx.Client, workload: Workload, gateways: dict[str, str], spec: Spec, ref: Reference
             ) -> dict[str, Any]:
    """After a wrong answer: the same prompt (plain, max_tokens 32) asked directly of P and D, and again through
    the same gateway, each compared with C's answer, to tell which instance's state is bad."""
    out: dict[str, Any] = {"reference_token_ids": ref.token_ids}
    path, body = request_body(spec.kind, spec.prompt, REF_MAX_TOKENS, False)
    targets = {**workload.probe_urls, f"gateway-{spec.protocol}-again": gateways[spec.protocol]}
    for name, url in targets.items():
        try:
            r = client.post(url + path, json=body, timeout=60)
            if r.status_code != 200:
                out[name] = f"HTTP {r.status_code}: {r.text[:200]}"
                continue
            choice = r.json()["choices"][0]
            ids = choice["token_ids"]
            cached = ((r.json().get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
            out[name] = {"agrees": ids == ref.token_ids, "cached_tokens": cached,
                         "first_difference": next((k for k, (a, b) in enumerate(zip(ids, ref.token_ids)) if a != b),
                                                  None), "token_ids": ids}
        except httpx.HTTPError as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
    return out


def run_load(args: argparse.Namespace, workload: Workload, gateways: dict[str, str], refs: References,
             seconds: float | None, requests: int | None, seed_offset: int) -> tuple[Stats, float]:
    stats = Stats()
    stop = threading.Event()
    budget = [requests] if requests is not None else None
    threads = [threading.Thread(target=client_loop, daemon=True, name=f"client-{i}",
                                args=(seed_offset + i, args, workload, gateways, refs, stats, stop, budget))
               for i in range(args.concurrency)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    if seconds is not None:
        end = t0 + seconds
        while time.monotonic() < end and any(t.is_alive() for t in threads):
            time.sleep(min(1.0, max(end - time.monotonic(), 0.0)))
            if args.progress and seconds >= 60:
                _progress(stats, t0, seconds)
        stats.window_end = time.monotonic()
        stop.set()
    deadline = time.monotonic() + args.request_timeout + 30
    for t in threads:
        t.join(max(deadline - time.monotonic(), 0.1))
    stuck = [t.name for t in threads if t.is_alive()]
    if stuck:
        print(f"WARNING: client threads still running after the load stopped: {stuck}", flush=True)
        with stats.lock:
            stats.outcomes["stuck_client_threads"] += len(stuck)
    return stats, time.monotonic() - t0


_last_progress = [0.0]


def _progress(stats: Stats, t0: float, seconds: float) -> None:
    now = time.monotonic()
    if now - _last_progress[0] < 60:
        return
    _last_progress[0] = now
    with stats.lock:
        o = dict(stats.outcomes)
    print(f"  [{now - t0:5.0f}/{seconds:.0f} s] {o}", flush=True)


class RssSampler(threading.Thread):
    """VmRSS of every process, and what P and D hold, every `interval` seconds (for the peak and the trend)."""

    def __init__(self, procs: dict[str, int], interval: float, instances: dict[str, str] | None = None) -> None:
        super().__init__(daemon=True, name="rss")
        self.procs = procs
        self.interval = interval
        self.instances = instances or {}
        self.samples: dict[str, list[tuple[float, float]]] = {name: [] for name in procs}
        self.held: list[dict[str, Any]] = []  # [{"t", "P": {gauge: value}, "D": {...}}]
        self.halt = threading.Event()
        self.t0 = time.monotonic()

    def sample(self) -> None:
        now = time.monotonic() - self.t0
        for name, pid in self.procs.items():
            rss = proc_status(pid).get("VmRSS")
            if rss is not None:
                self.samples[name].append((now, rss))
        reading: dict[str, Any] = {"t": round(now, 1)}
        for name, url in self.instances.items():
            try:
                m = metric_values(url)
                reading[name] = {k.split(":", 1)[1]: m.get(k, 0.0) for k in
                                 ("pdserve:kv_blocks_in_use", "pdserve:num_requests_held", "pdserve:kv_leases_held",
                                  "vllm:num_requests_running", "vllm:num_requests_waiting")}
            except httpx.HTTPError:
                reading[name] = None
        if self.instances:
            self.held.append(reading)

    def run(self) -> None:
        while not self.halt.wait(self.interval):
            self.sample()


def wait_drained(instances: dict[str, Process], gateways: dict[str, Process], timeout: float
                 ) -> tuple[bool, float, dict[str, dict[str, float]]]:
    """Poll until nothing is held anywhere, or the deadline; returns (drained, seconds, last readings)."""
    t0 = time.monotonic()
    deadline = t0 + timeout
    last: dict[str, dict[str, float]] = {}
    while True:
        drained = True
        watched = [(name, proc, HELD_GAUGES) for name, proc in instances.items()]
        watched += [(name, proc, ("pdserve:gateway_in_flight",)) for name, proc in gateways.items()]
        for name, proc, gauges in watched:
            try:
                m = metric_values(proc.url)
            except httpx.HTTPError as exc:
                last[name] = {"error": str(exc)}  # type: ignore[dict-item]
                drained = False
                continue
            last[name] = {k: m.get(k, 0.0) for k in gauges}
            drained &= all(v == 0 for v in last[name].values())
        if drained or time.monotonic() >= deadline:
            return drained, time.monotonic() - t0, last
        time.sleep(0.25)


def gateway_counters(url: str) -> dict[str, dict[str, float]]:
    """The gateway's request outcomes, retries, leg failures, cancellations and KV releases (by label)."""
    out: dict[str, dict[str, float]] = {}
    wanted = {"pdserve:gateway_requests_total": "outcome", "pdserve:gateway_retries_total": "reason",
              "pdserve:gateway_leg_failures_total": "reason", "pdserve:gateway_cancellations_total": "stage",
              "pdserve:gateway_kv_releases_total": "reason"}
    for name, labels, value in metric_samples(url):
        if name in wanted:
            key = labels.get(wanted[name], "")
            if name == "pdserve:gateway_leg_failures_total":
                key = f"{labels.get('leg', '')}:{key}"
            if name == "pdserve:gateway_retries_total":
                key = f"{labels.get('leg', '')}:{key}"
            bucket = out.setdefault(name.removeprefix("pdserve:gateway_").removesuffix("_total"), {})
            bucket[key] = bucket.get(key, 0.0) + value
    return out


INSTANCE_COUNTERS = ("pdserve:kv_transfer_loads_ok_total", "pdserve:kv_transfer_loads_failed_total",
                     "pdserve:kv_blocks_invalid_total", "pdserve:kv_lease_expired_requests_total",
                     "pdserve:kv_releases_received_total", "pdserve:kv_push_done_ok_total",
                     "pdserve:kv_push_done_failed_total", "pdserve:kv_push_registration_timeouts_total",
                     "pdserve:kv_push_unregistered_expired_total", "vllm:num_preemptions_total",
                     "pdserve:prompt_tokens_computed_total", "vllm:prefix_cache_hits_total",
                     "vllm:prefix_cache_queries_total")


def instance_counters(url: str) -> dict[str, float]:
    m = metric_values(url)
    out = {}
    for key in INSTANCE_COUNTERS:
        short = key.removesuffix("_total")
        value = m.get(key, m.get(short))
        if value is not None:
            out[short.split(":", 1)[1]] = value
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of load after warm-up (default 600)")
    ap.add_argument("--protocols", default=",".join(ALL_PROTOCOLS), help="gateways to start, comma-separated")
    ap.add_argument("--concurrency", type=int, default=8, help="client threads (default 8)")
    ap.add_argument("--fault-rate", type=float, default=1.0,
                    help=f"scales the injected fault probabilities {BASE_FAULTS} on P and D (0: no faults)")
    ap.add_argument("--abort-fraction", type=float, default=0.1, help="share of requests the client abandons")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", type=Path, default=None, help="model folder (default: make a tiny qwen3 in a temp dir)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per instance (default 1)")
    ap.add_argument("--num-kv-blocks", type=int, default=2048)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--lease-s", type=float, default=5.0, help="kv_lease_duration on P and D")
    ap.add_argument("--message-timeout", type=float, default=2.0)
    ap.add_argument("--push-registration-timeout", type=float, default=10.0)
    ap.add_argument("--kv-load-timeout", type=float, default=20.0)
    ap.add_argument("--request-timeout", type=float, default=120.0,
                    help="client read timeout: a request with no byte for this long counts as a hang")
    ap.add_argument("--warmup", type=int, default=24, help="requests sent before the first RSS sample")
    ap.add_argument("--drain-timeout", type=float, default=60.0)
    ap.add_argument("--near-tie", type=float, default=1e-3,
                    help="reference top-2 logprob gap under which a divergence is a near tie, not a wrong answer")
    ap.add_argument("--rss-interval", type=float, default=10.0)
    ap.add_argument("--max-rss-growth", type=float, default=0.25,
                    help="fail if an instance's RSS grows by more than this fraction from warm-up to the end")
    ap.add_argument("--no-progress", dest="progress", action="store_false")
    ap.add_argument("--faults", type=json.loads, default=None,
                    help="JSON fault probabilities replacing the base mix (still scaled by --fault-rate)")
    ap.add_argument("--log-level", default="warning", help="of every pdserve process")
    ap.add_argument("--log-dir", type=Path, default=None, help="copy every process's log here at the end")
    ap.add_argument("--json", type=Path, default=None, help="write the summary here")
    args = ap.parse_args(argv)

    protocols = [p.strip() for p in args.protocols.split(",") if p.strip()]
    bad = set(protocols) - set(ALL_PROTOCOLS)
    if bad or not protocols:
        ap.error(f"unknown protocols {sorted(bad)}; choose from {ALL_PROTOCOLS}")

    procs: dict[str, Process] = {}
    tmp = tempfile.TemporaryDirectory(prefix="pdserve-soak-")
    try:
        return _run(args, protocols, procs, Path(tmp.name))
    finally:
        if args.log_dir is not None:
            args.log_dir.mkdir(parents=True, exist_ok=True)
            for name, proc in procs.items():
                try:
                    (args.log_dir / f"{name}.log").write_bytes(proc.log_path.read_bytes())
                except OSError:
                    pass
        for name, proc in reversed(list(procs.items())):  # gateways first, then instances; by PID
            try:
                proc.stop()
            except Exception as exc:  # noqa: BLE001 - keep stopping the others
                print(f"stopping {name} (pid {proc.pid}) failed: {exc}", file=sys.stderr)
        tmp.cleanup()


def _run(args: argparse.Namespace, protocols: list[str], procs: dict[str, Process], tmp: Path) -> int:
    t_setup = time.monotonic()
    if args.model is None:
        from pdserve.modelgen import make_text_model

        model = make_text_model("qwen3", tmp / "tiny-qwen3", preset="tiny")
    else:
        model = args.model
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))

    def decode_text(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True)

    faults_p = {"seed": args.seed * 2 + 1, "message_delay_s": MESSAGE_DELAY_S,
                **{k: v if k.endswith("_s") else v * args.fault_rate
                   for k, v in (args.faults if args.faults is not None else BASE_FAULTS).items()}}
    faults_d = {**faults_p, "seed": args.seed * 2 + 2}
    base_extra = {"kv_lease_duration": args.lease_s, "message_timeout": args.message_timeout,
                  "push_registration_timeout": args.push_registration_timeout,
                  "kv_load_timeout": args.kv_load_timeout}
    common = ["--served-model-name", MODEL_NAME, "--max-model-len", str(args.max_model_len),
              "--num-kv-blocks", str(args.num_kv_blocks), "--threads", str(args.threads), "--log-level", args.log_level,
              "--seed", "0"]
    fault_extra_p = {"fault_injection": faults_p} if args.fault_rate > 0 else {}
    fault_extra_d = {"fault_injection": faults_d} if args.fault_rate > 0 else {}
    # `--threads` sizes each instance's OpenMP pool as it starts (no OMP_NUM_THREADS, which a fork server could not
    # give a child: the suite's then spawns these three afresh, ~10 CPU-s each).
    procs["P"] = start_instance(model, *common, "--kv-transfer-config",
                                kv_config("kv_producer", {**base_extra, **fault_extra_p}), name="P")
    procs["D"] = start_instance(model, *common, "--kv-transfer-config",
                                kv_config("kv_consumer", {**base_extra, **fault_extra_d}), name="D")
    procs["C"] = start_instance(model, *common, name="C")
    for protocol in protocols:
        procs[f"gw-{protocol}"] = start("gateway", ["gateway", "--prefill", procs["P"].url, "--decode",
                                                    procs["D"].url, "--protocol", protocol, "--host", "127.0.0.1",
                                                    "--port", "0", "--log-level", args.log_level])
    gateways = {p: procs[f"gw-{p}"].url for p in protocols}
    print(f"started in {time.monotonic() - t_setup:.1f} s: "
          + ", ".join(f"{n} pid {p.pid} :{p.port}" for n, p in procs.items()), flush=True)
    print(f"faults on P and D (x{args.fault_rate:g}): "
          f"{json.dumps({k: v for k, v in faults_p.items() if k != 'seed'}) if args.fault_rate > 0 else 'none'}",
          flush=True)

    workload = Workload(args, protocols, decode_text)
    workload.probe_urls = {"P-direct": procs["P"].url, "D-direct": procs["D"].url}
    refs = References(procs["C"].url, args.request_timeout)

    # Warm-up: every gateway, both endpoints, before the first RSS sample.
    warm, _ = run_load(args, workload, gateways, refs, None, args.warmup, seed_offset=10_000)
    print(f"warm-up: {dict(warm.outcomes)}", flush=True)
    pids = {name: proc.pid for name, proc in procs.items()}
    pids["client"] = os.getpid()
    rss_start = {name: proc_status(pid) for name, pid in pids.items()}
    sampler = RssSampler(pids, args.rss_interval, {n: procs[n].url for n in ("P", "D")})
    sampler.sample()
    sampler.start()
    counters_start = {n: instance_counters(procs[n].url) for n in ("P", "D", "C")}

    print(f"load: {args.duration:g} s, {args.concurrency} clients, protocols {protocols}", flush=True)
    stats, load_s = run_load(args, workload, gateways, refs, args.duration, None, seed_offset=0)

    drained, drain_s, held = wait_drained({n: procs[n] for n in ("P", "D", "C")},
                                          {f"gw-{p}": procs[f"gw-{p}"] for p in protocols}, args.drain_timeout)
    sampler.halt.set()
    sampler.join(5)
    sampler.sample()
    rss_end = {name: proc_status(pid) for name, pid in pids.items()}
    dead = [name for name, proc in procs.items() if not proc.alive()]

    counters_end = {n: instance_counters(procs[n].url) for n in ("P", "D", "C") if procs[n].alive()}
    gw_counters = {p: gateway_counters(procs[f"gw-{p}"].url) for p in protocols if procs[f"gw-{p}"].alive()}

    # ------------------------------------------------------------------ summary
    o = stats.outcomes
    total = sum(o.values())
    memory = {}
    for name in pids:
        s0, s1 = rss_start.get(name, {}), rss_end.get(name, {})
        samples = [v for _, v in sampler.samples.get(name, [])]
        r0, r1 = s0.get("VmRSS"), s1.get("VmRSS")
        series = sampler.samples.get(name, [])
        # The sample nearest the middle of the load: growth after it says more about a leak than warm-up does.
        mid = min(series, key=lambda tv: abs(tv[0] - args.duration / 2))[1] if series else None
        memory[name] = {
            "rss_start_mib": r0, "rss_end_mib": r1, "rss_peak_mib": max(samples) if samples else None,
            "growth_mib": (r1 - r0) if r0 is not None and r1 is not None else None,
            "growth_pct": (100.0 * (r1 - r0) / r0) if r0 and r1 is not None else None,
            "rss_mid_mib": mid,
            "growth_second_half_mib": (r1 - mid) if mid is not None and r1 is not None else None,
            "anon_start_mib": s0.get("RssAnon"), "anon_end_mib": s1.get("RssAnon"),
            "shmem_start_mib": s0.get("RssShmem"), "shmem_end_mib": s1.get("RssShmem"),
            "samples": [(round(t, 1), round(v, 1)) for t, v in sampler.samples.get(name, [])],
        }
    left = {name: {k: v for k, v in held.get(name, {}).items()} for name in held}
    held_any = not drained or any(v != 0 for reading in held.values() for v in reading.values()
                                  if isinstance(v, (int, float)))
    failures = []
    if o["wrong"]:
        failures.append(f"{o['wrong']} wrong answers")
    wo = warm.outcomes
    for bad in ("wrong", "unclean", "timeout", "no_reference"):
        if wo[bad]:
            failures.append(f"{wo[bad]} {bad} during warm-up")
    if held_any:
        failures.append("state left held after the drain deadline")
    if dead:
        failures.append(f"processes died: {dead}")
    grown = {n: round(memory[n]["growth_pct"], 1) for n in ("P", "D", "C")
             if memory[n]["growth_pct"] is not None and memory[n]["growth_pct"] > 100 * args.max_rss_growth}
    if grown:
        failures.append(f"RSS grew more than {100 * args.max_rss_growth:g} % after warm-up: {grown} (%)")
    for bad in ("unclean", "timeout", "no_reference", "stuck_client_threads"):
        if o[bad]:
            failures.append(f"{o[bad]} {bad}")
    summary = {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "protocols": protocols,
        "faults_p": faults_p if args.fault_rate > 0 else None,
        "faults_d": faults_d if args.fault_rate > 0 else None,
        "load_seconds": load_s,
        "requests": total,
        "requests_per_s": sum(stats.in_window.values()) / args.duration,
        "completed": o["completed"],
        "completed_per_s": stats.in_window["completed"] / args.duration,
        "stream_ids_missing": {"requests": stats.stream_ids_missing, "tokens": stats.stream_ids_missing_tokens},
        "clean_errors": o["clean_error"],
        "wrong": o["wrong"],
        "near_ties": o["near_tie"],
        "aborted": o["aborted"],
        "unclean": o["unclean"],
        "timeouts": o["timeout"],
        "no_reference": o["no_reference"],
        "outcomes": dict(o),
        "warmup_outcomes": dict(wo),
        "by_protocol": {p: dict(c) for p, c in stats.by_protocol.items()},
        "by_shape": dict(stats.by_shape),
        "clean_error_kinds": dict(stats.clean_errors.most_common(20)),
        "clean_error_examples": stats.clean_error_examples,
        "latency_completed_s": ({"median": statistics.median(stats.latencies),
                                 "p90": sorted(stats.latencies)[int(0.9 * (len(stats.latencies) - 1))],
                                 "max": max(stats.latencies)} if stats.latencies else None),
        "references_asked": refs.asked,
        "reference_errors": refs.errors[:20],
        "drained": drained,
        "drain_seconds": drain_s,
        "left_at_end": left,
        "memory": memory,
        "instance_counters": {n: {k: counters_end[n][k] - counters_start[n].get(k, 0.0) for k in counters_end[n]}
                              for n in counters_end},
        "gateway_counters": gw_counters,
        "dead_processes": dead,
        "held_over_time": sampler.held,
        "problems": [{**p, "phase": "warm-up"} for p in warm.problems] + stats.problems,
        "timeline_fields": ["request_id", "protocol", "kind", "stream", "abort", "outcome", "prompt_len",
                            "max_tokens", "start_monotonic", "end_monotonic"],
        "timeline": warm.timeline + stats.timeline,
        "failures": failures,
        "ok": not failures,
    }
    print_summary(summary)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(summary, indent=1, default=str))
        print(f"summary written to {args.json}")
    return 0 if not failures else 1


def print_summary(s: dict[str, Any]) -> None:
    print("\n=== soak summary ===")
    print(f"load {s['config']['duration']:g} s (+{s['load_seconds'] - s['config']['duration']:.1f} s for the last "
          f"requests to end), protocols {','.join(s['protocols'])}, "
          f"concurrency {s['config']['concurrency']}, fault rate x{s['config']['fault_rate']:g}")
    print(f"requests {s['requests']} ({s['requests_per_s']:.2f}/s in the window): completed {s['completed']} "
          f"({s['completed_per_s']:.2f}/s), clean errors {s['clean_errors']}, wrong {s['wrong']}, "
          f"aborted {s['aborted']}, near ties {s['near_ties']}, unclean {s['unclean']}, timeouts {s['timeouts']}")
    print(f"  warm-up ({s['config']['warmup']} requests, not in the figures above): "
          + ", ".join(f"{k} {v}" for k, v in sorted(s["warmup_outcomes"].items())))
    if s["stream_ids_missing"]["requests"]:
        print(f"  streams with the right text but token ids left out (pdserve stream bug): "
              f"{s['stream_ids_missing']['requests']} requests, {s['stream_ids_missing']['tokens']} ids")
    for p, c in s["by_protocol"].items():
        print(f"  {p:13s} " + ", ".join(f"{k} {v}" for k, v in sorted(c.items())))
    print("  shapes: " + ", ".join(f"{k} {v}" for k, v in sorted(s["by_shape"].items())))
    if s["latency_completed_s"]:
        lat = s["latency_completed_s"]
        print(f"  completed latency: median {lat['median']:.2f} s, p90 {lat['p90']:.2f} s, max {lat['max']:.2f} s")
    if s["clean_error_kinds"]:
        print("clean errors by kind:")
        for kind, n in s["clean_error_kinds"].items():
            print(f"  {n:5d}  {kind}")
    print(f"drained: {s['drained']} in {s['drain_seconds']:.1f} s; left at the end:")
    for name, reading in s["left_at_end"].items():
        print(f"  {name:16s} " + ", ".join(f"{k.split(':', 1)[-1]}={v:g}" if isinstance(v, (int, float))
                                          else f"{k}={v}" for k, v in reading.items()))
    held = s.get("held_over_time") or []
    if held:
        step = max(1, len(held) // 12)
        for name in ("P", "D"):
            points = [f"{h['t']:.0f}s:{h[name]['kv_blocks_in_use']:g}/{h[name]['num_requests_held']:g}"
                      for h in held[::step] if h.get(name)]
            print(f"{name} blocks in use / requests held during the load: " + " ".join(points))
    print("memory (VmRSS MiB after warm-up -> end, peak; growth):")
    for name, m in s["memory"].items():
        if m["rss_start_mib"] is None or m["rss_end_mib"] is None:
            print(f"  {name:16s} gone")
            continue
        print(f"  {name:16s} {m['rss_start_mib']:8.1f} -> {m['rss_end_mib']:8.1f} (peak {m['rss_peak_mib']:.1f}); "
              f"{m['growth_mib']:+.1f} MiB ({m['growth_pct']:+.1f} %), second half {m['growth_second_half_mib']:+.1f}"
              f"  [anon {m['anon_start_mib']:.1f} -> "
              f"{m['anon_end_mib']:.1f}, shmem {m['shmem_start_mib']:.1f} -> {m['shmem_end_mib']:.1f}]")
    print("instance counters over the load:")
    for name, c in s["instance_counters"].items():
        print(f"  {name}: " + ", ".join(f"{k}={v:g}" for k, v in c.items() if v))
    print("gateway counters:")
    for p, groups in s["gateway_counters"].items():
        print(f"  {p}: " + "; ".join(f"{g} " + ", ".join(f"{k}={v:g}" for k, v in sorted(vals.items()) if v)
                                    for g, vals in groups.items()))
    if s["reference_errors"]:
        print(f"reference errors: {s['reference_errors']}")
    for problem in s["problems"][:20]:
        print(f"PROBLEM {problem['outcome']} {problem['request_id']}: {problem['protocol']} {problem['kind']} "
              f"{'stream' if problem['stream'] else 'plain'} max_tokens={problem['max_tokens']} "
              f"prompt_len={problem['prompt_len']}: {problem['detail'][:400]}")
        diag = problem.get("diagnosis") or {}
        probes = {k: (v.get("agrees"), v.get("cached_tokens")) if isinstance(v, dict) else v
                  for k, v in diag.items() if k not in ("reference_token_ids", "earlier_requests_with_this_prompt")}
        if probes:
            earlier = diag.get("earlier_requests_with_this_prompt") or []
            print(f"    asked again (agrees with C, cached tokens): {probes}; {len(earlier)} earlier requests with "
                  f"this prompt: " + ", ".join(f"{e['request_id']} {e['protocol']} {e['outcome']}"
                                               f"{' abort=' + e['abort'] if e['abort'] else ''}" for e in earlier[-6:]))
    print("RESULT: " + ("OK" if s["ok"] else "FAIL: " + "; ".join(s["failures"])), flush=True)


if __name__ == "__main__":
    sys.exit(main())
