"""The gateway's side of a migration: one answer for the client, however many instances it came from.

A leg of a moving request ends with a marker (see wire.py) instead of its end. After a `Handoff` the gateway
comes back to the source for the rest (the window leg, whose every event names its token ids, so the gateway
knows exactly which tokens its client has); after a `HandedOver` it attaches to the target, which catches the
client up from there. If the source dies during the copy, the request goes on elsewhere: at the target if it took
it over already, else on any decode instance that recomputes it from its prompt and the tokens the client has
(nothing is sent twice). Requests that never move cost nothing here: markers are looked for where a leg ends.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from prometheus_client import Counter

from pdserve.gateway.call import Call, SSEFramer
from pdserve.gateway.registry import Instance
from pdserve.migration.client import ABANDON_PATH, base_url
from pdserve.migration.wire import (CONTINUE_HEADER, MARKER, MOVED_STATUS, TOKENS, Abandon, Continue, HandedOver,
                                    Handoff, Logprob, Marker, MigrationError, decode_marker, encode, with_continue)
from pdserve.net.http_client import Response, UpstreamError, UpstreamTimeout
from pdserve.server.errors import error_body

log = logging.getLogger(__name__)
_GONE = (404, 410)  # an attach to a migration the target does not have (it never completed there)


class LegLost(Exception):
    """A leg after a marker could not be had: the instance is unreachable, broke off, or refused it."""

    def __init__(self, message: str, status: int = 502, body: bytes = b"") -> None:
        super().__init__(message)
        self.status = status
        self.body = body


def takes_migrations(instance: Instance, like: Instance | None = None) -> bool:
    """A pdserve decode instance with a KV connector (and, when `like` is known, the same KV layout)."""
    caps = instance.caps
    if instance.role != "decode" or caps is None or caps.engine != "pdserve" or caps.kv_connector is None:
        return False
    other = like.caps if like is not None else None
    return other is None or (caps.kv_layout, caps.kv_block_size) == (other.kv_layout, other.kv_block_size)


class Splicer:
    def __init__(self, gateway: Any) -> None:
        self.gateway = gateway
        self.outcomes = Counter("pdserve:gateway_migrations",
                                "Legs after a migration marker, by outcome: window, attached, resumed (recomputed "
                                "elsewhere after its source was lost), failed.", ["outcome"],
                                registry=gateway.metrics.prom)
        self._background: set[asyncio.Task] = set()

    async def after_stream(self, call: Call, instance: Instance, rest: bytes) -> None:
        """A stream ended with a marker (`rest`): the client's stream goes on where it says."""
        await _Spliced(self, call, instance).run(rest[len(MARKER):])

    async def after_json(self, call: Call, instance: Instance, raw: bytes) -> None:
        """A JSON answer was a marker: the client's answer comes from where it says."""
        await _Spliced(self, call, instance).run(raw)

    def pick_target(self, source: Instance | None, exclude: Instance | None = None) -> Instance | None:
        """The least loaded decode instance, other than the source, that can take the request."""
        candidates = [i for i in self.gateway.registry.usable("decode")
                      if i is not source and i is not exclude and takes_migrations(i, source)]
        return min(candidates, key=lambda i: i.load) if candidates else None

    def instance(self, url: str) -> Instance:
        url, host, port = base_url(url)
        known = self.gateway.registry.instances.get(url)
        return known if known is not None else Instance(url=url, role="decode", pool=self.gateway.client.pool(host, port))

    def abandon(self, instance: Instance, migration_id: str, token: str, reason: str) -> None:
        """Tell an instance at once that nobody will come for a migrated request (its client left)."""
        async def send() -> None:
            try:
                response = await instance.pool.request("POST", ABANDON_PATH, encode(Abandon(
                    migration_id=migration_id, token=token, reason=reason)), connect_timeout=2.0, header_timeout=5.0)
                await response.read(5.0)
            except (UpstreamError, UpstreamTimeout) as exc:
                log.info("could not abandon migration %s at %s (%s); its deadline ends it", migration_id,
                         instance.url, exc)
        task = asyncio.get_running_loop().create_task(send())
        self._background.add(task)
        task.add_done_callback(self._background.discard)


class _Spliced:
    """One client request after its first marker: where it runs, and what its client has."""

    def __init__(self, splicer: Splicer, call: Call, source: Instance) -> None:
        self.splicer = splicer
        self.call = call
        self.source = source
        self.tokens: list[int] = []  # the outputs its client has (a stream), or all known (a JSON answer)
        self.logprobs: list[Logprob] = []
        self.cached = 0
        self.migration: tuple[str, str] = ("", "")
        self.to: Instance | None = None
        self.pending: Instance | None = None  # an instance holding the request for a leg not yet sent
        self._written = 0  # events the current leg passed to the client

    @property
    def cursor(self) -> int:
        return len(self.tokens) if self.call.stream else 0

    async def run(self, raw: bytes) -> None:
        try:
            marker = decode_marker(raw)
            while marker is not None:
                marker = await (self._window(marker) if isinstance(marker, Handoff) else self._attach(marker))
        except (LegLost, MigrationError) as exc:
            self.splicer.outcomes.labels("failed").inc()
            log.warning("request %s could not go on after its migration: %s", self.call.request_id, exc)
            await self._fail(exc if isinstance(exc, LegLost) else LegLost(str(exc), exc.status))
        except asyncio.CancelledError:
            if self.pending is not None:
                self.splicer.abandon(self.pending, *self.migration, "the client left")
            raise

    async def _window(self, handoff: Handoff) -> Marker | None:
        self.tokens, self.logprobs = list(handoff.output_token_ids), list(handoff.logprobs)
        self.cached, self.migration = handoff.num_cached_tokens, (handoff.migration_id, handoff.token)
        self.to = self.splicer.instance(handoff.to) if handoff.to else self.splicer.pick_target(self.source)
        cont = Continue(phase="window", migration_id=handoff.migration_id, token=handoff.token, cursor=self.cursor,
                        to=self.to.url if self.to is not None else None)
        self.splicer.outcomes.labels("window").inc()
        self.pending = self.source
        try:
            return await self._leg("decode_window", self.source, cont, tracked=self.call.stream)
        except LegLost as exc:
            log.warning("request %s: its source %s was lost during its migration (%s); going on elsewhere",
                        self.call.request_id, self.source.url, exc)
            return await self._recover(self.source)

    async def _attach(self, handed: HandedOver) -> Marker | None:
        target = self.splicer.instance(handed.to)
        self.migration = (handed.migration_id, handed.token)
        if handed.recompute:
            self.tokens, self.logprobs = list(handed.output_token_ids), list(handed.logprobs)
            return await self._resume(target)
        self.pending = target
        cont = Continue(phase="attach", migration_id=handed.migration_id, token=handed.token, cursor=self.cursor)
        try:
            marker = await self._leg("decode", target, cont, tracked=False)
        except LegLost as exc:
            if exc.status not in _GONE and self._written:
                raise  # the target sent part of its answer already: what the client has is unknown
            return await self._recover(target)
        self.splicer.outcomes.labels("attached").inc()
        return marker

    async def _recover(self, lost: Instance) -> Marker | None:
        """The instance running the request is gone: the target, if it took the request over, else any decode
        instance recomputing it from the tokens the client has."""
        target, self.to = self.to, None
        if target is not None and target is not lost:
            self.pending = target
            cont = Continue(phase="attach", migration_id=self.migration[0], token=self.migration[1],
                            cursor=self.cursor)
            try:
                marker = await self._leg("decode", target, cont, tracked=False)
                self.splicer.outcomes.labels("attached").inc()
                return marker
            except LegLost as exc:
                if exc.status not in _GONE:
                    log.warning("request %s: its target %s is unusable too (%s)", self.call.request_id, target.url,
                                exc)
        elsewhere = self.splicer.pick_target(lost)
        if elsewhere is None:
            raise LegLost("its instance was lost and no other decode instance can take it", 503)
        return await self._resume(elsewhere)

    async def _resume(self, target: Instance) -> Marker | None:
        self.pending = None
        # A stream's client has the logprobs of the tokens it was sent: only a JSON answer needs them again.
        logprobs = self.logprobs if len(self.logprobs) == len(self.tokens) else []
        cont = Continue(phase="resume", cursor=self.cursor, output_token_ids=self.tokens, logprobs=logprobs,
                        num_cached_tokens=self.cached)
        marker = await self._leg("decode", target, cont, tracked=False)
        self.splicer.outcomes.labels("resumed").inc()
        return marker

    # -- one leg ---------------------------------------------------------------------------------------------
    async def _leg(self, leg: str, instance: Instance, cont: Continue, tracked: bool) -> Marker | None:
        """Send the client's body with `cont` to `instance` and pass its answer on; returns the marker it ends
        with (the request moves again), or None when the client has its whole answer."""
        call, deadlines = self.call, self.call.gateway.deadlines
        headers = [(b"content-type", b"application/json"), (b"x-request-id", call.request_id.encode()),
                   (CONTINUE_HEADER, cont.phase.encode()), *call.leg_started(leg, instance)]
        status, self.source, self._written = 0, instance, 0
        try:
            response = await instance.pool.request("POST", call.path, with_continue(call.body, cont), headers,
                                                   connect_timeout=deadlines.connect_s,
                                                   header_timeout=deadlines.first_token_s)
            status = response.status
            self.pending = None
            if call.stream and status == 200:
                return await self._pump(response, instance, tracked)
            raw = await response.read(deadlines.first_token_s)
        except (UpstreamError, UpstreamTimeout) as exc:
            call.gateway.registry.report_failure(instance, exc)
            raise LegLost(f"{leg} instance {instance.url}: {exc}") from exc
        except MigrationError as exc:
            raise LegLost(str(exc)) from exc
        finally:
            call.leg_ended(leg, instance, status)
        if status == MOVED_STATUS:
            return decode_marker(raw)
        if status != 200:
            raise LegLost(f"{leg} instance {instance.url} answered {status}", status, raw)
        await call.respond_json(200, call.merge_usage(raw))
        return None

    async def _pump(self, response: Response, instance: Instance, tracked: bool) -> Marker | None:
        call = self.call
        framer = SSEFramer()
        async for chunk in response.chunks(call.gateway.deadlines.idle_s):
            instance.breaker.alive()
            events = framer.feed(chunk)
            if tracked:
                events = self._untag(events)
            if events:
                self._written += 1
                await call.write(call.rewrite_usage(events))
        rest = framer.flush()
        if rest.startswith(MARKER):
            return decode_marker(rest[len(MARKER):])
        if rest:
            await call.write(rest)
        await call.finish()
        return None

    def _untag(self, events: bytes) -> bytes:
        """Take the token ids a window leg names off its events (the client never sees them)."""
        out = []
        for event in events.split(b"\n\n")[:-1]:
            if event.startswith(TOKENS):
                line, _, event = event.partition(b"\n")
                ids = line[len(TOKENS):]
                if ids:
                    self.tokens.extend(int(t) for t in ids.split(b","))
            if event:
                out.append(event + b"\n\n")
        return b"".join(out)

    async def _fail(self, exc: LegLost) -> None:
        call = self.call
        body = exc.body if exc.body.startswith(b"{") else encode(error_body(exc.status, str(exc)))
        if call.first_byte_sent:
            await call.write(b"data: " + body + b"\n\ndata: [DONE]\n\n")
            await call.finish()
        else:
            await call.respond_json(exc.status, body)
