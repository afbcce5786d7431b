"""P's push producer on the engine thread, driven step by step: when a registration that arrives mid-step is
written (the data plane and the side channel stand in as a recording link, so the order of writes is exact)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import msgspec

from pdserve.ids import ReqId, TransferId
from pdserve.kv_transfer.messages import PushRegister
from pdserve.kv_transfer.push.producer import PushProducer
from pdserve.kv_transfer.push.specs import PushChunk, PushEnded
from pdserve.kv_transfer.translator import TransferMap

LAYERS, BLOCK = 4, 16
XFER, RID = TransferId("xfer-1"), ReqId("req-1")


class RecordingLink:
    """The producer's link with its side channel and data plane replaced by a record of what they were asked."""

    def __init__(self) -> None:
        self.writer = ThreadPoolExecutor(max_workers=1)
        self.rt = self
        self.arrived: list[PushRegister] = []
        self.events: list[tuple] = []
        self._lock = threading.Lock()

    def on_event(self) -> None:
        pass

    def take_registrations(self) -> list[PushRegister]:
        out, self.arrived = self.arrived, []
        return out

    def take_releases(self) -> dict:
        return {}

    def has_work(self) -> bool:
        return bool(self.arrived)

    def write_blocks(self, registration, local_ids, remote_ids, layer) -> None:
        with self._lock:
            self.events.append(("write", tuple(local_ids), tuple(remote_ids), layer))

    def send_write_done(self, registration, ok, error="", source_blocks=None, refusal="") -> None:
        with self._lock:
            self.events.append(("done", ok))

    def settled(self) -> list[tuple]:
        self.writer.submit(lambda: None).result(10)  # writes and write-done run in order on the one writer
        return list(self.events)


def registration() -> PushRegister:
    return PushRegister(transfer_id=XFER, block_ids=[10, 11], first_block=0, num_tokens=32, consumer_engine_id="d",
                        consumer_host="127.0.0.1", consumer_port=1, token="t")


def test_a_registration_arriving_mid_step_is_written_within_that_step():
    """The prefill is one step; D's registration arrives after its first layer was saved. Every layer must reach
    D and write-done follow the step's last layer, without waiting for P's next step (a whole-prompt catch-up
    after the prefill used to make D wait for that step)."""
    link = RecordingLink()
    producer = PushProducer(link, TransferMap(), BLOCK, LAYERS, unregistered_timeout_s=30)
    producer.bind([PushChunk(RID, XFER, (0, 1), 0, 32, last=True)], [])
    producer.start_step()
    producer.save_layer(0)
    link.arrived.append(registration())
    for layer in range(1, LAYERS):
        producer.save_layer(layer)
    producer.end_step()
    events = link.settled()
    assert events[-1] == ("done", True), events  # before the step ended, not at the next one
    written = sorted(e[3] for e in events if e[0] == "write")
    assert written == list(range(LAYERS))
    assert all(e[1:3] == ((0, 1), (10, 11)) for e in events if e[0] == "write")
    # the request ends at the next step; nothing is written twice
    producer.bind([], [PushEnded(RID, XFER, (0, 1), 32, handed_off=True)])
    producer.start_step()
    producer.end_step()
    assert link.settled() == events
    assert producer.finished_requests() == {RID}


def test_a_registration_arriving_after_the_step_is_caught_up_whole():
    link = RecordingLink()
    producer = PushProducer(link, TransferMap(), BLOCK, LAYERS, unregistered_timeout_s=30)
    producer.bind([PushChunk(RID, XFER, (0, 1), 0, 32, last=True)], [])
    producer.start_step()
    for layer in range(LAYERS):
        producer.save_layer(layer)
    producer.end_step()
    assert link.settled() == []
    link.arrived.append(registration())
    producer.bind([], [PushEnded(RID, XFER, (0, 1), 32, handed_off=True)])
    producer.start_step()
    producer.end_step()
    assert link.settled() == [("write", (0, 1), (10, 11), None), ("done", True)]


def test_a_request_ended_without_a_hand_off_is_forgotten_not_reported():
    """The engine freed such a request's blocks when it ended (it held nothing for the push): reporting its
    sending finished would name a request the engine no longer has (vLLM's scheduler asserts on that). D's
    registration, if one came, is answered with a failed write-done."""
    for registered in (False, True):
        link = RecordingLink()
        producer = PushProducer(link, TransferMap(), BLOCK, LAYERS, unregistered_timeout_s=30)
        producer.bind([PushChunk(RID, XFER, (0, 1), 0, 32, last=True)], [])
        producer.start_step()
        if registered:
            link.arrived.append(registration())
        producer.end_step()
        producer.bind([], [PushEnded(RID, XFER, (0, 1), 32, handed_off=False)])
        producer.start_step()
        producer.end_step()
        assert [e for e in link.settled() if e[0] == "done"] == ([("done", False)] if registered else [])
        assert producer.finished_requests() == set()
        assert XFER not in producer.sources


def test_a_registration_for_a_queued_request_waits_past_the_deadline():
    """D registered before P scheduled the request. If P has the request in its queue, the registration waits
    for it however long that takes (D's own deadline bounds it); one P never got is answered "no such transfer"
    at P's deadline."""
    other = TransferId("xfer-unknown")
    link = RecordingLink()
    producer = PushProducer(link, TransferMap(), BLOCK, LAYERS, unregistered_timeout_s=0.0)
    producer.bind([], [], [XFER])  # admitted, waiting behind other requests
    link.arrived += [registration(), PushRegister(**{**msgspec.structs.asdict(registration()), "transfer_id": other})]
    producer.start_step()
    producer.end_step()
    assert link.settled() == [("done", False)]  # the unknown one, at once (a deadline of 0 s)
    producer.start_step()
    producer.end_step()
    assert link.settled() == [("done", False)]  # the queued one still waits
    producer.bind([PushChunk(RID, XFER, (0, 1), 0, 32, last=True)], [])  # scheduled at last
    producer.start_step()
    for layer in range(LAYERS):
        producer.save_layer(layer)
    producer.end_step()
    assert link.settled()[1:] == [*(("write", (0, 1), (10, 11), layer) for layer in range(LAYERS)), ("done", True)]
