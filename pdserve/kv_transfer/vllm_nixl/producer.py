"""A pdserve prefill instance whose KV a vLLM decode instance (NixlConnector, 0.32, pull) reads.

vLLM's decoder reads blocks of vLLM-CPU's layout and size straight out of P's memory, with no grant, so P keeps a
mirror pool in that layout (one region per layer, registered with NIXL once) and copies a prompt's KV into it in
the step that finishes the prefill, before the answer naming the mirror blocks leaves. vLLM's side channel is a
ZMQ socket of its own that answers only vLLM's handshake request. The mirror blocks stay held (a lease in the
pull producer) until vLLM's read-done notification ``"<remote_request_id>:<readers>"``, or the lease runs out;
vLLM's heartbeats ``"HB:<ids>"`` renew it. Notifications are polled here, never by a NIXL progress thread.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import msgspec
import torch
import zmq
import zmq.asyncio

from pdserve.kv_transfer.data_plane.nixl_agent import NixlAgent
from pdserve.kv_transfer.pull_producer import PullProducer
from pdserve.kv_transfer.vllm_nixl.consumer import CPU_BACKEND
from pdserve.kv_transfer.vllm_nixl.layout import gather_into_mirror
from pdserve.kv_transfer.vllm_nixl.wire import GET_META_MSG, AgentMetadata, ModelShape, handshake_frames

log = logging.getLogger(__name__)

# While vLLM holds blocks here its notifications are polled this often; idle, rarely (nothing waits on them).
_BUSY_POLL_S = 0.002
_IDLE_POLL_S = 0.1
_HEARTBEAT = "HB:"
_MAX_REQUEST_BYTES = 4096  # vLLM's handshake request is a few bytes; anything large is not it


@dataclass(frozen=True, slots=True)
class MirrorConfig:
    host: str  # where vLLM's decoders reach the side channel
    port: int  # 0: any free port
    block_size: int  # vLLM's block size (tokens), as the vLLM decoders run
    num_blocks: int
    release: str  # the vLLM release the handshake answers as


@dataclass(frozen=True, slots=True)
class MirrorFill:
    """Copy a finished prefill's tokens from pdserve blocks into its mirror blocks (worker, end of the step)."""

    block_ids: tuple[int, ...]
    mirror_block_ids: tuple[int, ...]
    num_tokens: int


class VllmNixlProducer:
    """The mirror pool, vLLM's side channel and its notifications; runs on the transfer agent's loop."""

    def __init__(self, engine_id: str, shape: ModelShape, config: MirrorConfig, leases: PullProducer) -> None:
        self.engine_id = engine_id
        self.shape = shape
        self.config = config
        self.leases = leases
        self.nixl = NixlAgent(f"pdserve-{engine_id}-vllm-prefill")
        self.mirror: torch.Tensor | None = None
        self.port = 0
        self.refused = 0  # side-channel requests that were not vLLM's handshake
        self._meta: AgentMetadata | None = None
        self._socket: zmq.asyncio.Socket | None = None

    # -- engine thread -------------------------------------------------------------------------------------
    def allocate(self, pool: torch.Tensor) -> None:
        """The mirror: vLLM-CPU's cache shape for this model, ``[layers, blocks, heads, 2 * block_size * head_dim]``."""
        _, layers, _, heads, _, head_dim = pool.shape
        size = 2 * self.config.block_size * head_dim
        self.mirror = torch.zeros(layers, self.config.num_blocks, heads, size, dtype=pool.dtype)
        self.nixl.register([(self.mirror.data_ptr(), self.mirror.numel() * self.mirror.element_size())],
                           self.mirror.device)
        block_len = heads * size * pool.element_size()
        base = self.mirror.data_ptr()
        meta = AgentMetadata(
            engine_id=self.engine_id, agent_metadata=self.nixl.metadata(),
            kv_caches_base_addr=[base + layer * self.config.num_blocks * block_len for layer in range(layers)],
            device_id=0, num_blocks=self.config.num_blocks, block_lens=[block_len] * layers,
            block_strides=[block_len] * layers, kv_cache_layout="LBHNC", block_size=self.config.block_size,
            ssm_sizes=(0, 0), attn_backend_name=CPU_BACKEND, physical_blocks_per_logical_kv_block=1)
        self._meta = meta

    def fill(self, pool: torch.Tensor, fills: list[MirrorFill]) -> None:
        assert self.mirror is not None, "the mirror is allocated with the KV pool"
        for f in fills:
            gather_into_mirror(pool, list(f.block_ids), f.num_tokens, self.mirror, list(f.mirror_block_ids))

    # -- the agent's loop ----------------------------------------------------------------------------------
    def bind(self, ctx: zmq.asyncio.Context) -> None:
        self._socket = ctx.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, _MAX_REQUEST_BYTES)
        if self.config.port:
            self._socket.bind(f"tcp://{self.config.host}:{self.config.port}")
            self.port = self.config.port
        else:
            self.port = self._socket.bind_to_random_port(f"tcp://{self.config.host}")

    async def serve(self) -> None:
        """Forever: answer vLLM's handshake requests; anything else gets a one-frame refusal (a REQ socket
        waits for an answer) and changes nothing."""
        assert self._socket is not None
        while True:
            frames = await self._socket.recv_multipart()
            if len(frames) < 3:
                continue  # not from a REQ socket: there is no one to answer
            identity, body = frames[0], frames[-1]
            answer = self._answer(body)
            if answer is None:
                self.refused += 1
                log.warning("refused a request on vLLM's side channel that is not vLLM's handshake")
                answer = [msgspec.msgpack.encode("pdserve answers only vLLM 0.32's handshake (get_meta_msg, 0, 0)")]
            await self._socket.send_multipart([identity, b"", *answer])

    def _answer(self, body: bytes) -> list[bytes] | None:
        try:
            request = msgspec.msgpack.decode(body)
        except msgspec.DecodeError:
            return None
        if request != [GET_META_MSG, 0, 0] or self._meta is None:
            return None  # one pipeline and one tensor rank here; or the pool is not there yet
        return handshake_frames(self.shape, self.config.release, self._meta, time.perf_counter())

    async def poll(self) -> None:
        """Forever: vLLM's read-done notifications free the mirror blocks they name; its heartbeats renew them."""
        while True:
            await asyncio.sleep(_BUSY_POLL_S if self.leases.num_leases() else _IDLE_POLL_S)
            if self.mirror is None:
                continue
            for raw in self.nixl.notifications():
                self._on_notification(raw.decode(errors="replace"))

    def _on_notification(self, text: str) -> None:
        if text.startswith(_HEARTBEAT):
            self.leases.renew(text[len(_HEARTBEAT):].split(","))
            return
        key, _, readers = text.rpartition(":")
        if not key or not readers.isdigit():
            log.warning("ignored a NIXL notification that is not vLLM's: %r", text[:100])
            return
        # One reader (tp_size 1 is what this producer hands out): its notification ends the hold.
        self.leases.end_notified(key)

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close(linger=0)
