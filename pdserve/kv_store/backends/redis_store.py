"""Redis (or any server speaking its protocol): one key per block, `SET ... PX ttl`, pipelined.

The server owns its memory: `maxmemory` with an `allkeys-lru` policy makes a full store evict its least recently
used blocks instead of refusing writes (which this backend counts as refused when it does: `OOM`).
"""

from __future__ import annotations

import redis

from pdserve.kv_store.backends.base import StoreBackend, StoreUnavailable

# A live Redis on the same network answers in well under a millisecond; a dead one refuses the connection at once.
# This bounds only a server that stopped answering (paused, partitioned).
_SOCKET_TIMEOUT_S = 2.0
_UNREACHABLE = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)


class RedisBackend(StoreBackend):
    name = "redis"

    def __init__(self, config) -> None:
        super().__init__(config)
        self._client: redis.Redis | None = None

    def connect(self) -> None:
        self.close()
        client = redis.Redis.from_url(self.config.url, socket_timeout=_SOCKET_TIMEOUT_S,
                                      socket_connect_timeout=_SOCKET_TIMEOUT_S)
        try:
            client.ping()
        except _UNREACHABLE as exc:
            client.close()
            raise StoreUnavailable(f"Redis at {self.config.url}: {exc}") from exc
        self._client = client

    def _pipeline(self) -> redis.client.Pipeline:
        if self._client is None:
            raise StoreUnavailable("not connected")
        return self._client.pipeline(transaction=False)

    def exists(self, keys: list[str]) -> list[bool]:
        pipe = self._pipeline()
        for key in keys:
            pipe.exists(key)
        return [bool(n) for n in self._run(pipe)]

    def get(self, keys: list[str]) -> list[bytes | None]:
        if self._client is None:
            raise StoreUnavailable("not connected")
        try:
            return list(self._client.mget(keys)) if keys else []
        except _UNREACHABLE as exc:
            raise StoreUnavailable(str(exc)) from exc

    def put(self, items: list[tuple[str, bytes]], ttl_s: float | None) -> list[bool]:
        pipe = self._pipeline()
        px = max(1, int(ttl_s * 1000)) if ttl_s is not None else None
        for key, value in items:
            pipe.set(key, value, px=px)
        return [answer is True for answer in self._run(pipe, raise_on_error=False)]

    def remove(self, keys: list[str]) -> None:
        if keys and self._client is not None:
            try:
                self._client.delete(*keys)
            except _UNREACHABLE as exc:
                raise StoreUnavailable(str(exc)) from exc

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    @staticmethod
    def _run(pipe: redis.client.Pipeline, raise_on_error: bool = True) -> list:
        try:
            return pipe.execute(raise_on_error=raise_on_error)
        except _UNREACHABLE as exc:
            raise StoreUnavailable(str(exc)) from exc
