"""Mooncake's TransferEngine between any two instances: the peer reads (pull) or writes (push) the pool owner's
registered memory itself, after the owner granted it on tcp's listener (`one_sided.py`).

Each instance runs one engine with no metadata server (peers find each other's segment by a direct handshake on
the engine's RPC port, which rides in pdserve's own handshake) over Mooncake's TCP transport, and registers its
KV memory with it once (pdserve's pool, or vLLM's tensor per layer). A transfer is one asynchronous Mooncake batch
per run of adjacent memory (blocks, or layers of blocks), polled with a backoff until
done or its deadline: the engine's synchronous calls spin a core while they wait and have only the engine's
own timeout. Mooncake's TCP protocol acknowledges a write once it is applied at the owner, so a transfer that
completed here is complete there and the owner need not take part. Like NIXL, the engine serves any peer that
names a registered address; its listeners bind every interface, which is why the plane is chosen by name only.
"""

from __future__ import annotations

import os

# The engine logs every handshake and segment at INFO (and, over TCP, a missing RDMA device as a warning) on
# stderr next to the instance's own log: errors only, unless the operator says otherwise. It reads the level
# when its module loads.
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

import logging  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

from mooncake.engine import TransferEngine  # noqa: E402

from pdserve.kv_transfer.data_plane.base import DRAIN_S, DataPlaneError, refuse_device_memory  # noqa: E402
from pdserve.kv_transfer.data_plane.one_sided import (EngineChannel, GrantingPlane, KvLayout,  # noqa: E402
                                                      address_runs, pause)

log = logging.getLogger(__name__)

_DONE, _PENDING = 1, 0  # transfer_check_status: 1 done, 0 in flight, -1 failed, -2 timed out


class MooncakeEngine:
    """The instance's engine, shared by its channels (transfer threads, the push writer) and the plane; the
    engine takes calls from many threads at once."""

    def __init__(self, host: str) -> None:
        self.engine = TransferEngine()
        if self.engine.initialize(host, "P2PHANDSHAKE", "tcp", "") != 0:
            raise DataPlaneError("the Mooncake transfer engine did not start")
        self.session = f"{host}:{self.engine.get_rpc_port()}"

    def register(self, memory: list[tuple[int, int]]) -> None:
        for addr, nbytes in memory:
            if self.engine.register_memory(addr, nbytes) != 0:
                raise DataPlaneError("the Mooncake transfer engine did not register the KV memory")

    def transfer(self, peer: str, op: str, runs: list[tuple[int, int, int]], deadline: float) -> None:
        """One batch per run (a batch's status covers its first entry only), all polled until done or the
        deadline. A failure still waits for the other batches: the engine frees a batch only once it ended. A
        batch cannot be cancelled either: one still moving at the deadline is waited out (up to `DRAIN_S` more)
        before the error is raised, so the caller does not give back memory it is still moving bytes into."""
        submit = self.engine.batch_transfer_async_read if op == "read" else self.engine.batch_transfer_async_write
        pending, failed = [], 0
        for local, remote, length in runs:
            batch = submit(peer, [local], [remote], [length])
            if batch == 0:  # nothing was submitted (the peer's segment could not be opened, say)
                failed += 1
                break
            pending.append(batch)
        attempt, late = 0, False
        while pending:
            if time.monotonic() > deadline:
                if late:
                    log.warning("a mooncake %s past its deadline was still moving bytes %g s later", op, DRAIN_S)
                    break
                late, deadline = True, deadline + DRAIN_S
            time.sleep(pause(attempt))
            attempt += 1
            states = [(batch, self.engine.transfer_check_status(batch)) for batch in pending]
            pending = [batch for batch, state in states if state == _PENDING]
            failed += sum(state not in (_DONE, _PENDING) for _, state in states)
        if late:
            raise DataPlaneError(f"mooncake {op} did not finish by its deadline")
        if failed:
            raise DataPlaneError(f"mooncake {op} to {peer} failed")


class MooncakeChannel(EngineChannel):
    def __init__(self, engine: MooncakeEngine, session: str, *args: Any) -> None:
        super().__init__(*args)
        self.engine = engine
        self.session = session

    def move(self, op: str, local_ids: list[int], remote_ids: list[int], layer: int | None, tag: str,
             deadline: float) -> None:
        runs = address_runs(self.layout, local_ids, self.remote, remote_ids, layer)
        self.engine.transfer(self.session, op, runs, deadline)


class MooncakeDataPlane(GrantingPlane):
    name = "mooncake"

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        super().__init__(host, port)
        self.engine: MooncakeEngine | None = None

    def register(self, layout: KvLayout) -> None:
        refuse_device_memory(self.name, layout.device)
        self.engine = MooncakeEngine(self.host)
        self.engine.register(layout.memory())

    def local_info(self) -> dict[str, Any]:
        assert self.engine is not None
        return {**super().local_info(), "session": self.engine.session}

    def connect(self, info: dict[str, Any]) -> MooncakeChannel:
        remote = self.remote_layout(info)
        return MooncakeChannel(self.engine, str(info["session"]), str(info["host"]), int(info["port"]),
                               self.regions, self.layout, remote)
