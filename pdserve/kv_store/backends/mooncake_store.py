"""Mooncake Store: a master that keeps only metadata, objects in the global segments its clients mount.

`mooncake://MASTER_HOST:PORT[?local_hostname=...&metadata_server=...&protocol=tcp]`. This instance mounts
`capacity` bytes of its own memory as a segment (0: none; the segments of `mooncake_client` processes, which
outlive instances, or of other instances hold the objects). Objects are immutable (a second put of a key keeps
the first), leased while read, and evicted when the segments fill past the master's high watermark; meanwhile
puts fail, which the tier counts as refused. A master that restarts has forgotten every object.
"""

from __future__ import annotations

from urllib.parse import parse_qs, urlsplit

from pdserve.kv_store.backends.base import StoreBackend, StoreUnavailable

# Mooncake's error codes from its RPC failure on are the master's absence, not a refusal of the call.
RPC_FAIL = -900


class MooncakeBackend(StoreBackend):
    name = "mooncake"

    def __init__(self, config) -> None:
        super().__init__(config)
        self._store = None

    def connect(self) -> None:
        from mooncake.store import MooncakeDistributedStore

        self.close()
        url = urlsplit(self.config.url)
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        store = MooncakeDistributedStore()
        status = store.setup({
            "local_hostname": query.get("local_hostname", "127.0.0.1"),
            "metadata_server": query.get("metadata_server", "P2PHANDSHAKE"),
            "global_segment_size": self.config.capacity, "local_buffer_size": self.config.local_buffer,
            "protocol": query.get("protocol", "tcp"), "rdma_devices": query.get("rdma_devices", ""),
            "master_server_addr": f"{url.hostname}:{url.port or 50051}"})
        if status != 0:
            store.close()
            raise StoreUnavailable(f"Mooncake Store at {url.hostname}:{url.port}: setup failed ({status})")
        self._store = store

    def _client(self):
        if self._store is None:
            raise StoreUnavailable("not connected")
        return self._store

    def exists(self, keys: list[str]) -> list[bool]:
        answers = self._client().batch_is_exist(keys) if keys else []
        if any(a <= RPC_FAIL for a in answers):
            raise StoreUnavailable(f"Mooncake master unreachable ({min(answers)})")
        return [a == 1 for a in answers]

    def get(self, keys: list[str]) -> list[bytes | None]:
        # An absent object and a failed read both come back empty: either way the block is not there.
        return [value or None for value in self._client().get_batch(keys)] if keys else []

    def put(self, items: list[tuple[str, bytes]], ttl_s: float | None) -> list[bool]:
        # Mooncake objects do not expire: the TTL is the stored header's, checked on every read.
        store = self._client()
        status = store.put_batch([key for key, _ in items], [value for _, value in items])
        if status == 0:
            return [True] * len(items)
        if status <= RPC_FAIL:
            raise StoreUnavailable(f"Mooncake master unreachable ({status})")
        # A refused batch (a full store: no room until the master evicts) says nothing of which keys it took:
        # try each, to know.
        return [store.put(key, value) == 0 for key, value in items]

    def remove(self, keys: list[str]) -> None:
        if keys:
            self._client().batch_remove(keys, force=True)

    def close(self) -> None:
        if self._store is not None:
            self._store.close()
            self._store = None
