"""This process's NIXL agents, for the nixl data plane and for vLLM's NixlConnector alike: agent start, memory
registration, descriptor lists, transfers waited on until a deadline, and notifications.

NIXL's own progress thread busy-polls a whole core even when nothing moves, so an agent runs without it, and
progress happens only inside a transfer: the initiator polls the transfer's state (which progresses its side)
and a memory owner polls its notifications while it expects one. An idle instance then does no NIXL work.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from pdserve.kv_transfer.data_plane.base import DRAIN_S, DataPlaneError
from pdserve.kv_transfer.data_plane.one_sided import pause

NIXL_INSTALL_HINT = "pip install --no-deps nixl-cu12==1.5.1 nixl==1.5.1"
LOCAL = "NIXL_INIT_AGENT"  # the owner named when preparing this agent's own descriptors

# Notifications that arrived with no waiter yet (an owner answers a grant before the initiator starts) are
# kept, a bounded number of them, until their waiter comes.
_UNCLAIMED_NOTIFS = 4096

log = logging.getLogger(__name__)


class NixlUnavailable(DataPlaneError):
    """NIXL is not installed, or its UCX backend did not start."""


def memory_kind(device: torch.device) -> tuple[str, int]:
    """NIXL's memory type and device id for memory on `device`: a CUDA tensor is VRAM on its own GPU (the
    device id tells UCX which one), anything else is host memory, device 0.

    The VRAM branch is reached by vLLM's CUDA cache (`integrations/vllm/worker.py`) but has never run on a GPU:
    no host this was written on has one, so it is unverified."""
    if device.type == "cuda":
        return "VRAM", device.index if device.index is not None else 0
    return "DRAM", 0


def descriptors(starts: np.ndarray, length: int, device_id: int) -> np.ndarray:
    """NIXL's Nx3 form: (address, length, device id) per run."""
    starts = np.asarray(starts, dtype=np.int64)
    return np.stack([starts, np.full_like(starts, length), np.full_like(starts, device_id)], axis=1)


class NixlAgent:
    """One agent, used by transfer threads, writers and grant servers at once: NIXL's strict mode guards the
    agent, and one lock also keeps the notification bookkeeping whole."""

    def __init__(self, name: str) -> None:
        # UCX's InfiniBand module makes a process that created an agent crash at interpreter exit (inside the
        # wheel's bundled libnl) where libibverbs is installed; host memory moves by shared memory or TCP and
        # never needs it. Set before NIXL is imported, so UCX reads it when the agent starts.
        os.environ.setdefault("UCX_MODULES", "^ib")
        # UCX's memory events patch the process's mmap family in place as the agent starts, spinning on
        # sched_yield while it does: 0.4 s of system CPU per agent, nine tenths of its start. The events only keep
        # UCX's own registration cache true for memory it was never asked to register, and every region this
        # agent moves is registered explicitly (`register`), so they are off unless the deployment says otherwise.
        os.environ.setdefault("UCX_MEM_EVENTS", "no")
        try:
            from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t
        except ImportError as exc:
            raise NixlUnavailable(f"NIXL is not installed ({NIXL_INSTALL_HINT})") from exc
        config = nixl_agent_config(enable_prog_thread=False, backends=["UCX"],
                                   sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
        self.name = name
        _quiet_nixl_logs()
        with nixl_errors("agent start", NixlUnavailable):
            self.agent = nixl_agent(name, config)
        self._lock = threading.Lock()
        self._notifs: OrderedDict[bytes, None] = OrderedDict()

    def register(self, regions: list[tuple[int, int]], device: torch.device) -> Any:
        """Register (address, bytes) regions on `device` once; the handle deregisters them."""
        kind, device_id = memory_kind(device)
        with self._lock, nixl_errors("memory registration"):
            return self.agent.register_memory([(addr, n, device_id, "") for addr, n in regions], kind)

    def deregister(self, registration: Any) -> None:
        with self._lock, nixl_errors("memory deregistration"):
            self.agent.deregister_memory(registration)

    def metadata(self) -> bytes:
        with self._lock:
            return self.agent.get_agent_metadata()

    def add_peer(self, metadata: bytes) -> str:
        with self._lock, nixl_errors("connection to the peer's agent"):
            remote = self.agent.add_remote_agent(metadata)
        return remote.decode() if isinstance(remote, bytes) else str(remote)

    def remove_peer(self, remote: str) -> None:
        with self._lock, nixl_errors("removal of the peer's agent"):
            self.agent.remove_remote_agent(remote)

    def prepare(self, owner: str, descs: np.ndarray, device: torch.device) -> Any:
        """A descriptor list prepared once (`LOCAL` for this agent's memory), addressed later by index."""
        with self._lock, nixl_errors("descriptor preparation"):
            return self.agent.prep_xfer_dlist(owner, descs, memory_kind(device)[0])

    def release(self, handle: Any) -> None:
        """Release a prepared list. Best effort: it is released after a failure, which must not be hidden."""
        with self._lock:
            _release_quietly(handle)

    def prepped_transfer(self, op: str, local: Any, local_indices: np.ndarray, remote: Any,
                         remote_indices: np.ndarray, notif: bytes, deadline: float) -> None:
        """One READ or WRITE between prepared lists, by index. NIXL merges descriptors that follow each other on
        both sides into one run."""
        with self._lock, nixl_errors(op):
            handle = self.agent.make_prepped_xfer(op, local, local_indices, remote, remote_indices, notif)
        self._run(op, handle, deadline)

    def transfer(self, op: str, local: np.ndarray, remote: np.ndarray, peer: str, notif: bytes,
                 deadline: float, device: torch.device) -> None:
        """One READ or WRITE between descriptor lists used once (local memory on `device`, remote on the
        device each remote descriptor names)."""
        kind = memory_kind(device)[0]
        with self._lock, nixl_errors(op):
            handle = self.agent.initialize_xfer(op, self.agent.get_xfer_descs(local.astype(np.uint64), kind),
                                                self.agent.get_xfer_descs(remote.astype(np.uint64), kind), peer,
                                                notif)
        self._run(op, handle, deadline)

    def _run(self, op: str, handle: Any, deadline: float) -> None:
        """Post the transfer and poll it until done or the deadline; its handle is released either way.

        A transfer still posted at its deadline is waited out (up to `DRAIN_S` more) before the error is
        raised: UCX does not cancel it when its handle is released, and its remaining bytes would land when this
        agent next progresses, in memory the caller is about to give back (blocks D reuses after a failed push,
        D's own blocks after a failed read)."""
        try:
            with self._lock, nixl_errors(op):
                state = self.agent.transfer(handle)
            state = self._poll(op, handle, state, deadline)
            if state == "PROC":
                if self._poll(op, handle, state, time.monotonic() + DRAIN_S) == "PROC":
                    log.warning("a nixl %s past its deadline was still moving bytes %g s later", op, DRAIN_S)
                raise DataPlaneError(f"nixl {op} did not finish by its deadline")
            if state != "DONE":
                raise DataPlaneError(f"nixl {op} failed ({state})")
        finally:
            with self._lock:
                _release_quietly(handle)

    def _poll(self, op: str, handle: Any, state: str, deadline: float) -> str:
        """Poll a posted transfer until it leaves "PROC" or the deadline passes; the state it was last in."""
        attempt = 0
        while state == "PROC" and time.monotonic() <= deadline:
            time.sleep(pause(attempt))
            attempt += 1
            with self._lock, nixl_errors(op):
                state = self.agent.check_xfer_state(handle)
        return state

    def notifications(self) -> list[bytes]:
        """Notifications that arrived since the last call and no waiter claimed (polling also progresses the
        agent's connections)."""
        with self._lock:
            self._collect()
            out = list(self._notifs)
            self._notifs.clear()
        return out

    def await_notif(self, notif: bytes, deadline: float, peer_gone: Callable[[float], bool]) -> bool:
        """Progress this agent until `notif` arrives (True), or the deadline passes or `peer_gone(pause)` says
        the initiator gave up (False). `peer_gone` waits up to the pause it is given."""
        attempt = 0
        while time.monotonic() < deadline:
            with self._lock:
                self._collect()
                if notif in self._notifs:
                    del self._notifs[notif]
                    return True
            if peer_gone(pause(attempt)):
                return False
            attempt += 1
        return False

    def _collect(self) -> None:
        for messages in self.agent.get_new_notifs().values():
            for message in messages:
                self._notifs[message] = None
        while len(self._notifs) > _UNCLAIMED_NOTIFS:
            self._notifs.popitem(last=False)


def _quiet_nixl_logs() -> None:
    """NIXL's Python logger prints to stdout, where an instance announces its readiness: send its warnings to
    the process's own log handlers instead, and leave its per-agent INFO chatter out."""
    nixl_log = logging.getLogger("nixl")
    nixl_log.handlers.clear()
    nixl_log.propagate = True
    nixl_log.setLevel(logging.WARNING)


@contextmanager
def nixl_errors(what: str, error: type[DataPlaneError] = DataPlaneError) -> Iterator[None]:
    """NIXL's own errors (bare Exception subclasses) become DataPlaneError, which loads and pushes expect."""
    try:
        yield
    except DataPlaneError:
        raise
    except Exception as exc:  # noqa: BLE001 - every NIXL binding error derives from Exception alone
        raise error(f"nixl {what} failed: {type(exc).__name__}: {exc}") from exc


def _release_quietly(handle: Any) -> None:
    """A transfer abandoned at its deadline may refuse release while still posted; NIXL then frees it with the
    agent, and the deadline's error is the one worth reporting."""
    try:
        handle.release()
    except Exception:  # noqa: BLE001 - see above
        pass
