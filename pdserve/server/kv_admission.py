"""A request's kv_transfer_params at the server's door: parsed once on arrival, admitted (checked, and for
decode-first prepared) just before the engine gets the request, and reported to the connectors if the request is
refused, so KV held for it elsewhere is freed at once."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from pdserve.kv_transfer.params import KVTransferParams, RemoteDecode, RemotePrefill
from pdserve.server.errors import bad_request


class KVRequestParams(Protocol):
    """What the server asks of the instance's KV connectors about a request's kv_transfer_params."""

    def parse_request_params(self, params: Any) -> KVTransferParams | None:
        """The body's params as types (None for an ordinary request); raises ValueError if malformed."""

    def check_request_params(self, parsed: KVTransferParams, num_prompts: int, n: int) -> None:
        """Raises ValueError if this request cannot carry them (e.g. a list of prompts)."""

    async def prepare_request_params(self, parsed: KVTransferParams, prompt_token_ids: list[int]
                                     ) -> RemoteDecode | RemotePrefill | None:
        """What the engine should get (decode-first: ask P to prefill, then load from it)."""

    def reject(self, parsed: KVTransferParams, reason: str) -> None:
        """Told when a request carrying them is refused before it reaches the engine."""


@dataclass(frozen=True, slots=True)
class ParsedKV:
    """A body's kv_transfer_params as parsed on arrival. A malformed one is refused at admission, after the
    prompt and sampling checks, so a request with several faults is answered as it always was."""

    parsed: KVTransferParams | None = None
    error: str | None = None


@dataclass(frozen=True, slots=True)
class KVAdmission:
    connectors: KVRequestParams | None = None  # None: no KV connectors, kv_transfer_params are ignored (as vLLM)

    def parse(self, params: Any) -> ParsedKV:
        if self.connectors is None or not params:
            return ParsedKV()
        try:
            return ParsedKV(self.connectors.parse_request_params(params))
        except ValueError as exc:
            return ParsedKV(error=str(exc))

    async def admit(self, kv: ParsedKV, num_prompts: int, n: int, prompt_token_ids: list[int]
                    ) -> RemoteDecode | RemotePrefill | None:
        """What the engine gets; raises the 400 for params that are malformed or unusable for this request."""
        if kv.parsed is None and kv.error is None:
            return None
        try:
            if kv.error is not None:
                raise ValueError(kv.error)
            self.connectors.check_request_params(kv.parsed, num_prompts, n)
            return await self.connectors.prepare_request_params(kv.parsed, prompt_token_ids)
        except ValueError as exc:
            raise bad_request(str(exc), "kv_transfer_params") from exc

    def refused(self, kv: ParsedKV, reason: str) -> None:
        if kv.parsed is not None:
            self.connectors.reject(kv.parsed, reason)
