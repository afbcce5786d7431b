"""This process's NIXL agent for talking to vLLM: made on first use, one staging area registered once.

The agent runs without NIXL's progress thread, which would busy-poll a core even when the instance is idle;
a transfer is progressed by polling its state while it is in flight, up to its deadline.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

import numpy as np
import torch

log = logging.getLogger(__name__)

Descriptor = tuple[int, int, int]  # (address, bytes, device id)


class NixlUnavailable(RuntimeError):
    """NIXL is not installed, or its UCX backend did not start."""


class NixlEndpoint:
    """Used from one thread at a time (the consumer serialises its reads; the producer polls on one loop)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._agent: Any = None
        self._lock = threading.Lock()
        self._staging: torch.Tensor | None = None
        self._registered: Any = None

    def agent(self) -> Any:
        with self._lock:
            if self._agent is None:
                # With InfiniBand's libraries present, a process that made a UCX agent crashes at exit unless
                # UCX leaves them out; this host-memory path never needs them.
                os.environ.setdefault("UCX_MODULES", "^ib")
                try:
                    from nixl._api import nixl_agent, nixl_agent_config
                except ImportError as exc:
                    raise NixlUnavailable("loading KV from vLLM needs NIXL (pip install nixl-cu12 nixl)") from exc
                self._agent = nixl_agent(self.name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
            return self._agent

    def staging(self, nbytes: int) -> torch.Tensor:
        """At least `nbytes` of registered host memory (registered again only if a peer needs more)."""
        if self._staging is None or self._staging.numel() < nbytes:
            agent = self.agent()
            if self._registered is not None:
                agent.deregister_memory(self._registered)
            self._staging = torch.empty(nbytes, dtype=torch.uint8)
            self._registered = agent.register_memory([(self._staging.data_ptr(), nbytes, 0, "")], "DRAM")
        return self._staging

    def register(self, memory: torch.Tensor) -> None:
        """Expose `memory` (contiguous host memory, kept alive by the caller) to peers' reads, once."""
        self.agent().register_memory([(memory.data_ptr(), memory.numel() * memory.element_size(), 0, "")], "DRAM")

    def metadata(self) -> bytes:
        """The agent's own blob, which a peer adds with add_remote_agent."""
        return self.agent().get_agent_metadata()

    def notifications(self) -> list[bytes]:
        """Notifications that arrived since the last call (polling also progresses the agent's connections)."""
        return [n for batch in self.agent().get_new_notifs().values() for n in batch]

    def add_peer(self, agent_metadata: bytes) -> str:
        name = self.agent().add_remote_agent(agent_metadata)
        return name.decode() if isinstance(name, bytes) else name

    def read(self, peer: str, remote: list[Descriptor], local: list[Descriptor], notification: bytes,
             deadline: float) -> None:
        """READ remote runs into local ones; `notification` reaches the peer when the read is complete."""
        agent = self.agent()
        handle = agent.initialize_xfer("READ", agent.get_xfer_descs(np.array(local, dtype=np.uint64), "DRAM"),
                                       agent.get_xfer_descs(np.array(remote, dtype=np.uint64), "DRAM"), peer,
                                       notification)
        try:
            state = agent.transfer(handle)
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise TimeoutError("the NIXL read did not complete in time")
                time.sleep(0.0002)
                state = agent.check_xfer_state(handle)
            if state != "DONE":
                raise ConnectionError(f"the NIXL read failed ({state})")
        finally:
            try:
                agent.release_xfer_handle(handle)
            except Exception as exc:  # noqa: BLE001 - an in-flight handle may refuse release; nothing else to do
                log.warning("could not release a NIXL transfer handle: %s", exc)

    def forget(self, peer: str) -> None:
        if self._agent is not None:
            self._agent.remove_remote_agent(peer)
