"""One client request across its legs: the leg-aware state machine.

    CREATED -> PREFILL_SENT -> KV_HELD -> DECODE_SENT -> STREAMING -> DONE

(failure and cancellation can end any stage; the metrics label them with the stage they ended.)

A leg that fails before the client saw a byte may be retried (fresh pair, fresh transfer_id). Whatever ends a
request — failure, client disconnect, deadline — cancels the live leg (closing its connection aborts it on the
instance) and, if P holds KV for a decode that will not happen, frees it at once with an explicit message.
"""

from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec

from pdserve.gateway.conditional import ConditionalDisagg
from pdserve.gateway.metrics import GatewayMetrics
from pdserve.gateway.registry import Instance, Registry
from pdserve.gateway.usage import merge_answer, merge_events
from pdserve.ids import TransferId, new_transfer_id
from pdserve.kv_events.prompt import RoutedPrompt
from pdserve.migration.wire import MARKER, MOVED_STATUS
from pdserve.net.http_client import Response, UpstreamError, UpstreamTimeout
from pdserve.telemetry.timeline import Timeline
from pdserve.telemetry.tracing import new_span_id

log = logging.getLogger(__name__)
_encode = msgspec.json.Encoder().encode


class PrefillAnswer(msgspec.Struct):
    """What the gateway reads of P's answer; the rest (the one token, its logprobs) is skipped unparsed."""

    kv_transfer_params: Any = None
    usage: dict[str, Any] | None = None


_decode_prefill = msgspec.json.Decoder(PrefillAnswer).decode


class Stage(enum.Enum):
    CREATED = "created"
    PREFILL_SENT = "prefill_sent"
    KV_HELD = "kv_held"
    DECODE_SENT = "decode_sent"
    STREAMING = "streaming"
    DONE = "done"


@dataclass(frozen=True, slots=True)
class Deadlines:
    connect_s: float = 3.0
    prefill_s: float = 300.0  # P's whole answer
    first_token_s: float = 300.0  # D's first byte
    idle_s: float = 60.0  # between two chunks of D's answer


# LegError.reason of a leg whose instance refused the kv_transfer_params the gateway gave it.
KV_PARAMS_REFUSED = "kv_params_refused"


class LegError(Exception):
    """A leg failed. `retryable` says whether another pair could succeed; `status`/`body` are passed to the
    client when the instance's own answer is the clearest error (e.g. a 400 about the prompt)."""

    def __init__(self, leg: str, reason: str, message: str, *, status: int = 502, body: bytes | None = None,
                 retryable: bool = True, instance: Instance | None = None) -> None:
        super().__init__(message)
        self.leg = leg
        self.reason = reason
        self.status = status
        self.body = body
        self.retryable = retryable
        self.instance = instance


class GatewayHandle(Protocol):
    """What a call and its forwarder need from the gateway that owns them. A protocol rather than the
    `Gateway` class so that the gateway can import calls and forwarders without them importing it back."""

    deadlines: Deadlines
    scheduling: str
    registry: Registry
    metrics: GatewayMetrics
    conditional: ConditionalDisagg

    wants_prompt: bool  # whether picking needs the prompt's token ids
    wants_affinity: bool  # whether picking reads the prompt's prefix

    def pick(self, role: str, excluded: set[str], affinity: bytes, partner: Instance | None = None,
             prompt: RoutedPrompt | None = None) -> Instance: ...

    def prompt_of(self, body: dict[str, Any]) -> RoutedPrompt: ...

    def release_kv(self, instance: Instance, params: dict[str, Any], transfer_id: TransferId) -> None: ...

    def release_transfer(self, instance: Instance, transfer_id: TransferId) -> None: ...

    @property
    def splicer(self) -> Any: ...


@dataclass(eq=False, slots=True)
class Call:
    gateway: GatewayHandle
    path: str
    body: dict[str, Any]
    request_id: str
    send: Any  # the ASGI send callable
    stream: bool
    started: float = field(default_factory=time.monotonic)
    stage: Stage = Stage.CREATED
    attempt: int = 0
    transfer_id: TransferId = TransferId("")  # each attempt mints its own (new_attempt)
    first_byte_sent: bool = False
    excluded: set[str] = field(default_factory=set)
    picks: dict[str, Instance] = field(default_factory=dict)
    held: tuple[Instance, dict[str, Any]] | None = None  # P's KV awaiting D's admission
    prefill_usage: dict[str, Any] | None = None
    timings: dict[str, float] = field(default_factory=dict)
    timeline: Timeline | None = None  # legs' start, first byte and end, for /v1/timeline and traces
    prompt: RoutedPrompt | None = None  # token ids and their keys, for policies that route by them
    without_kv: bool = False  # an instance refused the gateway's KV parameters: D computes the prompt itself
    _counted: list[Instance] = field(default_factory=list)
    # kv_aware's load, per instance this attempt sent a leg to: [prefill tokens until its first token, KV tokens]
    _busy: dict[Instance, list[int]] = field(default_factory=dict)
    _upstream: list[Response] = field(default_factory=list)
    _leg_spans: dict[str, int] = field(default_factory=dict)  # tracing: the open span of each leg

    # -- attempts -------------------------------------------------------------------------------------------
    def new_attempt(self) -> None:
        self.attempt += 1
        self.transfer_id = new_transfer_id()
        if self.timeline is not None:
            self.timeline.transfer_id = self.transfer_id
            self.timeline.add("attempt", attempt=self.attempt, transfer_id=self.transfer_id)
        self.picks = {}
        self.held = None
        self.prefill_usage = None
        self.stage = Stage.CREATED

    def end_attempt(self) -> None:
        """Cancel whatever is still live and give back everything this attempt took (idempotent)."""
        for response in self._upstream:
            response.abort()
        self._upstream.clear()
        for instance in self._counted:
            instance.in_flight -= 1
            self._give_back(instance)
        self._counted.clear()
        if self.held is not None:
            instance, params = self.held
            self.held = None
            self.gateway.release_kv(instance, params, self.transfer_id)

    # -- picking --------------------------------------------------------------------------------------------
    def pick(self, role: str, partner: Instance | None = None) -> Instance:
        """An instance for `role`; `partner`: the other half of the pair, which it must be able to talk to."""
        prompt = self.routed_prompt() if self.gateway.wants_prompt else None
        affinity = self.affinity() if self.gateway.wants_affinity else b""
        instance = self.gateway.pick(role, self.excluded, affinity, partner, prompt)
        self.picks[role] = instance
        return instance

    def routed_prompt(self) -> RoutedPrompt:
        """The prompt's token ids, tokenized once per request."""
        if self.prompt is None:
            self.prompt = self.gateway.prompt_of(self.body)
        return self.prompt

    # -- kv_aware's load: what this request makes an instance do -----------------------------------------
    def _take(self, instance: Instance) -> None:
        """A leg goes to `instance`: the prompt tokens it does not hold are prefill work until the first token;
        those and the output are KV it keeps while the leg lasts."""
        prompt = self.prompt
        if prompt is None or not prompt.routable:
            return
        uncached = prompt.num_tokens - int(prompt.cached.get(instance.url, 0))
        load = [uncached, uncached + _max_tokens(self.body)]
        instance.pending_tokens += load[0]
        instance.active_tokens += load[1]
        held = self._busy.setdefault(instance, [0, 0])
        held[0] += load[0]
        held[1] += load[1]

    def _prefilled(self, instance: Instance) -> None:
        held = self._busy.get(instance)
        if held is not None and held[0]:
            instance.pending_tokens -= held[0]
            held[0] = 0

    def _give_back(self, instance: Instance) -> None:
        held = self._busy.pop(instance, None)
        if held is not None:
            instance.pending_tokens -= held[0]
            instance.active_tokens -= held[1]

    def affinity(self) -> bytes:
        prompt = self.body.get("prompt")
        if prompt is None:
            prompt = self.body.get("messages")
        return _encode(prompt)[:256] if prompt is not None else b""

    # -- legs -----------------------------------------------------------------------------------------------
    async def call_prefill(self, leg: str, instance: Instance, body: dict[str, Any], timeout: float
                           ) -> PrefillAnswer:
        """A prefill leg: its whole answer, of which the gateway reads only the KV parameters and the usage."""
        response = await self._send(leg, instance, body, timeout)
        try:
            raw = await response.read(timeout)
        except (UpstreamError, UpstreamTimeout) as exc:
            raise self._leg_error(leg, instance, exc) from exc
        finally:
            self._forget(response, instance)
            self.leg_ended(leg, instance, response.status)
        if response.status != 200:
            raise self._status_error(leg, instance, response.status, raw)
        try:
            return _decode_prefill(raw)
        except msgspec.DecodeError as exc:  # ValidationError included: an answer that is no JSON object
            raise LegError(leg, "bad_response", f"{leg} instance answered invalid JSON ({exc})",
                           instance=instance) from exc

    async def relay(self, leg: str, instance: Instance, body: dict[str, Any]) -> None:
        """The leg whose answer goes to the client: SSE passes through as it arrives; JSON gets merged usage."""
        d = self.gateway.deadlines
        sent_at = time.monotonic()
        response = await self._send(leg, instance, body, d.first_token_s)
        try:
            if response.status != 200:
                raw = await response.read(d.first_token_s)
                if response.status != MOVED_STATUS:
                    raise self._status_error(leg, instance, response.status, raw)
                self.held = None  # D loaded P's KV long ago: the request moved on, and the marker says where
                await self.gateway.splicer.after_json(self, instance, raw)
            elif self.stream:
                self.stage = Stage.STREAMING
                await self._relay_stream(leg, instance, response, sent_at)
            else:
                self.stage = Stage.STREAMING
                raw = await response.read(d.first_token_s)
                self.held = None  # D answered: it loaded P's KV (and said read-done) or gave it up itself
                self.timings["decode_first_token"] = time.monotonic() - sent_at
                self.mark("leg_first_byte", leg=leg, url=instance.url)
                await self.respond_json(200, self.merge_usage(raw))
        except (UpstreamError, UpstreamTimeout) as exc:
            raise self._leg_error(leg, instance, exc) from exc
        finally:
            self._forget(response, instance)
            self.leg_ended(leg, instance, response.status)
        self.stage = Stage.DONE

    async def _relay_stream(self, leg: str, instance: Instance, response: Response, sent_at: float) -> None:
        await self.start_response(200, b"text/event-stream")
        framer = SSEFramer()
        async for chunk in response.chunks(self.gateway.deadlines.idle_s):
            instance.breaker.alive()  # a stream that flows is the best proof of life (health checks may lag)
            if "decode_first_token" not in self.timings:
                # D's first token means it loaded P's KV (and said read-done) or gave it up itself: from here,
                # freeing P is D's business. Before it, a D that dies after admitting the request (headers sent,
                # KV still loading) leaves P's KV to this call's release, not to the lease.
                self.held = None
                self.timings["decode_first_token"] = time.monotonic() - sent_at
                self.mark("leg_first_byte", leg=leg, url=instance.url)
                self._prefilled(instance)
            events = framer.feed(chunk)
            if events:
                await self.write(self.rewrite_usage(events))
        rest = framer.flush()
        if rest:
            if rest.startswith(MARKER):  # no [DONE]: the request moved on, and the marker says where
                await self.gateway.splicer.after_stream(self, instance, rest)
                return
            await self.write(rest)
        await self.finish()

    async def _send(self, leg: str, instance: Instance, body: dict[str, Any], header_timeout: float) -> Response:
        instance.in_flight += 1
        self._take(instance)
        self._counted.append(instance)
        headers = [(b"content-type", b"application/json"), (b"x-request-id", self.request_id.encode()),
                   *self.leg_started(leg, instance)]
        try:
            response = await instance.pool.request("POST", self.path, _encode(body), headers,
                                                   connect_timeout=self.gateway.deadlines.connect_s,
                                                   header_timeout=header_timeout)
        except (UpstreamError, UpstreamTimeout) as exc:
            self._uncount(instance)
            self.leg_ended(leg, instance, 0)
            raise self._leg_error(leg, instance, exc) from exc
        if response.status < 500:
            instance.breaker.alive()
        self._upstream.append(response)
        return response

    def mark(self, event: str, **attrs: Any) -> None:
        if self.timeline is not None:
            self.timeline.record(event, attrs)

    def leg_started(self, leg: str, instance: Instance, key: str | None = None) -> list[tuple[bytes, bytes]]:
        """Record a leg's start; when tracing, give it a span and the `traceparent` header that names it.

        `key` tells apart legs of one kind that run at once (several images encoded in parallel).
        """
        timeline = self.timeline
        trace = timeline.trace if timeline is not None else None
        if trace is None:  # tracing off: the event alone, recorded straight into the timeline
            if timeline is not None:
                timeline.record("leg_start", {"leg": leg, "url": instance.url})
            return []
        span_id = new_span_id()
        self.mark("leg_start", leg=leg, url=instance.url, span_id=span_id)
        self._leg_spans[key or leg] = span_id
        return [(b"traceparent", trace.traceparent_for(span_id).encode())]

    def leg_ended(self, leg: str, instance: Instance, status: int, key: str | None = None) -> None:
        span_id = self._leg_spans.pop(key or leg, None) if self._leg_spans else None
        if span_id is None:
            if self.timeline is not None:
                self.timeline.record("leg_end", {"leg": leg, "url": instance.url, "status": status})
        else:
            self.mark("leg_end", leg=leg, url=instance.url, status=status, span_id=span_id)

    def _forget(self, response: Response, instance: Instance) -> None:
        if response in self._upstream:
            self._upstream.remove(response)
        self._uncount(instance)

    def _uncount(self, instance: Instance) -> None:
        if instance in self._counted:
            self._counted.remove(instance)
            instance.in_flight -= 1
            self._give_back(instance)

    def _leg_error(self, leg: str, instance: Instance, exc: Exception) -> LegError:
        """The instance could not be reached, broke off or missed a deadline: that counts against it."""
        self.gateway.registry.report_failure(instance, exc)
        if isinstance(exc, UpstreamTimeout):
            return LegError(leg, "timeout", f"{leg} instance {instance.url}: {exc}", status=504, instance=instance)
        return LegError(leg, "connection", f"{leg} instance {instance.url}: {exc}", status=502, instance=instance)

    def _status_error(self, leg: str, instance: Instance, status: int, raw: bytes) -> LegError:
        if status == 401:  # the instance refused the gateway's credentials, not the client's: a gateway error
            return LegError(leg, "unauthorized", f"{leg} instance {instance.url} refused the gateway's API key "
                            "(start the gateway with the instances' key: --instance-api-key)", retryable=False,
                            instance=instance)
        if 400 <= status < 500 and b"kv_transfer_params" in raw and "kv_transfer_params" not in self.body:
            # The instance refused parameters the gateway wrote, not the client (who sent none): never its answer.
            return LegError(leg, KV_PARAMS_REFUSED, f"{leg} instance {instance.url} refused the gateway's "
                            f"kv_transfer_params ({status}: {raw[:300].decode(errors='replace')})", status=502,
                            retryable=False, instance=instance)
        # A 4xx is about the request itself: another pair would refuse it too, and its message is the answer.
        retryable = status >= 500
        reason = f"status_{status}"
        return LegError(leg, reason, f"{leg} instance {instance.url} answered {status}", status=status,
                        body=raw, retryable=retryable, instance=instance)

    # -- writing to the client ------------------------------------------------------------------------------
    async def start_response(self, status: int, content_type: bytes) -> None:
        self.first_byte_sent = True
        await self.send({"type": "http.response.start", "status": status,
                         "headers": [(b"content-type", content_type), (b"x-request-id", self.request_id.encode())]})

    async def write(self, data: bytes) -> None:
        await self.send({"type": "http.response.body", "body": data, "more_body": True})

    async def finish(self) -> None:
        await self.send({"type": "http.response.body", "body": b"", "more_body": False})

    async def respond_json(self, status: int, body: bytes) -> None:
        self.first_byte_sent = True
        await self.send({"type": "http.response.start", "status": status,
                         "headers": [(b"content-type", b"application/json"),
                                     (b"content-length", str(len(body)).encode()),  # a plain body, no chunk framing
                                     (b"x-request-id", self.request_id.encode())]})
        await self.send({"type": "http.response.body", "body": body, "more_body": False})

    # -- usage: prompt and cached tokens from P, completion tokens from D ----------------------------------
    def merge_usage(self, raw: bytes) -> bytes:
        return merge_answer(self.prefill_usage, raw)

    def rewrite_usage(self, events: bytes) -> bytes:
        return merge_events(self.prefill_usage, events)


def _max_tokens(body: dict[str, Any]) -> int:
    """The output a request may still add to an instance's KV (vLLM's default, 16, when it does not say)."""
    for key in ("max_completion_tokens", "max_tokens"):
        value = body.get(key)
        if type(value) is int and value > 0:
            return value
    return 16


class SSEFramer:
    """Splits a byte stream into whole SSE events so each can be forwarded (or patched) as soon as complete."""

    def __init__(self) -> None:
        self._partial = b""

    def feed(self, chunk: bytes) -> bytes:
        data = self._partial + chunk
        cut = data.rfind(b"\n\n")
        if cut < 0:
            self._partial = data
            return b""
        self._partial = data[cut + 2:]
        return data[:cut + 2]

    def flush(self) -> bytes:
        rest, self._partial = self._partial, b""
        return rest
