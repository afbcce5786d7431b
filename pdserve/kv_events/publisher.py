"""An instance's KV-event publisher, on vLLM's wire: ZMQ PUB multipart `[topic, seq, payload]` and a ROUTER that
replays buffered batches.

One publisher per instance. Event sources (the block pool, the KV store tier) `record` events as
they happen; the engine calls `end_step` after each step, which closes the step's events into one batch and puts
it on a queue: the step never waits for a socket. A thread drains the queue: it numbers each batch (an 8-byte
big-endian counter from 0, restarting with the process, which is how subscribers tell a restart), sends it and
keeps it for replay. A full queue drops the batch and counts it; subscribers then see a sequence gap and replay.

Replay, as vLLM 0.32 serves it: a DEALER sends `[b"", start_seq]`; the ROUTER answers each buffered batch from
`start_seq` on as `[b"", topic, seq, payload]`, then `[b"", b"", END_SEQ, b""]` with END_SEQ = -1 (signed).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque

import zmq

from pdserve.kv_events.config import KVEventsConfig, PublisherAddress, bind_address, binds, dial_address
from pdserve.kv_events.wire import Event, KVEventBatch, encode_batch

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
_POLL_S = 0.05  # how long the thread waits for a batch before it looks at the replay socket again
_STOP = None


class KVEventPublisher:
    def __init__(self, config: KVEventsConfig, host: str = "127.0.0.1", block_size: int | None = None,
                 store: str | None = None) -> None:
        self.config = config
        self.host = host
        self.block_size = block_size
        self.store = store  # the shared store its "STORAGE" events name, if the instance has one
        self.topic = config.topic.encode()
        self._pending: list[Event] = []
        self._pending_lock = threading.Lock()  # sources on other threads may record while a step ends
        self._queue: queue.Queue[KVEventBatch | None] = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._ctx = zmq.Context()
        self.endpoint, self._pub = self._socket(zmq.PUB, config.endpoint)
        self._pub.set_hwm(config.hwm)
        self.replay_endpoint, self._replay = (None, None) if config.replay_endpoint is None else \
            self._socket(zmq.ROUTER, config.replay_endpoint)
        if self._replay is not None:
            self._replay.setsockopt(zmq.SNDHWM, 0)  # a replay is bounded by buffer_steps; dropping its end hangs it
        self.batches = 0
        self.events = 0
        self.dropped = 0
        self.replays = 0
        self._thread = threading.Thread(target=self._run, name="pdserve-kv-events", daemon=True)
        self._thread.start()

    def _socket(self, kind: int, endpoint: str) -> tuple[str, zmq.Socket]:
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            if kind == zmq.PUB and not binds(endpoint):
                sock.connect(endpoint)  # a collector binds; this instance connects to it (vLLM's rule)
                return endpoint, sock
            sock.bind(bind_address(endpoint, self.host))
        except zmq.ZMQError as exc:
            self._ctx.destroy(linger=0)
            raise OSError(f"KV events: cannot use {endpoint}: {exc}") from exc
        return sock.getsockopt_string(zmq.LAST_ENDPOINT), sock

    def address(self) -> PublisherAddress:
        """Where a subscriber dials this publisher (a wildcard bind becomes the advertised host)."""
        replay = self.replay_endpoint and dial_address(self.replay_endpoint, self.host)
        return PublisherAddress(endpoint=dial_address(self.endpoint, self.host), replay_endpoint=replay,
                                topic=self.config.topic, block_size=self.block_size, store=self.store)

    # -- sources (any thread) ---------------------------------------------------------------------------
    def record(self, event: Event) -> None:
        """Add an event to the current step's batch."""
        with self._pending_lock:
            self._pending.append(event)

    def end_step(self) -> None:
        """Close the step's events into one batch for the thread to send. Never blocks."""
        if not self._pending:
            return
        with self._pending_lock:
            events, self._pending = self._pending, []
        self.publish(events)

    def publish(self, events: list[Event]) -> None:
        """Queue one batch now (a source outside the engine step may use this directly)."""
        try:
            self._queue.put_nowait(KVEventBatch(time.time(), events))
        except queue.Full:
            self.dropped += 1

    def stats(self) -> dict[str, float]:
        return {"counter pdserve:kv_events_batches_published": self.batches,
                "counter pdserve:kv_events_published": self.events,
                "counter pdserve:kv_events_batches_dropped": self.dropped,
                "counter pdserve:kv_events_replays_served": self.replays}

    def close(self, timeout: float = 2.0) -> None:
        try:
            self._queue.put(_STOP, timeout=timeout)
        except queue.Full:
            pass
        self._thread.join(timeout)
        self._ctx.destroy(linger=0)

    # -- the publisher thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        seq = 0
        while True:
            if self._replay is not None:
                self._serve_replays()
            try:
                batch = self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                continue
            if batch is _STOP:
                return
            payload = encode_batch(batch)
            try:
                self._pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload), copy=False)
            except zmq.ZMQError as exc:  # a closed context at shutdown, or an unroutable connect endpoint
                log.warning("KV event batch %d not sent: %s", seq, exc)
            self._buffer.append((seq, payload))
            seq += 1
            self.batches += 1
            self.events += len(batch.events)

    def _serve_replays(self) -> None:
        while self._replay.poll(0):
            frames = self._replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("ignoring a malformed replay request (%d frames)", len(frames))
                continue
            client, _, start = frames
            start_seq = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= start_seq:
                    self._replay.send_multipart((client, b"", self.topic, seq.to_bytes(8, "big"), payload))
            self._replay.send_multipart((client, b"", b"", END_SEQ, b""))
            self.replays += 1
