"""Decode-first inside vLLM: D's scheduler half asks P to prefill while vLLM keeps the request waiting.

A pdserve decode instance asks P before the request reaches its engine. Inside vLLM the connector first sees the
request in the engine's scheduler, which must never block, so the ask runs on a loop thread of its own (pdserve's
`DecodeFirstClient`, the same code, with its connect and prefill deadlines), and the connector answers vLLM's
`get_num_new_matched_tokens` with None ("not known yet": vLLM schedules other requests and asks again next step)
until P has answered. P's answer is then a pull like any other; no answer means D computes the prompt itself.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from concurrent.futures import Future
from urllib.parse import urlsplit

from pdserve.kv_transfer.decode_first import DecodeFirstClient
from pdserve.kv_transfer.params import DecodeFirst, RemotePrefill
from pdserve.kv_transfer.peer_policy import PeerNotAllowed, PeerPolicy

log = logging.getLogger(__name__)


class DecodeFirstAsks:
    """Prefills asked of P, by D's request id. Started lazily: an instance that never decodes first runs no
    thread."""

    def __init__(self, peers: PeerPolicy, max_blocks: int) -> None:
        self.peers = peers
        self.max_blocks = max_blocks
        self._asks: dict[str, Future] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._client: DecodeFirstClient | None = None

    def ask(self, request_id: str, params: DecodeFirst, prompt_token_ids: list[int]) -> None:
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            threading.Thread(target=self._loop.run_forever, name="pdserve-decode-first", daemon=True).start()
            self._client = DecodeFirstClient()
        self._asks[request_id] = asyncio.run_coroutine_threadsafe(self._prefill(params, prompt_token_ids),
                                                                  self._loop)

    async def _prefill(self, params: DecodeFirst, prompt_token_ids: list[int]) -> RemotePrefill | None:
        assert self._client is not None
        try:
            await self.peers.check(urlsplit(params.prefill_url).hostname or "")
            return await self._client.prefill(params, prompt_token_ids, self.max_blocks)
        except PeerNotAllowed as exc:
            log.warning("decode-first: %s; the prompt is computed here", exc)
        except Exception as exc:  # noqa: BLE001 - whatever P answered, D can still compute the prompt
            log.warning("decode-first: P's answer is unusable (%s); the prompt is computed here", exc)
        return None

    def pending(self, request_id: str) -> bool:
        return request_id in self._asks

    def take(self, request_id: str) -> tuple[bool, RemotePrefill | None]:
        """(answered, P's params: None when D computes the prompt itself). Once answered, forgotten."""
        ask = self._asks.get(request_id)
        if ask is None or not ask.done():
            return ask is None, None
        del self._asks[request_id]
        return True, ask.result()

    def answered(self) -> list[str]:
        """Asks whose answers are in (for requests that ended while asking: P's KV must be freed)."""
        return [rid for rid, ask in self._asks.items() if ask.done()]

    def close(self) -> None:
        if self._loop is not None and self._client is not None:
            self._loop.call_soon_threadsafe(self._client.close)
            self._loop.call_soon_threadsafe(self._loop.stop)
