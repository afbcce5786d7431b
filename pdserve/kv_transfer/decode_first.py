"""Decode-first mode (Llumnix vllm-kvt style): the gateway sends only D the request, with P's address; D asks
P to prefill the prompt and hold its KV, then pulls it as in pull mode.

D sends P the prompt as token ids, so both instances see exactly the same tokens. If P cannot be reached or
fails, D prefills locally (counted in `pdserve:decode_first_fallbacks`): the client still gets its answer.
"""

from __future__ import annotations

import logging
from urllib.parse import urlsplit

import msgspec

from pdserve.kv_transfer.params import DecodeFirst, RemoteDecode, RemotePrefill, parse_kv_params
from pdserve.net.http_client import HttpClient, UpstreamError, UpstreamTimeout

log = logging.getLogger(__name__)


class DecodeFirstClient:
    def __init__(self, connect_timeout_s: float = 3.0, prefill_timeout_s: float = 300.0,
                 headers: list[tuple[bytes, bytes]] | None = None) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.prefill_timeout_s = prefill_timeout_s
        self.client = HttpClient(headers)  # headers: the prefill instances' API key, if they have one
        self.prefills = 0
        self.fallbacks = 0

    async def prefill(self, request: DecodeFirst, prompt_token_ids: list[int], max_blocks: int
                      ) -> RemotePrefill | None:
        """P's pull-mode kv_transfer_params for this prompt, or None to prefill here.

        P's answer is parsed here, where it arrives; a malformed one is refused (KVParamsError) as a client's is.
        """
        url = urlsplit(request.prefill_url)
        body = {"prompt": prompt_token_ids, "max_tokens": 1, "temperature": 0, "stream": False,
                "kv_transfer_params": RemoteDecode(request.transfer_id).to_wire()}
        pool = self.client.pool(url.hostname or "127.0.0.1", url.port or 80)
        try:
            response = await pool.request("POST", "/v1/completions", msgspec.json.encode(body),
                                          [(b"content-type", b"application/json")],
                                          connect_timeout=self.connect_timeout_s, header_timeout=self.prefill_timeout_s)
            raw = await response.read(self.prefill_timeout_s)
        except (UpstreamError, UpstreamTimeout) as exc:
            return self._fallback(request, str(exc))
        if response.status != 200:
            return self._fallback(request, f"answered {response.status}: {raw[:200]!r}")
        params = msgspec.json.decode(raw).get("kv_transfer_params")
        if not isinstance(params, dict) or not params.get("do_remote_prefill"):
            return self._fallback(request, "returned no kv_transfer_params")
        parsed = parse_kv_params(params, max_blocks)
        if not isinstance(parsed, RemotePrefill):  # another engine's KV: its side channel is never dialled
            return self._fallback(request, "answered with kv_transfer_params that are not pdserve's")
        self.prefills += 1
        return parsed

    def _fallback(self, request: DecodeFirst, why: str) -> None:
        self.fallbacks += 1
        log.warning("decode-first prefill on %s failed (%s); prefilling locally", request.prefill_url, why)
        return None

    def close(self) -> None:
        self.client.close()
