"""A pdserve decode instance loading a prompt's KV from a vLLM prefill instance (NixlConnector, pull).

Handshake on vLLM's side channel (its version and the model checked through its compatibility hash, its memory
checked against this model's shape), then one NIXL READ of the request's vLLM blocks, all layers, into the
staging area; the read carries vLLM's read-done notification, so P frees its blocks as soon as they are read.
The staged tokens are regrouped into pdserve blocks. Any failure ends the load as failed (the request
recomputes or fails, as `kv_load_failure_policy` says), and P is told to free whatever it still holds for it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec
import numpy as np
import torch
import zmq

from pdserve.kv_transfer.data_plane.nixl_agent import NixlAgent, descriptors
from pdserve.kv_transfer.data_plane.regions import DataPlaneError
from pdserve.kv_transfer.peer_policy import PeerNotAllowed
from pdserve.kv_transfer.runtime import AgentRuntime, LoadResult
from pdserve.kv_transfer.vllm_nixl.layout import covering_blocks, scatter_into_pool, staging_view
from pdserve.kv_transfer.vllm_nixl.wire import (GET_META_MSG, AgentMetadata, HandshakePayload, ModelShape,
                                                VersionRefused, identify_release, read_done)

if TYPE_CHECKING:
    from pdserve.kv_transfer.pull_consumer import LoadJob

log = logging.getLogger(__name__)

# The only layout read here: vLLM-CPU's attention backend (GPU backends lay their caches out differently).
CPU_BACKEND = "CPU_ATTN"
_EXPECTED = (OSError, TimeoutError, ConnectionError, ValueError, zmq.ZMQError, msgspec.DecodeError, DataPlaneError)
_HOST = torch.device("cpu")


class HandshakeFailed(ConnectionError):
    """vLLM's side channel did not answer as vLLM 0.32 does."""


@dataclass(frozen=True, slots=True)
class VllmPeer:
    engine_id: str
    agent: str  # the peer's NIXL agent name, once added
    meta: AgentMetadata


class VllmNixlConsumer:
    """Owns vLLM peers and the reads from them. Runs on the transfer agent's loop; reads run on its executor."""

    def __init__(self, rt: AgentRuntime, shape: ModelShape, max_model_len: int) -> None:
        self.rt = rt
        self.shape = shape
        self.max_model_len = max_model_len
        self.nixl = NixlAgent(f"pdserve-{rt.config.engine_id}")
        self._staging: torch.Tensor | None = None  # one area, registered once (again only if it must grow)
        self._registration = None
        self._peers: dict[tuple[str, int], VllmPeer] = {}
        self._read_lock = asyncio.Lock()  # one staging area: one read at a time
        self._peer_lock = asyncio.Lock()  # one handshake per peer, however many loads wait for it

    async def load(self, job: LoadJob, finish: Callable[[LoadJob, LoadResult], None]) -> None:
        started = time.monotonic()
        deadline = started + job.deadline_s
        try:
            nbytes = await self._load(job, deadline)
        except Exception as exc:  # noqa: BLE001 - any failure must fail this load, never strand the request
            error = f"{type(exc).__name__}: {exc}"
            log.log(logging.WARNING if isinstance(exc, _EXPECTED) else logging.ERROR,
                    "KV load for %s from vLLM at %s:%d failed: %s", job.request_id, job.host, job.port, error,
                    exc_info=not isinstance(exc, _EXPECTED))
            self.rt.stats.loads_failed += 1
            finish(job, LoadResult(job.request_id, ok=False, error=error, started_at=started))
            await self.release(job.host, job.port, job.engine_id, job.key, handshake=False)
            return
        seconds = time.monotonic() - started
        self.rt.stats.count_load(nbytes, seconds)
        finish(job, LoadResult(job.request_id, ok=True, nbytes=nbytes, seconds=seconds, plane="vllm-nixl",
                               started_at=started))

    async def _load(self, job: LoadJob, deadline: float) -> int:
        peer = await self._peer(job.host, job.port, job.engine_id)
        async with self._read_lock:
            if time.monotonic() > deadline:
                raise TimeoutError("the load's deadline passed while it waited for the staging area")
            try:
                return await self.rt.off_loop(self._read, peer, job, deadline)
            except (ConnectionError, TimeoutError, DataPlaneError):
                self._drop((job.host, job.port))
                raise

    def _read(self, peer: VllmPeer, job: LoadJob, deadline: float) -> int:
        meta, pool = peer.meta, self.rt.pool
        wanted = covering_blocks(job.remote_block_ids, meta.block_size, job.first_token, job.num_tokens)
        if any(b >= meta.num_blocks for b in wanted.block_ids):
            raise ValueError("kv_transfer_params name blocks the vLLM instance does not have")
        block_len, count = meta.block_lens[0], len(wanted.block_ids)
        staging = self._staging_area(meta)
        blocks = np.asarray(wanted.block_ids, dtype=np.int64)
        remote = np.concatenate([base + blocks * meta.block_strides[layer]
                                 for layer, base in enumerate(meta.kv_caches_base_addr)])
        local = staging.data_ptr() + np.arange(len(remote), dtype=np.int64) * block_len  # layer-major, as remote
        self.nixl.transfer("READ", descriptors(local, block_len, 0),
                           descriptors(remote, block_len, meta.device_id), peer.agent, read_done(job.key),
                           deadline, _HOST)
        scatter_into_pool(staging_view(staging, pool, count, meta.block_size), pool, list(job.local_block_ids),
                          wanted.skip, wanted.count)
        return len(remote) * block_len

    def _notify(self, peer: VllmPeer, key: str) -> None:
        """Deliver the read-done notification on a one-block read: a bare NIXL notification is not sent
        without a progress thread (or before a connection exists), a read is progressed here to completion."""
        meta = peer.meta
        staging = self._staging_area(meta)
        self.nixl.transfer("READ", descriptors(np.array([staging.data_ptr()]), meta.block_lens[0], 0),
                           descriptors(np.array([meta.kv_caches_base_addr[0]]), meta.block_lens[0], meta.device_id),
                           peer.agent, read_done(key), time.monotonic() + self.rt.config.message_timeout_s, _HOST)

    def _staging_area(self, meta: AgentMetadata) -> torch.Tensor:
        """Room for every layer of the vLLM blocks one prompt can span (its tokens may straddle one more):
        registered host memory, registered again only if a peer needs more."""
        blocks = -(-self.max_model_len // meta.block_size) + 1
        nbytes = len(meta.kv_caches_base_addr) * blocks * meta.block_lens[0]
        if self._staging is None or self._staging.numel() < nbytes:
            if self._registration is not None:
                self.nixl.deregister(self._registration)
                self._registration = None
            self._staging = torch.empty(nbytes, dtype=torch.uint8)
            self._registration = self.nixl.register([(self._staging.data_ptr(), nbytes)], _HOST)
        return self._staging

    async def release(self, host: str, port: int, engine_id: str, key: str, handshake: bool = True) -> None:
        """Tell vLLM P it may free this request's blocks now (its lease is the backstop if this fails)."""
        try:
            peer = await self._peer(host, port, engine_id) if handshake else self._peers.get((host, port))
            if peer is not None:
                async with self._read_lock:
                    await self.rt.off_loop(self._notify, peer, key)
        except Exception as exc:  # noqa: BLE001 - best effort: P's lease frees the blocks anyway
            log.warning("could not tell vLLM at %s:%d to free %s (%s); its lease will", host, port, key, exc)

    # -- peers ---------------------------------------------------------------------------------------------
    async def _peer(self, host: str, port: int, engine_id: str) -> VllmPeer:
        async with self._peer_lock:
            return await self._peer_locked(host, port, engine_id)

    async def _peer_locked(self, host: str, port: int, engine_id: str) -> VllmPeer:
        address = (host, port)
        peer = self._peers.get(address)
        if peer is not None and peer.engine_id != engine_id:
            self._drop(address)  # P restarted: never read from its predecessor
            peer = None
        if peer is None:
            try:
                await self.rt.config.peers.check(host)
            except PeerNotAllowed as exc:
                raise HandshakeFailed(str(exc)) from exc
            meta = await self.rt.off_loop(self._handshake, host, port)
            if meta.engine_id != engine_id:
                raise HandshakeFailed(f"the vLLM instance at {host}:{port} is engine {meta.engine_id}, not "
                                      f"{engine_id} named by the transfer parameters")
            self._check_memory(meta)
            agent = await self.rt.off_loop(self.nixl.add_peer, meta.agent_metadata)
            peer = self._peers[address] = VllmPeer(meta.engine_id, agent, meta)
        return peer

    def _handshake(self, host: str, port: int) -> AgentMetadata:
        """One request on vLLM's side channel, exactly as vLLM's own decode instances send it."""
        timeout_ms = int(self.rt.config.handshake_timeout_s * 1000)
        with zmq.Context.instance().socket(zmq.REQ) as sock:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
            sock.setsockopt(zmq.SNDTIMEO, timeout_ms)
            sock.connect(f"tcp://{host}:{port}")
            sock.send(msgspec.msgpack.encode((GET_META_MSG, 0, 0)))
            try:
                frames = sock.recv_multipart()
            except zmq.Again:
                raise HandshakeFailed(f"no handshake answer from {host}:{port} within "
                                      f"{self.rt.config.handshake_timeout_s:g} s") from None
        if len(frames) != 2:
            raise HandshakeFailed(f"the handshake answer from {host}:{port} is not vLLM's (two frames)")
        try:
            payload = msgspec.msgpack.decode(frames[0], type=HandshakePayload)
            meta = msgspec.msgpack.decode(payload.agent_metadata_bytes, type=AgentMetadata)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise HandshakeFailed(f"the handshake answer from {host}:{port} is not vLLM 0.32's: {exc}") from None
        try:
            release = identify_release(self.shape, meta.attn_backend_name, payload.compatibility_hash)
        except VersionRefused as exc:
            raise HandshakeFailed(str(exc)) from None
        log.info("handshake with vLLM %s at %s:%d (engine %s)", release, host, port, meta.engine_id)
        return meta

    def _check_memory(self, meta: AgentMetadata) -> None:
        """vLLM's regions must be this model's KV in the CPU layout, one region per layer."""
        pool = self.rt.pool
        _, layers, _, heads, _, head_dim = pool.shape
        block_len = heads * 2 * meta.block_size * head_dim * pool.element_size()
        problems = []
        if meta.attn_backend_name != CPU_BACKEND:
            problems.append(f"attention backend {meta.attn_backend_name} (only {CPU_BACKEND}'s layout is read)")
        if len(meta.kv_caches_base_addr) != layers or len(meta.block_strides) != layers:
            problems.append(f"{len(meta.kv_caches_base_addr)} KV regions for {layers} layers")
        if any(n != block_len for n in meta.block_lens) or any(s < block_len for s in meta.block_strides):
            problems.append(f"blocks of {meta.block_lens[:1]} bytes, expected {block_len}")
        if pool.dtype == torch.bfloat16:
            problems.append("bfloat16 (vLLM-CPU may tile bfloat16 keys for AMX, a layout not read here)")
        if (meta.physical_blocks_per_logical_kv_block, meta.dcp_size, meta.pcp_size) != (1, 1, 1):
            problems.append("split or context-parallel blocks")
        if problems:
            raise HandshakeFailed("the vLLM instance's KV memory cannot be read: " + "; ".join(problems))

    def _drop(self, address: tuple[str, int]) -> None:
        peer = self._peers.pop(address, None)
        if peer is not None:
            try:
                self.nixl.remove_peer(peer.agent)
            except Exception as exc:  # noqa: BLE001 - a peer that cannot be forgotten is re-added on next use
                log.warning("could not remove vLLM's NIXL agent %s: %s", peer.agent, exc)
