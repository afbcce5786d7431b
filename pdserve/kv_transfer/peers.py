"""Peers: the other instances this one talks to, their side-channel clients and their data channels.

A control client (one DEALER per peer address) carries every message and needs no handshake, so a release
always gets through. A data channel is opened only after a handshake (compatibility hash, engine id) and on
the data plane both sides offer; it is dropped after a failure, so the next transfer handshakes afresh.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

import zmq.asyncio

from pdserve.kv_transfer.data_plane import DataPlaneError, PeerChannel
from pdserve.kv_transfer.faults import FaultInjector
from pdserve.kv_transfer.layouts import Regrouper, translation_refused
from pdserve.kv_transfer.messages import Handshake, HandshakeReply, Message, Release
from pdserve.kv_transfer.peer_policy import PeerNotAllowed
from pdserve.kv_transfer.runtime import AgentRuntime
from pdserve.kv_transfer.side_channel import Capture, SideChannelClient

log = logging.getLogger(__name__)

Address = tuple[str, int]

# Under "auto", planes both sides offer are tried in this order: shared memory (only where it connects), NIXL,
# then TCP, which reaches anything routable. A plane not named here comes last.
AUTO_ORDER = ("shm", "nixl", "tcp")


def _auto_rank(name: str) -> int:
    return AUTO_ORDER.index(name) if name in AUTO_ORDER else len(AUTO_ORDER)


class TransferRefused(DataPlaneError):
    """The producer refused a transfer: ``refusal`` is "expired" (recompute) or "denied" (fail the request)."""

    def __init__(self, message: str, refusal: str) -> None:
        super().__init__(message)
        self.refusal = refusal


@dataclass(slots=True)
class Peer:
    """A handshaken instance: its identity and an open data channel."""

    engine_id: str
    channel: PeerChannel
    plane: str
    regrouper: Regrouper | None = None  # set when its blocks are in another engine's layout (reads regroup them)


class Peers:
    """Owns every connection to other instances. Used on the agent's loop only."""

    def __init__(self, rt: AgentRuntime, capture: Capture) -> None:
        self.rt = rt
        self.capture = capture
        self._ctx: zmq.asyncio.Context | None = None
        self._clients: dict[Address, SideChannelClient] = {}
        self._peers: dict[Address, Peer] = {}
        self._locks: dict[Address, asyncio.Lock] = {}
        self._allowed: set[str] = set()  # hosts that passed the allow-list (a name is resolved once)

    def start(self, ctx: zmq.asyncio.Context) -> None:
        self._ctx = ctx

    async def peer(self, host: str, port: int, expected_engine_id: str | None) -> Peer:
        """A handshaken connection to the instance at host:port, refreshed if its engine id changed."""
        address = (host, port)
        async with self._locks.setdefault(address, asyncio.Lock()):
            peer = self._peers.get(address)
            if peer is not None and expected_engine_id not in (None, peer.engine_id):
                self.drop(address)  # the producer restarted: never read from its predecessor
                peer = None
            if peer is None:
                peer = self._peers[address] = await self._handshake_with(host, port)
            if expected_engine_id not in (None, peer.engine_id):
                raise TransferRefused(f"the instance at {host}:{port} is engine {peer.engine_id}, not "
                                      f"{expected_engine_id} named by the transfer parameters", "denied")
            return peer

    def _client(self, host: str, port: int) -> SideChannelClient:
        """The control connection to a peer; messages on it need no handshake (a release must always get through)."""
        address = (host, port)
        client = self._clients.get(address)
        if client is None:
            client = self._clients[address] = SideChannelClient(self._ctx, host, port, self.rt.faults, self.capture)
        return client

    async def _allowed_client(self, host: str, port: int) -> SideChannelClient:
        """The control connection, once `host` passed the allow-list: every dial to a peer starts here."""
        if host not in self._allowed:
            try:
                await self.rt.config.peers.check(host)
            except PeerNotAllowed as exc:
                raise TransferRefused(str(exc), "denied") from exc
            self._allowed.add(host)
        return self._client(host, port)

    async def request(self, host: str, port: int, message: Message) -> Message:
        """One request on the control connection, with the agent's message deadline."""
        client = await self._allowed_client(host, port)
        return await client.request(message, self.rt.config.message_timeout_s)

    async def release(self, host: str, port: int, key: str, token: str, reason: str) -> None:
        """Ask a producer to free a transfer now. Best effort: its lease (or deadline) is the backstop."""
        try:
            await self.request(host, port, Release(key=key, token=token, reason=reason))
        except Exception as exc:  # noqa: BLE001 - a release is best effort: the lease is the backstop
            log.warning("could not release %s at %s:%d (%s); its lease will expire", key, host, port, exc)

    async def notify(self, host: str, port: int, message: Message) -> None:
        """Deliver a notice whose loss the receiver's own deadline covers."""
        try:
            await self.request(host, port, message)
        except Exception as exc:  # noqa: BLE001 - the receiver's deadline covers an undelivered notice
            log.warning("could not deliver %s to %s:%d: %s", type(message).__name__, host, port, exc)

    async def _handshake_with(self, host: str, port: int) -> Peer:
        config = self.rt.config
        client = await self._allowed_client(host, port)
        reply = await client.request(Handshake(engine_id=config.engine_id, compat_hash=config.compat_hash,
                                               layout=config.layout), config.handshake_timeout_s)
        if not isinstance(reply, HandshakeReply):
            raise DataPlaneError(f"unexpected handshake reply from {host}:{port}: {reply}")
        if not reply.ok:
            raise DataPlaneError(reply.error or "compatibility hash mismatch")
        regrouper = None
        if reply.compat_hash != config.compat_hash:
            refused = translation_refused(config.layout, reply.layout)
            if refused:
                raise DataPlaneError(f"incompatible KV at {host}:{port}: {refused}")
            regrouper = Regrouper(config.layout, reply.layout)
        plane_name, channel = await self._connect(reply.data_plane_info, staged=regrouper is not None)
        return Peer(reply.engine_id, channel, plane_name, regrouper)

    async def _connect(self, offered: dict[str, Any], staged: bool) -> tuple[str, PeerChannel]:
        """A channel on the first candidate plane that actually connects (one that stages reads when the peer's
        blocks must be regrouped).

        Under "auto" nothing the peer says about itself decides: two network namespaces on one kernel share the
        boot id, yet neither reaches the other's abstract socket, so shm is chosen by connecting it.
        """
        failures = []
        planes = self.rt.config.planes
        for name in self._candidates(offered):
            if staged and not planes[name].stages_reads:
                failures.append(f"{name}: cannot read another engine's layout")
                continue
            try:
                return name, await self.rt.off_loop(planes[name].connect, offered[name])
            except (DataPlaneError, OSError) as exc:
                failures.append(f"{name}: {exc}")
        raise DataPlaneError(f"no data plane to the peer connected ({'; '.join(failures)})")

    def _candidates(self, offered: dict[str, Any]) -> list[str]:
        """The planes to try in order: the configured one, or under "auto" every plane both sides offer."""
        preferred, planes = self.rt.config.preferred_plane, self.rt.config.planes
        if preferred != "auto":
            if preferred not in offered or preferred not in planes:
                raise DataPlaneError(f"the peer does not offer the {preferred} data plane")
            return [preferred]
        common = sorted((name for name in planes if name in offered), key=_auto_rank)
        if not common:
            raise DataPlaneError("no data plane in common with the peer")
        return common

    async def on_handshake(self, message: Handshake) -> HandshakeReply:
        """Answer a peer's handshake: our identity, and how to reach our pool on each data plane."""
        config = self.rt.config
        info = {name: plane.local_info() for name, plane in config.planes.items()}
        # Another engine's layout is the reader's to regroup; we only check that it can.
        refused = "" if message.compat_hash == config.compat_hash else translation_refused(config.layout,
                                                                                          message.layout)
        if refused:
            self.rt.stats.handshake_refusals += 1
        error = (f"incompatible instances: model, dtype, KV layout, block size or protocol version differ "
                 f"(compatibility hash mismatch; {refused})") if refused else ""
        return HandshakeReply(ok=not refused, engine_id=config.engine_id, compat_hash=config.compat_hash,
                              layout=config.layout, data_plane_info=info, error=error)

    def drop(self, address: Address) -> None:
        """Forget a peer's data channel after a failure: the next transfer handshakes afresh.

        The control connection stays: ZeroMQ reconnects it by itself, and other transfers' heartbeats, releases
        and loads are waiting on it; closing it would fail them all for one peer's slow answer.
        """
        peer = self._peers.pop(address, None)
        if peer is not None:
            peer.channel.close()

    def set_faults(self, faults: FaultInjector) -> None:
        for client in list(self._clients.values()):
            client.sender.faults = faults

    def close(self) -> None:
        for address in list(self._peers):
            self.drop(address)
        for client in self._clients.values():
            client.close()
        self._clients.clear()
