"""The gateway's subscriptions: one SUB (+ a DEALER for replay) per publishing instance, feeding the prefix index.

The gateway runs them in its event loop (`attach`), and reads the live batches when it is about to read the index:
`catch_up` before each pick, and a timer (`_LOOP_TICK_S`) between picks. A thread woken for every batch (or a loop
reader woken for each) spent several times the batch's own work on being woken; read at a pick, the batches that
came since the last one are read in a turn the loop is awake for anyway, and the index is as fresh at the pick as
if each had been read on arrival. Connections and replays (rare) are read as they come. One turn reads at most
`_BUDGET` messages of a socket, so a long replay does not stall requests. Without a loop (`start`) everything runs
in a thread of its own, as the tests also drive it.

Per instance, the subscription is a small state machine:

* **connecting**: ZMQ dials (and redials) the publisher. Nothing is credited: the instance is scored by load
  alone, which is also all an unreachable publisher ever costs.
* on connect, the instance's entries are cleared and its history **replayed** from sequence 0 (what the publisher
  still buffers), then what arrived live meanwhile is applied in order; a publisher without a replay endpoint is
  taken from its next batch on.
* **live**: batches apply in sequence. A publisher that falls quiet is asked for anything after its last batch
  after `idle_replay_s` (30 s: an instance that gets work publishes, and its next batch shows any gap), on the
  replay connection the last answer came on: a loss at the end of a burst shows no gap until another batch comes.
  A gap (the publisher's high-water mark dropped some) replays from the first missing one, or, with no replay
  endpoint, clears the instance. A sequence that goes back means the engine
  restarted (or a batch came twice): the instance is cleared and replayed from 0. A replay that does not end in
  time degrades the instance (cleared, retried later). A batch that does not decode clears the instance; a message
  that is not a batch at all (foreign framing) is counted and ignored.
* a lost connection (the publisher died) drops the instance's entries at once, and the instance is asked for a
  replay after `retry_s` whether or not ZMQ reports the redial; leaving membership drops them too.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time

import zmq
from zmq.utils.monitor import recv_monitor_message

from pdserve.kv_events.config import PublisherAddress
from pdserve.kv_events.index import PrefixIndex
from pdserve.kv_events.subscription import Counters, Subscription
from pdserve.kv_events.wire import EventDecodeError, decode_batch

log = logging.getLogger(__name__)

_MAX_WAIT_S = 1.0  # the thread sleeps until a socket, a command or its next deadline; at most this long
_SWEEP_S = 1.0
_MAX_HELD = 10_000  # live batches kept while a replay runs; past it the replay starts over
_END_SEQ = -1
_BUDGET = 64  # messages read from one socket per turn; the rest in the next turn
# In a loop, live batches between picks and the deadlines are taken on this timer: a batch waits at most this long
# while no request comes (the index is read only at a pick, which reads everything first), and a deadline set
# meanwhile is seen within it. Once a second, with the sweep: a quiet gateway woke four times a second for nothing.
_LOOP_TICK_S = 1.0
# A plain int: pyzmq's flag enum would run Python code on every `&` of a socket's EVENTS with it.
_POLLIN = int(zmq.POLLIN)


class Listener:
    def __init__(self, index: PrefixIndex, replay_timeout_s: float = 5.0, retry_s: float = 2.0,
                 rcvhwm: int = 100_000, idle_replay_s: float = 30.0) -> None:
        self.index = index
        self.replay_timeout_s = replay_timeout_s
        self.retry_s = retry_s
        self.idle_replay_s = idle_replay_s
        self.rcvhwm = rcvhwm
        self._ctx = zmq.Context()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._subs: dict[str, Subscription] = {}
        self._by_socket: dict[zmq.Socket, tuple[Subscription, str]] = {}
        self._poller = zmq.Poller()
        self._live: list[tuple[zmq.Socket, int]] | None = None  # what a pick polls: every subscription's SUB
        # set_members wakes the thread through an inproc pair (the caller's end is used from one thread only).
        self._wake_rx = self._ctx.socket(zmq.PAIR)
        self._wake_rx.bind(f"inproc://kv-listener-{id(self)}")
        self._wake_tx = self._ctx.socket(zmq.PAIR)
        self._wake_tx.connect(f"inproc://kv-listener-{id(self)}")
        self._poller.register(self._wake_rx, zmq.POLLIN)
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._next_sweep = 0.0

    # -- the event loop's side ------------------------------------------------------------------------
    def start(self) -> None:
        """Run in a thread of its own."""
        self._thread = threading.Thread(target=self._run, name="pdserve-kv-index", daemon=True)
        self._thread.start()

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Run in `loop`, from its own thread (which must also call `stop` and `catch_up`)."""
        self._loop = loop
        for sock, (_, role) in list(self._by_socket.items()):
            if role != "sub":
                self._read_in_loop(sock)
        self._apply_commands()
        self._next_sweep = time.monotonic() + _SWEEP_S
        self._tick()

    def stop(self) -> None:
        self._stopping.set()
        if self._timer is not None:
            self._timer.cancel()
        self._wake()
        if self._thread is not None:
            self._thread.join(5)
        for sub in list(self._subs.values()):
            self._close(sub)
        self._ctx.destroy(linger=0)

    def catch_up(self) -> None:
        """Apply the live batches received so far (in a loop; a listener in its own thread reads them itself). One
        poll asks every subscription at once: a pick that found nothing new cost a call per instance before."""
        if self._loop is not None and not self._stopping.is_set():
            if self._live is None:
                self._live = [(sub.sub, _POLLIN) for sub in self._subs.values()]
            for sock, _ in zmq.zmq_poll(self._live, 0):
                self._read_live(self._by_socket[sock][0], ready=True)

    def set_members(self, members: dict[str, PublisherAddress]) -> None:
        """The instances that publish and where; the listener subscribes, resubscribes and drops to match."""
        self._commands.put(dict(members))
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._apply_commands)
        else:
            self._wake()

    def _wake(self) -> None:
        try:
            self._wake_tx.send(b"", zmq.NOBLOCK)
        except zmq.ZMQError:  # already woken (a full pipe) or closed
            pass

    def snapshot(self) -> dict[str, tuple[str, Counters]]:
        """Each subscription's state and counters (read by the metrics; plain values, safe across threads)."""
        return {name: (sub.state, sub.counters) for name, sub in list(self._subs.items())}

    # -- reading the sockets: in the listener's thread, or in the loop ------------------------------------
    def _run(self) -> None:
        self._next_sweep = time.monotonic() + _SWEEP_S
        while not self._stopping.is_set():
            self._apply_commands()
            wait_ms = int(self._on_time(_MAX_WAIT_S) * 1000) + 1
            for sock, _ in self._poller.poll(wait_ms):
                owner = self._by_socket.get(sock)
                if owner is not None:
                    self._dispatch(*owner, ready=True)
                elif sock is self._wake_rx:
                    while self._wake_rx.poll(0):
                        self._wake_rx.recv()

    def _on_time(self, longest: float) -> float:
        """Act on the deadlines that passed and sweep when due; the seconds until the next one (at most `longest`)."""
        now = time.monotonic()
        for sub in list(self._subs.values()):
            if sub.deadline and now >= sub.deadline:
                self._on_deadline(sub)
        if now >= self._next_sweep:
            self.index.sweep()
            self._next_sweep = now + _SWEEP_S
        wake_at = min([self._next_sweep, *(s.deadline for s in self._subs.values() if s.deadline)])
        return max(0.0, min(wake_at - time.monotonic(), longest))

    def _tick(self) -> None:
        if self._stopping.is_set():
            return
        self.catch_up()
        self._timer = self._loop.call_later(self._on_time(_LOOP_TICK_S), self._tick)

    def _read_live(self, sub: Subscription, ready: bool = False) -> None:
        if self._stopping.is_set() or self._subs.get(sub.member) is not sub:  # a pick while stopping; a member gone
            return
        if self._dispatch(sub, "sub", ready):
            self._loop.call_soon(self._read_live, sub)  # past the budget: the rest in the next turn

    def _read_in_loop(self, sock: zmq.Socket) -> None:
        """ZMQ signals a socket's descriptor on a change only (edge-triggered): a socket is read until it says
        nothing waits, and read once now for what came before it was watched."""
        self._loop.add_reader(sock.FD, self._readable, sock)
        self._loop.call_soon(self._readable, sock)

    def _readable(self, sock: zmq.Socket) -> None:
        owner = self._by_socket.get(sock)
        if owner is not None and self._dispatch(*owner):
            self._loop.call_soon(self._readable, sock)  # past the budget: the rest in the next turn

    def _dispatch(self, sub: Subscription, role: str, ready: bool = False) -> bool:
        """Read what waits on the socket, up to the budget (`ready`: a poll just saw a message); whether more may
        wait."""
        try:
            if role == "sub":
                return self._drain_live(sub, ready)
            if role == "monitor":
                self._drain_monitor(sub)
                return False
            return self._drain_replay(sub)
        except zmq.ZMQError as exc:
            log.warning("KV events from %s: %s", sub.member, exc)
            return False

    def _apply_commands(self) -> None:
        while not self._commands.empty():  # only the listener's thread (or loop) takes from it: an item waits
            wanted = self._commands.get_nowait()
            for name in [n for n, s in self._subs.items() if wanted.get(n) != s.address]:
                self._close(self._subs.pop(name))
                self.index.drop(name)
            for name, address in wanted.items():
                if name not in self._subs:
                    self._open(name, address)

    def _open(self, member: str, address: PublisherAddress) -> None:
        """Subscribe; an endpoint ZMQ refuses (a record may carry anything) leaves the member scored by load."""
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, self.rcvhwm)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)  # before any connection
        try:
            sock.connect(address.endpoint)
        except zmq.ZMQError as exc:
            sock.disable_monitor()
            monitor.close(linger=0)
            sock.close(linger=0)
            log.warning("cannot subscribe to the KV events of %s at %r (%s): scoring it by load", member,
                        address.endpoint, exc)
            return
        sock.subscribe(address.topic.encode())
        sub = self._subs[member] = Subscription(member, address, sock, monitor)
        self._live = None
        self._watch(sub, sock, "sub")
        self._watch(sub, monitor, "monitor")
        log.info("subscribed to the KV events of %s at %s", member, address.endpoint)

    def _watch(self, sub: Subscription, sock: zmq.Socket, role: str) -> None:
        self._poller.register(sock, zmq.POLLIN)
        self._by_socket[sock] = (sub, role)
        if self._loop is not None and role != "sub":
            self._read_in_loop(sock)

    def _unwatch(self, sock: zmq.Socket | None) -> None:
        if sock is None:
            return
        self._poller.unregister(sock)
        owner = self._by_socket.pop(sock, None)
        if owner is not None and owner[1] != "sub" and self._loop is not None:
            self._loop.remove_reader(sock.FD)
        sock.close(linger=0)

    def _close(self, sub: Subscription) -> None:
        self._live = None
        self._unwatch(sub.dealer)
        sub.sub.disable_monitor()
        self._unwatch(sub.monitor)
        self._unwatch(sub.sub)

    # -- connection --------------------------------------------------------------------------------------
    def _drain_monitor(self, sub: Subscription) -> None:
        while sub.monitor.poll(0):
            event = recv_monitor_message(sub.monitor)["event"]
            if event == zmq.EVENT_CONNECTED:
                self._start_replay(sub, 0, clear=True)
            elif event == zmq.EVENT_DISCONNECTED:
                sub.counters.disconnects += 1
                log.warning("lost the KV events of %s: scoring it by load until it is back", sub.member)
                self._degrade(sub, retry=False)

    def _degrade(self, sub: Subscription, retry: bool) -> None:
        """Drop the instance's entries and score it by load. Either way it is asked again after `retry_s`: after a
        disconnect ZMQ redials by itself, but the monitor's CONNECTED for that redial is not always seen (a
        subscriber that stalled past its high-water mark was seen waiting for it over 60 s), so recovery never
        hangs on one event."""
        self.index.drop(sub.member)
        self._unwatch(sub.dealer)
        sub.dealer = None
        sub.state = "degraded" if retry else "connecting"
        sub.next_seq = None
        sub.held.clear()
        sub.deadline = time.monotonic() + self.retry_s

    def _on_deadline(self, sub: Subscription) -> None:
        if sub.state == "live":  # quiet for a while: ask for anything after the last batch
            self._start_replay(sub, sub.next_seq or 0, clear=False, counted=False)
        elif sub.state == "replaying":
            log.warning("the KV events of %s: no replay within %g s; scoring it by load for now", sub.member,
                        self.replay_timeout_s)
            self._degrade(sub, retry=True)
        elif sub.state in ("degraded", "connecting"):
            self._start_replay(sub, 0, clear=True)

    # -- replay ------------------------------------------------------------------------------------------
    def _start_replay(self, sub: Subscription, start: int, clear: bool, counted: bool = True) -> None:
        if clear:
            self.index.clear(sub.member)
            sub.next_seq = None
        self.index.join(sub.member, sub.address.block_size, sub.address.store)
        if sub.address.replay_endpoint is None:
            sub.state, sub.deadline = "live", 0.0
            return
        # A fresh socket unless the last answer ended: nothing unanswered can arrive late, and idle probes do not
        # dial and tear down a TCP connection on both sides each time (most of what a quiet gateway spent here).
        kept = sub.dealer is not None and sub.answered
        if not kept:
            self._unwatch(sub.dealer)
            sub.dealer = self._ctx.socket(zmq.DEALER)
            sub.dealer.setsockopt(zmq.LINGER, 0)
            # A replay sends thousands of batches at once; a ROUTER drops what a full pipe cannot take (the end
            # marker too), so this side takes everything (the publisher's buffer bounds it).
            sub.dealer.setsockopt(zmq.RCVHWM, 0)
            sub.dealer.connect(sub.address.replay_endpoint)
            self._watch(sub, sub.dealer, "dealer")
        sub.answered = False
        sub.dealer.send_multipart((b"", start.to_bytes(8, "big")))
        if kept and self._loop is not None:  # a send may take in its pending signal (a new one is read on watch)
            self._loop.call_soon(self._readable, sub.dealer)
        sub.counters.replays += counted
        sub.state, sub.hole, sub.replayed = "replaying", False, 0
        sub.deadline = time.monotonic() + self.replay_timeout_s

    def _drain_replay(self, sub: Subscription) -> bool:
        for _ in range(_BUDGET):
            if sub.dealer is None or not sub.dealer.poll(0):
                return False
            frames = sub.dealer.recv_multipart()
            if sub.state != "replaying" or len(frames) not in (3, 4) or len(frames[-2]) != 8:
                continue
            seq = int.from_bytes(frames[-2], "big", signed=True)
            if seq == _END_SEQ:
                sub.answered = True
                if sub.hole:
                    self._start_replay(sub, sub.next_seq or 0, clear=sub.next_seq is None)
                else:
                    self._end_replay(sub)
                continue  # read on until nothing waits: ZMQ signals the next answer once a read found none
            if sub.hole:
                continue
            sub.replayed += 1
            if sub.next_seq is not None and seq > sub.next_seq:
                sub.counters.gaps += 1
                if sub.replayed > 1:  # a hole inside the replay: nothing past it applies; its end asks again
                    sub.hole = True
                    continue
                # The publisher no longer buffers what is missing: start over from what it has.
                self.index.clear(sub.member)
                sub.next_seq = None
            if sub.next_seq is None or seq == sub.next_seq:
                self._apply(sub, seq, frames[-1])
        return True

    def _end_replay(self, sub: Subscription) -> None:
        sub.state = "live"
        self._quiet_from_now(sub)
        held, sub.held = sub.held, []
        for seq, payload in held:
            if sub.next_seq is not None and seq < sub.next_seq:
                continue  # the replay brought it already
            self._on_batch(sub, seq, payload)
            if sub.state != "live":  # a gap among them started another replay: keep the rest for it
                sub.held.extend(item for item in held if item[0] > seq)
                return

    # -- live batches ------------------------------------------------------------------------------------
    def _drain_live(self, sub: Subscription, ready: bool) -> bool:
        # The socket is asked whether a message waits rather than left to fail a receive: pyzmq builds an exception
        # (its errno turned into an enum, its message looked up) for every failed receive, once per batch here.
        for n in range(_BUDGET):
            if (n or not ready) and not sub.sub.getsockopt(zmq.EVENTS) & _POLLIN:
                return False
            try:
                frames = sub.sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:  # a poll's readiness that a receive did not find (not an error)
                return False
            if len(frames) != 3 or len(frames[1]) != 8:
                sub.counters.decode_errors += 1
                continue
            seq = int.from_bytes(frames[1], "big")
            if sub.state == "replaying":
                sub.held.append((seq, frames[2]))
                if len(sub.held) > _MAX_HELD:
                    self._start_replay(sub, 0, clear=True)
                    sub.held.clear()
            elif sub.state == "live":
                self._on_batch(sub, seq, frames[2])
        return True

    def _on_batch(self, sub: Subscription, seq: int, payload: bytes) -> None:
        expected = sub.next_seq
        if expected is None or seq == expected:
            self._apply(sub, seq, payload)
        elif seq > expected:
            sub.counters.gaps += 1
            if sub.address.replay_endpoint is None:
                self.index.clear(sub.member)
                self._apply(sub, seq, payload)
            else:
                sub.held.append((seq, payload))
                self._start_replay(sub, expected, clear=False)
        else:
            sub.counters.restarts += 1
            log.info("the KV event sequence of %s went back (%d after %d): the engine restarted; rebuilding",
                     sub.member, seq, expected - 1)
            if sub.address.replay_endpoint is None:
                self.index.clear(sub.member)
                self._apply(sub, seq, payload)
            else:
                sub.held.append((seq, payload))
                self._start_replay(sub, 0, clear=True)

    def _apply(self, sub: Subscription, seq: int, payload: bytes) -> None:
        sub.next_seq = seq + 1
        try:
            batch = decode_batch(payload)
        except EventDecodeError as exc:
            sub.counters.decode_errors += 1
            log.warning("undecodable KV event batch %d from %s (%s): its entries are dropped", seq, sub.member, exc)
            self.index.clear(sub.member)
            return
        sub.counters.batches += 1
        try:
            self.index.apply(sub.member, batch.events)
        except Exception:  # noqa: BLE001 - a batch the index cannot apply must not stop this thread for every member
            sub.counters.decode_errors += 1
            log.exception("KV event batch %d from %s could not be applied: its entries are dropped", seq, sub.member)
            self.index.clear(sub.member)
            return
        if sub.state == "live":
            self._quiet_from_now(sub)

    def _quiet_from_now(self, sub: Subscription) -> None:
        """A live subscription with a replay endpoint asks for missed batches once it has been quiet a while."""
        sub.deadline = time.monotonic() + self.idle_replay_s if sub.address.replay_endpoint is not None else 0.0
