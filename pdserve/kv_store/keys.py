"""Store keys: a chained content hash of a block's token ids, rooted in what its KV bytes mean.

A block's key is `pdserve-kv:<namespace>:<hash>`, where the hash chains the parent block's hash and this
block's token ids (and media hashes, as the prefix cache does), and the first block's parent is the namespace's
digest: the model's weights, the dtype, the block size, the stored layout and its geometry. Two instances of the
same model, dtype and block size therefore name a prefix alike whatever their engine (pdserve or vLLM-CPU), and
KV of another model, dtype, block size or layout can never be found under a prompt's keys.

Stored blocks are always in pdserve's block layout (`[layers, 2, kv_heads, block_size, head_dim]`), whichever
engine wrote them: a vLLM-CPU instance regroups its blocks into it when it writes and out of it when it reads,
so one key serves both engines.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field, fields

from pdserve.engine.block_pool import BlockHash, hash_block

KEY_PREFIX = "pdserve-kv"
STORE_LAYOUT = "pdserve-block:layers,kv,heads,block_size,head_dim"
FORMAT_VERSION = 1


@dataclass(frozen=True, slots=True)
class Namespace:
    model: str  # the weights' fingerprint (or "name:<served model>" where the weights cannot be read)
    dtype: str  # torch's name, e.g. "torch.float32"
    block_size: int
    num_layers: int
    kv_heads: int
    head_dim: int
    itemsize: int
    layout: str = STORE_LAYOUT
    version: int = FORMAT_VERSION
    digest: bytes = field(init=False, compare=False)

    def __post_init__(self) -> None:
        identity = {f.name: getattr(self, f.name) for f in fields(self) if f.init}
        text = json.dumps(identity, sort_keys=True).encode()
        object.__setattr__(self, "digest", hashlib.blake2b(text, digest_size=16).digest())

    @property
    def block_bytes(self) -> int:
        return self.num_layers * 2 * self.kv_heads * self.block_size * self.head_dim * self.itemsize

    @property
    def tag(self) -> str:
        return self.digest.hex()[:16]

    def root(self, salt: str = "") -> BlockHash:
        """The chain's root: prompts with a cache salt (vLLM's `cache_salt`) share only with the same salt."""
        return hash_block(self.digest, [], salt.encode()) if salt else self.digest

    def key(self, block_hash: BlockHash) -> str:
        return f"{KEY_PREFIX}:{self.tag}:{block_hash.hex()}"


class BlockChain:
    """One request's store keys, block by block, extended as its tokens grow (the prompt, then its output)."""

    __slots__ = ("namespace", "root", "hashes")

    def __init__(self, namespace: Namespace, salt: str = "") -> None:
        self.namespace = namespace
        self.root = namespace.root(salt)
        self.hashes: list[BlockHash] = []

    def extend(self, num_full: int, tokens_of: Callable[[int, int], list[int]],
               extra_of: Callable[[int], bytes] = lambda _: b"") -> None:
        """Hash blocks up to `num_full`; `tokens_of(start, end)` reads the request's token ids, `extra_of(i)`
        the media hashes that change what block i's tokens mean."""
        bs = self.namespace.block_size
        while len(self.hashes) < num_full:
            i = len(self.hashes)
            self.hashes.append(hash_block(self.parent(i), tokens_of(i * bs, (i + 1) * bs), extra_of(i)))

    def parent(self, index: int) -> BlockHash:
        return self.hashes[index - 1] if index else self.root

    def key(self, index: int) -> str:
        return self.namespace.key(self.hashes[index])
