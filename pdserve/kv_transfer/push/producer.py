"""P's side of push, on the engine thread: write each layer's KV into D's registered blocks once computed.

D registers its blocks with P's side channel, keyed by the gateway's transfer_id; the registration may arrive
before P starts, during its prefill, or after it has finished. Blocks P computed before the registration
arrived are first copied whole (catch-up), then every layer of every later chunk as the model produces it.
All writes go through one writer thread, so they land in the order issued; write-done follows the last one.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from pdserve.ids import ReqId, TransferId
from pdserve.kv_transfer.messages import PushRegister
from pdserve.kv_transfer.push.link import ProducerLink
from pdserve.kv_transfer.push.specs import PushChunk, PushEnded
from pdserve.kv_transfer.translator import TransferMap
from pdserve.utils import cdiv

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Source:
    request_id: ReqId
    transfer_id: TransferId
    prompt_hash: str = ""
    block_ids: tuple[int, ...] = ()
    computed: int = 0  # prompt tokens whose KV exists on P
    registration: PushRegister | None = None
    finished: bool = False
    handed_off: bool = False
    released: bool = False
    failed: str = ""
    done: bool = False  # write-done (or failure notice) sent
    done_submitted: bool = False
    deadline: float = 0.0


# How many ended transfer ids P remembers (about 100 bytes each).
_ENDED_REMEMBERED = 16384


class PushProducer:
    """P's side, inside the worker half: tracks push requests and issues their writes."""

    def __init__(self, link: ProducerLink, translator: TransferMap, block_size: int, num_layers: int,
                 unregistered_timeout_s: float) -> None:
        self.link = link
        self.translator = translator
        self.block_size = block_size
        self.num_layers = num_layers
        self.unregistered_timeout_s = unregistered_timeout_s
        self.sources: dict[TransferId, _Source] = {}
        # Transfers admitted here whose request has not been scheduled yet: a registration for one of them waits
        # however long P's queue is (D bounds that wait with its own deadline, and releases).
        self._queued: set[TransferId] = set()
        # Registrations for transfers we do not know yet, with their arrival time.
        self._orphans: dict[TransferId, tuple[PushRegister, float]] = {}
        # Transfers that ended here lately: a registration arriving after its transfer was freed (delayed, or after
        # P's deadline) is told "expired", so D recomputes, instead of "denied" as for an id P never had.
        self._ended: OrderedDict[TransferId, None] = OrderedDict()
        self._step: list[PushChunk] = []
        self.expired = 0

    # -- per step --------------------------------------------------------------------------------------------
    def bind(self, chunks: list[PushChunk], ended: list[PushEnded], queued: Iterable[TransferId] = ()) -> None:
        self._queued.update(queued)
        for chunk in chunks:
            source = self._source(chunk.request_id, chunk.transfer_id, chunk.prompt_hash)
            source.block_ids = chunk.block_ids
            if source.computed < chunk.start:
                # Tokens before this chunk came from P's prefix cache: no layer write covers them, so they are
                # copied whole now if D has registered, or by the catch-up when it does.
                if source.registration is not None and not source.released:
                    self._write(source, source.computed, chunk.start, layer=None)
                source.computed = chunk.start
        self._step = list(chunks)
        for end in ended:
            source = self._source(end.request_id, end.transfer_id, end.prompt_hash)
            source.block_ids, source.computed = end.block_ids, end.num_tokens
            source.finished, source.handed_off = True, end.handed_off
            source.deadline = time.monotonic() + self.unregistered_timeout_s
            if not end.handed_off and source.registration is not None and not source.done_submitted:
                self._submit_done(source, ok=False, error="the prefill request ended without its KV")

    def _source(self, request_id: ReqId, transfer_id: TransferId, prompt_hash: str) -> _Source:
        source = self.sources.get(transfer_id)
        if source is None:
            source = self.sources[transfer_id] = _Source(request_id, transfer_id, prompt_hash)
            self._queued.discard(transfer_id)
            self.translator.add(transfer_id, request_id)
            orphan = self._orphans.pop(transfer_id, None)
            if orphan is not None:
                self._attach(source, orphan[0])
        return source

    def start_step(self) -> None:
        """Take what arrived on the side channel: registrations (catch up on them) and releases."""
        for registration in self.link.take_registrations():
            source = self.sources.get(registration.transfer_id)
            if source is None and registration.transfer_id in self._ended:
                self.link.send_write_done(registration, ok=False, refusal="expired",
                                           error="this instance already freed the transfer's KV")
            elif source is None:  # it may arrive before P has even seen the request
                self._orphans[registration.transfer_id] = (registration, time.monotonic())
            else:
                self._attach(source, registration)
        for transfer_id, token in self.link.take_releases().items():
            self._release(transfer_id, token)
        self._expire_orphans()

    def _release(self, transfer_id: TransferId, token: str) -> None:
        """D gave up: stop writing and answer at once, so D can reuse its blocks without waiting."""
        orphan = self._orphans.get(transfer_id)
        if orphan is not None and orphan[0].token == token:
            del self._orphans[transfer_id]
            self.link.send_write_done(orphan[0], ok=False, error="released by the consumer")
        source = self.sources.get(transfer_id)
        if source is None:
            return
        if source.registration is not None and source.registration.token != token:
            return  # only the consumer that registered may call its transfer off
        source.released = True
        if source.registration is not None and not source.done_submitted:
            self._submit_done(source, ok=False, error="released by the consumer")

    def _attach(self, source: _Source, registration: PushRegister) -> None:
        if source.registration is not None:
            return  # a duplicated registration message
        if registration.prompt_hash and source.prompt_hash and registration.prompt_hash != source.prompt_hash:
            # Legs of two different requests were paired: our KV would give D a wrong answer. Freed once ours ends.
            source.released = True
            self.link.send_write_done(registration, ok=False, refusal="prompt_mismatch",
                                      error="the transfer's KV belongs to a different prompt than the decode request's")
            return
        source.registration = registration
        if source.computed > 0:
            self._write(source, 0, source.computed, layer=None)  # catch up on what was computed before
        if source.finished:
            self._submit_done(source, ok=source.handed_off,
                              error="" if source.handed_off else "the prefill request ended without its KV")

    def save_layer(self, layer: int) -> None:
        if self.link.has_work():
            self._attach_midstep(layer)
        for chunk in self._step:
            source = self.sources.get(chunk.transfer_id)
            if source is None or source.registration is None or source.released:
                continue
            self._write(source, chunk.start, chunk.end, layer)
            if layer == self.num_layers - 1 and chunk.last:
                self._submit_done(source, ok=True)

    def _attach_midstep(self, layer: int) -> None:
        """A registration that arrives while this step computes joins it now rather than at the next step: the
        step's layers already computed are written at once and the rest as they come, so write-done follows the
        step's last layer instead of waiting for P's next step and a whole-prompt catch-up."""
        unregistered = {c.transfer_id for c in self._step if (s := self.sources.get(c.transfer_id)) is not None
                        and s.registration is None}
        self.start_step()
        for chunk in self._step:
            source = self.sources.get(chunk.transfer_id)
            if chunk.transfer_id in unregistered and source is not None and source.registration is not None \
                    and not source.released:
                for earlier in range(layer):
                    self._write(source, chunk.start, chunk.end, earlier)

    def writes_this_step(self) -> bool:
        """Whether this step has layers to write once saved (a device cache must finish computing them first)."""
        return bool(self._step)

    def end_step(self) -> None:
        for chunk in self._step:
            source = self.sources.get(chunk.transfer_id)
            if source is not None:
                source.computed = max(source.computed, chunk.end)
        self._step = []

    def finished_requests(self) -> set[ReqId]:
        """Finished push requests whose blocks P may free now: written, released, failed or expired. A request
        that ended without handing its KV off is forgotten but not reported: the engine never held its blocks
        for the push, and vLLM's scheduler asserts it holds every request reported to it."""
        out: set[ReqId] = set()
        now = time.monotonic()
        for transfer_id, source in list(self.sources.items()):
            if not source.finished:
                continue
            expired = source.registration is None and now >= source.deadline
            if source.done or source.released or expired or (source.registration is None and not source.handed_off):
                if expired and source.handed_off:
                    self.expired += 1
                    log.warning("push transfer %s: no decode instance registered in %.0f s; freed", transfer_id,
                                self.unregistered_timeout_s)
                if source.handed_off:
                    out.add(source.request_id)
                del self.sources[transfer_id]
                self.translator.remove_request(source.request_id)
                self._remember_ended(transfer_id)
        return out

    def _remember_ended(self, transfer_id: TransferId) -> None:
        self._ended[transfer_id] = None
        if len(self._ended) > _ENDED_REMEMBERED:
            self._ended.popitem(last=False)

    # -- writes ----------------------------------------------------------------------------------------------
    def _write(self, source: _Source, start: int, end: int, layer: int | None) -> None:
        registration = source.registration
        assert registration is not None
        first = registration.first_block
        local, remote = [], []
        for index in range(start // self.block_size, cdiv(end, self.block_size)):
            if index < first or index - first >= len(registration.block_ids) or index >= len(source.block_ids):
                continue
            local.append(source.block_ids[index])
            remote.append(registration.block_ids[index - first])
        if local:
            self.link.writer.submit(self._run_write, source, registration, local, remote, layer)

    def _run_write(self, source: _Source, registration: PushRegister, local: list[int], remote: list[int],
                   layer: int | None) -> None:
        if source.failed or source.released:
            return
        try:
            self.link.write_blocks(registration, local, remote, layer)
        except Exception as exc:  # noqa: BLE001 - reported to D through write-done
            source.failed = f"{type(exc).__name__}: {exc}"
            log.warning("push write for %s failed: %s", registration.transfer_id, source.failed)

    def _submit_done(self, source: _Source, ok: bool, error: str = "") -> None:
        source.done_submitted = True
        self.link.writer.submit(self._run_done, source, ok, error)

    def _run_done(self, source: _Source, ok: bool, error: str) -> None:
        registration = source.registration
        if registration is not None:
            ok = ok and not source.failed and not source.released
            first = registration.first_block
            ours = list(source.block_ids[first:first + len(registration.block_ids)])
            self.link.send_write_done(registration, ok, error or source.failed, source_blocks=ours)
        source.done = True
        self.link.rt.on_event()

    def _expire_orphans(self) -> None:
        now = time.monotonic()
        for transfer_id, (registration, arrived) in list(self._orphans.items()):
            if now - arrived > self.unregistered_timeout_s and transfer_id not in self._queued:
                del self._orphans[transfer_id]
                self.link.send_write_done(registration, ok=False, error="this instance has no such transfer",
                                           refusal="denied")

    def has_pending_work(self) -> bool:
        return bool(self._orphans or self.sources)
