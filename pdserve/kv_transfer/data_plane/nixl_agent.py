"""One NIXL agent per instance: the registered pool, its prepared descriptor lists, and progress on demand.

NIXL's own progress thread busy-polls a whole core even when nothing moves, so the agent runs without it, and
progress happens only inside a transfer: the initiator polls the transfer's state (which progresses its side)
and the pool owner pumps its notifications while it has a granted transfer outstanding. An idle instance then
does no NIXL work at all.
"""

from __future__ import annotations

import os

# UCX's InfiniBand module makes a process that created an agent crash at interpreter exit (inside the wheel's
# bundled libnl) on hosts where libibverbs is installed; this plane moves bytes by shared memory or TCP and never
# needs it. Set before NIXL is imported, so UCX reads it when the agent starts.
os.environ.setdefault("UCX_MODULES", "^ib")

import logging  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from collections import OrderedDict  # noqa: E402
from collections.abc import Callable, Iterator  # noqa: E402
from contextlib import contextmanager  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t  # noqa: E402

from pdserve.kv_transfer.data_plane.base import DataPlaneError, check_block_ids  # noqa: E402

# Notifications that arrived with no waiter yet (the owner answers a grant before the initiator starts) are
# kept, a bounded number of them, until their waiter comes.
_UNCLAIMED_NOTIFS = 4096
# Polling backs off from a busy poll to this pause: short transfers finish in microseconds, long ones are not
# slowed by a millisecond, and a stalled one does not spin a core until its deadline.
_MAX_PAUSE_S = 0.001


def pause(attempt: int) -> float:
    return min(_MAX_PAUSE_S, 0.00001 * (2 ** min(attempt, 10))) if attempt else 0.0


class PoolLayout:
    """Where each block, and each layer of each block, of a contiguous pool lies: descriptor tuples for NIXL."""

    def __init__(self, addr: int, shape: list[int], element_size: int) -> None:
        self.addr = addr
        self.num_blocks, self.num_layers = shape[0], shape[1]
        self.block_bytes = int(np.prod(shape[1:])) * element_size
        self.layer_bytes = self.block_bytes // self.num_layers

    def block_descs(self) -> np.ndarray:
        starts = self.addr + np.arange(self.num_blocks, dtype=np.int64) * self.block_bytes
        return _descs(starts, self.block_bytes)

    def layer_descs(self) -> np.ndarray:
        """Index block * num_layers + layer: one layer of one block."""
        starts = self.addr + np.arange(self.num_blocks * self.num_layers, dtype=np.int64) * self.layer_bytes
        return _descs(starts, self.layer_bytes)

    def indices(self, block_ids: list[int], layer: int | None) -> np.ndarray:
        ids = np.asarray(block_ids, dtype=np.int64)
        return (ids if layer is None else ids * self.num_layers + layer).astype(np.int32)

    def check(self, block_ids: list[int], layer: int | None) -> None:
        check_block_ids(block_ids, self.num_blocks)
        if layer is not None and not 0 <= layer < self.num_layers:
            raise DataPlaneError(f"layer {layer} outside [0, {self.num_layers})")

    def size(self, block_ids: list[int], layer: int | None) -> int:
        return len(block_ids) * (self.block_bytes if layer is None else self.layer_bytes)


def _descs(starts: np.ndarray, length: int) -> np.ndarray:
    """NIXL's Nx3 form: (address, length, device id); host memory is device 0."""
    return np.stack([starts, np.full_like(starts, length), np.zeros_like(starts)], axis=1)


class PreparedSide:
    """One side's descriptor lists, prepared once: whole blocks and single layers of blocks."""

    def __init__(self, agent: nixl_agent, owner: str, layout: PoolLayout) -> None:
        self.layout = layout
        self.blocks = agent.prep_xfer_dlist(owner, layout.block_descs(), "DRAM")
        self.layers = agent.prep_xfer_dlist(owner, layout.layer_descs(), "DRAM")

    def handle(self, layer: int | None):
        return self.blocks if layer is None else self.layers

    def release(self) -> None:
        for handle in (self.blocks, self.layers):
            handle.release()


class NixlEndpoint:
    """The instance's agent, used by transfer threads, the push writer and the grant servers at once: NIXL's
    strict mode guards the agent, and one lock also keeps the notification bookkeeping whole."""

    def __init__(self, name: str) -> None:
        config = nixl_agent_config(enable_prog_thread=False, backends=["UCX"],
                                   sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
        self.name = name
        _quiet_nixl_logs()
        self.agent = nixl_agent(name, config)
        self.local: PreparedSide | None = None
        self._lock = threading.Lock()
        self._notifs: OrderedDict[bytes, None] = OrderedDict()
        self._remotes: dict[str, int] = {}  # remote agent -> channels using it

    def register(self, kv: torch.Tensor) -> PoolLayout:
        """Register the pool with NIXL once, and prepare its local descriptor lists."""
        if not (kv.device.type == "cpu" and kv.is_contiguous()):
            raise DataPlaneError("the nixl data plane needs a contiguous host KV pool")
        nbytes = kv.numel() * kv.element_size()
        with self._lock, nixl_errors("memory registration"):
            self.agent.register_memory([(kv.data_ptr(), nbytes, 0, "")], "DRAM")
            layout = PoolLayout(kv.data_ptr(), list(kv.shape), kv.element_size())
            self.local = PreparedSide(self.agent, "NIXL_INIT_AGENT", layout)
        return layout

    def metadata(self) -> bytes:
        with self._lock:
            return self.agent.get_agent_metadata()

    def add_peer(self, metadata: bytes, layout: PoolLayout) -> tuple[str, PreparedSide]:
        with self._lock, nixl_errors("connection to the peer's agent"):
            remote = self.agent.add_remote_agent(metadata)
            remote = remote.decode() if isinstance(remote, bytes) else str(remote)
            self._remotes[remote] = self._remotes.get(remote, 0) + 1
            return remote, PreparedSide(self.agent, remote, layout)

    def drop_peer(self, remote: str, side: PreparedSide) -> None:
        """Forget a peer's descriptor lists, and its agent when no channel uses it any more. Best effort: a
        channel is dropped after a failure, and a NIXL error here must not hide that failure."""
        with self._lock:
            self._remotes[remote] -= 1
            last = not self._remotes[remote]
            if last:
                del self._remotes[remote]
            try:
                side.release()
                if last:
                    self.agent.remove_remote_agent(remote)
            except Exception:  # noqa: BLE001 - see above
                pass

    def transfer(self, op: str, remote: PreparedSide, remote_ids: list[int], local_ids: list[int],
                 layer: int | None, notif: bytes, deadline: float) -> None:
        """One prepared READ or WRITE of runs of blocks (or one layer of them), polled until done or the
        deadline. NIXL merges descriptors that follow each other on both sides into one run."""
        assert self.local is not None
        with self._lock, nixl_errors(op):
            handle = self.agent.make_prepped_xfer(
                op, self.local.handle(layer), self.local.layout.indices(local_ids, layer), remote.handle(layer),
                remote.layout.indices(remote_ids, layer), notif)
            state = self.agent.transfer(handle)
        try:
            attempt = 0
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise DataPlaneError(f"nixl {op} did not finish by its deadline")
                time.sleep(pause(attempt))
                attempt += 1
                with self._lock, nixl_errors(op):
                    state = self.agent.check_xfer_state(handle)
            if state != "DONE":
                raise DataPlaneError(f"nixl {op} failed ({state})")
        finally:
            with self._lock:
                _release_quietly(handle)

    def await_notif(self, notif: bytes, deadline: float, peer_gone: Callable[[float], bool]) -> bool:
        """Progress this agent until `notif` arrives (True), or the deadline passes or `peer_gone(pause)` says
        the initiator gave up (False). `peer_gone` waits up to the pause it is given."""
        attempt = 0
        while time.monotonic() < deadline:
            with self._lock:
                for messages in self.agent.get_new_notifs().values():
                    for message in messages:
                        self._notifs[message] = None
                while len(self._notifs) > _UNCLAIMED_NOTIFS:
                    self._notifs.popitem(last=False)
                if notif in self._notifs:
                    del self._notifs[notif]
                    return True
            if peer_gone(pause(attempt)):
                return False
            attempt += 1
        return False


def _quiet_nixl_logs() -> None:
    """NIXL's Python logger prints to stdout, where an instance announces its readiness: send its warnings to
    the process's own log handlers instead, and leave its per-agent INFO chatter out."""
    nixl_log = logging.getLogger("nixl")
    nixl_log.handlers.clear()
    nixl_log.propagate = True
    nixl_log.setLevel(logging.WARNING)


@contextmanager
def nixl_errors(what: str) -> Iterator[None]:
    """NIXL's own errors (bare Exception subclasses) become DataPlaneError, which loads and pushes expect."""
    try:
        yield
    except DataPlaneError:
        raise
    except Exception as exc:  # noqa: BLE001 - every NIXL binding error derives from Exception alone
        raise DataPlaneError(f"nixl {what} failed: {type(exc).__name__}: {exc}") from exc


def _release_quietly(handle) -> None:
    """A transfer abandoned at its deadline may refuse release while still posted; NIXL then frees it with the
    agent, and the deadline's error is the one worth reporting."""
    try:
        handle.release()
    except Exception:  # noqa: BLE001 - see above
        pass
