"""The engine behind an asyncio server: the step loop runs in one background thread.

One process, two threads: on a 2-core machine a separate engine process costs more than it saves (its
serialisation and context switches outweigh the overlap it buys). torch kernels release the GIL, so the event
loop keeps answering (health, new requests, streaming) while a step computes. Everything that mutates the engine
runs on the engine thread; the event loop only sends commands and receives outputs.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.output_processor import RequestOutput
from pdserve.engine.request import MultiModalItem, RequestStatus
from pdserve.ids import ReqId, make_internal_request_id
from pdserve.kv_transfer.params import RemoteDecode, RemotePrefill
from pdserve.sampling_params import SamplingParams
from pdserve.telemetry.timeline import Timeline

log = logging.getLogger(__name__)

# How long the loop sleeps when a step ran nothing (requests wait on transfers or leases only). Transfer events
# wake it at once (see `wake`), so this only bounds how late a missed event is noticed.
_IDLE_POLL_S = 0.005
# How long it sleeps with no request at all: every command (a new request, an abort, a free) and every transfer
# event wakes it, so this too only bounds a missed event. At 50 ms, waking twenty times a second was half of an
# idle instance's CPU (one tiny instance: 6.6 ms a second, 3.8 at 250 ms, 3.4 at 1 s).
_NO_WORK_POLL_S = 0.25


class EngineDeadError(RuntimeError):
    pass


class RequestTimeoutError(TimeoutError):
    pass


@dataclass(slots=True)
class _Add:
    request_id: ReqId
    external_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    kv_transfer_params: RemoteDecode | RemotePrefill | None
    mm_items: list[MultiModalItem] | None
    timeline: Timeline | None = None


@dataclass(slots=True)
class _Abort:
    request_id: ReqId
    status: RequestStatus = RequestStatus.FINISHED_ABORTED


@dataclass(slots=True)
class _Call:
    """Run a function on the engine thread (for connectors and admin actions) and return its result."""

    fn: Callable[[LLMEngine], Any]
    future: asyncio.Future = field(repr=False)


class AsyncEngine:
    def __init__(self, engine: LLMEngine, request_timeout_s: float = 600.0,
                 on_fatal: Callable[[BaseException], None] | None = None) -> None:
        """`on_fatal` runs on the engine thread when the engine failed outside a model step (its state may be
        half-updated); a server exits there. Without it the engine only stops and reports itself dead."""
        self.engine = engine
        self.on_fatal = on_fatal
        self.request_timeout_s = request_timeout_s
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams: dict[ReqId, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self.dead: BaseException | None = None
        self.output_listeners: list[Callable[[RequestOutput], None]] = []

    # -- lifecycle --------------------------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="pdserve-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        self._wakeup.set()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def is_healthy(self) -> bool:
        return self.dead is None and self._thread is not None and self._thread.is_alive()

    # -- requests ---------------------------------------------------------------------------------------
    def check_prompt(self, prompt_token_ids: list[int]) -> None:
        """Raise PromptError now, in the caller, so a bad prompt never reaches the loop.

        Sampling parameters are not checked here: the server validated them where it read the request.
        """
        self.engine.check_prompt(prompt_token_ids)

    def generate(self, external_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 kv_transfer_params: RemoteDecode | RemotePrefill | None = None,
                 mm_items: list[MultiModalItem] | None = None,
                 request_id: ReqId | None = None,
                 timeline: Timeline | None = None) -> AsyncIterator[RequestOutput]:
        """The request's outputs; it reaches the engine when they are first asked for."""
        rid = request_id or make_internal_request_id(external_id)
        return self._consume(rid, None, _Add(rid, external_id, prompt_token_ids, params, kv_transfer_params,
                                             mm_items, timeline))

    def open_stream(self, request_id: ReqId) -> asyncio.Queue:
        """Where the request's outputs go from now on, until a consumer `attach`es (outputs wait there)."""
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = stream
        return stream

    def close_stream(self, request_id: ReqId) -> None:
        self._streams.pop(request_id, None)

    def attach(self, request_id: ReqId) -> AsyncIterator[RequestOutput]:
        """Consume the outputs of a request whose stream was opened (or detached) before; leaving early aborts it."""
        stream = self._streams.get(request_id)
        if stream is None:
            raise KeyError(request_id)
        return self._consume(request_id, stream)

    def detach(self, request_id: ReqId, notice: RequestOutput) -> bool:
        """End the current consumer's stream with `notice` (a finished output) while the request itself runs on:
        its later outputs wait for the next `attach`. False if nobody consumes it here."""
        stream = self._streams.get(request_id)
        if stream is None:
            return False
        self.open_stream(request_id)
        stream.put_nowait(notice)
        return True

    async def _consume(self, rid: ReqId, stream: asyncio.Queue | None, add: _Add | None = None
                       ) -> AsyncIterator[RequestOutput]:
        if add is not None:
            if self.dead is not None:
                raise EngineDeadError(f"the engine stopped: {self.dead}")
            stream = self.open_stream(rid)
            self._send(add)
        finished = False
        try:
            while True:
                try:
                    item = await asyncio.wait_for(stream.get(), timeout=self.request_timeout_s)
                except TimeoutError as exc:
                    raise RequestTimeoutError(f"no progress on request {rid} for {self.request_timeout_s} s") from exc
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if self._streams.get(rid) is stream:  # not detached: nobody else will read this request
                self._streams.pop(rid)
            if not finished:  # the consumer went away (client disconnect, cancellation, timeout)
                self._send(_Abort(rid))

    def abort(self, request_id: ReqId, status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        """End a request (aborted, or another final status such as migrated); its consumer gets the last output."""
        self._send(_Abort(request_id, status))

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run `fn(engine)` between steps on the engine thread."""
        future = asyncio.get_running_loop().create_future()
        self._send(_Call(fn, future))
        return await future

    def _send(self, command: object) -> None:
        self._commands.put(command)
        self._wakeup.set()

    # -- the engine thread ------------------------------------------------------------------------------
    def wake(self) -> None:
        """Something outside the engine progressed (a transfer finished, a lease ended): step now. Thread-safe."""
        self._wakeup.set()

    def _run(self) -> None:
        try:
            self._loop_steps()
        except Exception as exc:  # noqa: BLE001 - failures inside a model step never get here (see ModelRunner)
            log.exception("engine failed")
            self.dead = exc
            self._fail_all(exc)
            self._stopping.set()
            if self.on_fatal is not None:
                self.on_fatal(exc)

    def _loop_steps(self) -> None:
        while not self._stopping.is_set():
            self._drain_commands()
            if self.engine.has_work():
                self._step()
                if not self.engine.has_ready_work():
                    # Nothing to compute: spinning would only starve the transfer threads of the GIL.
                    self._wait(_IDLE_POLL_S)
            else:
                self._wait(_NO_WORK_POLL_S)

    def _wait(self, timeout: float) -> None:
        self._wakeup.wait(timeout)
        self._wakeup.clear()

    def _step(self) -> None:
        outputs = self.engine.step()
        if outputs:
            self._deliver_threadsafe(outputs)

    def _drain_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Add):
                self._add(command)
            elif isinstance(command, _Abort):
                outputs = self.engine.abort_request(command.request_id, command.status)
                if outputs:
                    self._deliver_threadsafe(outputs)
            elif isinstance(command, _Call):
                self._run_call(command)

    def _add(self, c: _Add) -> None:
        try:
            self.engine.add_request(c.external_id, c.prompt_token_ids, c.params, c.kv_transfer_params, c.mm_items,
                                    request_id=c.request_id, timeline=c.timeline)
        except Exception as exc:  # noqa: BLE001 - reported to the one request that caused it
            self._deliver_error_threadsafe(c.request_id, exc)

    def _run_call(self, c: _Call) -> None:
        loop = self._loop
        try:
            result = c.fn(self.engine)
        except Exception as exc:  # noqa: BLE001 - handed back to the caller's future
            loop.call_soon_threadsafe(_settle, c.future, None, exc)
        else:
            loop.call_soon_threadsafe(_settle, c.future, result, None)

    def _deliver_threadsafe(self, outputs: list[RequestOutput]) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._deliver, outputs)

    def _deliver_error_threadsafe(self, rid: ReqId, exc: BaseException) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._deliver_error, rid, exc)

    def _fail_all(self, exc: BaseException) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._fail_streams, exc)

    # -- the event loop side ----------------------------------------------------------------------------
    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            for listener in self.output_listeners:
                listener(out)
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.put_nowait(out)

    def _deliver_error(self, rid: ReqId, exc: BaseException) -> None:
        stream = self._streams.get(rid)
        if stream is not None:
            stream.put_nowait(exc)

    def _fail_streams(self, exc: BaseException) -> None:
        for stream in self._streams.values():
            stream.put_nowait(EngineDeadError(f"the engine failed: {exc}"))


def _settle(future: asyncio.Future, result: Any, exc: BaseException | None) -> None:
    if future.done():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)
