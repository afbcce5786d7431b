"""vLLM's requests as PdConnector's scheduler half reads them.

The scheduler half was written against pdserve's `Request`; a vLLM request carries the same facts under nearly
the same names. This view reads them through (nothing is copied, so it is always current) and holds what
pdserve's server would have set: the parsed `kv_transfer_params`, parsed once here, at vLLM's boundary.
"""

from __future__ import annotations

import logging
from typing import Any

from pdserve.engine.request import RequestStatus
from pdserve.ids import ReqId
from pdserve.kv_transfer.params import ForeignPrefill, KVParamsError, KVTransferParams, parse_kv_params

log = logging.getLogger(__name__)


def parse_vllm_params(raw: Any, max_blocks: int) -> KVTransferParams | None:
    """A request's `kv_transfer_params` as this connector serves them inside vLLM; None: an ordinary request.

    vLLM offers no way to refuse a request from a connector, so parameters this connector cannot serve are
    dropped with a warning and the request is computed here, which is always correct: malformed ones, and another
    engine's (vLLM NIXL's, which this connector does not load inside vLLM).
    """
    try:
        parsed = parse_kv_params(raw, max_blocks)
    except KVParamsError as exc:
        log.warning("kv_transfer_params ignored, the prompt is computed here: %s", exc)
        return None
    if isinstance(parsed, ForeignPrefill):
        log.warning("kv_transfer_params of a kind PdConnector does not serve inside vLLM (%s): the prompt is "
                    "computed here", type(parsed).__name__)
        return None
    return parsed


def pdserve_status(status: Any) -> RequestStatus:
    """vLLM's status under pdserve's name; vLLM's other finished states count as aborted, the rest as waiting."""
    same = RequestStatus.__members__.get(getattr(status, "name", ""))
    if same is not None:
        return same
    finished = int(status) > int(type(status).PREEMPTED)
    return RequestStatus.FINISHED_ABORTED if finished else RequestStatus.WAITING


class RequestView:
    """The fields of `pdserve.engine.request.Request` the connector's scheduler half reads, over a vLLM request."""

    __slots__ = ("_request", "kv_transfer_params", "mm_items")

    def __init__(self, request: Any, params: KVTransferParams | None) -> None:
        self._request = request
        self.kv_transfer_params = params
        self.mm_items: list = []  # media items are bound by vLLM's own prompt (text-only here)

    @property
    def request_id(self) -> ReqId:
        return ReqId(self._request.request_id)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self._request.prompt_token_ids or []

    @property
    def num_prompt_tokens(self) -> int:
        return self._request.num_prompt_tokens

    @property
    def num_tokens(self) -> int:
        return self._request.num_tokens

    def token_ids_range(self, start: int, end: int) -> list[int]:
        return list(self._request.all_token_ids[start:end])

    @property
    def cache_salt(self) -> str | None:
        return getattr(self._request, "cache_salt", None)

    @property
    def num_computed_tokens(self) -> int:
        return self._request.num_computed_tokens

    @property
    def num_cached_tokens(self) -> int:
        return getattr(self._request, "num_cached_tokens", -1)

    @num_cached_tokens.setter
    def num_cached_tokens(self, value: int) -> None:
        """vLLM counts a request's cached tokens itself; the connector's account of them is not applied."""

    @property
    def status(self) -> RequestStatus:
        return pdserve_status(self._request.status)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished
