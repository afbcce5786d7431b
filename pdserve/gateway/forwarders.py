"""PD protocols: one Forwarder per protocol, each owning its leg bodies, its dispatch pattern and what passes
between legs (as Llumnix's forwarder registry does)."""

from __future__ import annotations

import asyncio
import time
from abc import ABC, abstractmethod
from typing import Any, ClassVar

from pdserve.gateway.call import Call, LegError, Stage
from pdserve.gateway.registry import Instance
from pdserve.ids import TransferId
from pdserve.kv_transfer import params as kv

_PREFILL_DROPPED = ("stream_options", "min_tokens", "min_completion_tokens")


class Forwarder(ABC):
    name: ClassVar[str]
    dispatch: ClassVar[str]  # "single", "serial" or "parallel"
    scheduling_modes: ClassVar[frozenset[str]]
    roles: ClassVar[tuple[str, ...]]  # which kinds of instance a request needs
    single_prompt: ClassVar[bool] = True  # kv_transfer_params carry one prompt's KV: a prompt list is split

    @abstractmethod
    async def run(self, call: Call) -> None:
        """Run one attempt: the legs, in this protocol's order, ending with the client's answer."""

    def describe(self) -> str:
        return f"{self.name} ({self.dispatch}; scheduling: {', '.join(sorted(self.scheduling_modes))})"


def prefill_body(body: dict[str, Any], transfer_id: TransferId, push: bool = False, vllm: bool = False
                 ) -> dict[str, Any]:
    """vLLM NIXL's prefill leg: one token, no stream, no min_tokens, and a request to hold the KV (or push it;
    `vllm`: in vLLM NixlConnector's shape, for a vLLM decoder).

    One sample too: P prefills the prompt once, and D draws the n samples from the same KV.
    """
    out = dict(body)
    for key in _PREFILL_DROPPED:  # a few keys, not a pass over every field of the body
        out.pop(key, None)
    out["max_tokens"] = 1
    if "n" in body:
        out["n"] = 1
    if "max_completion_tokens" in body:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out["kv_transfer_params"] = kv.RemoteDecode(transfer_id, push, vllm).to_wire()
    return out


def _reads_vllm_nixl(decode: Instance | None) -> bool:
    return decode is not None and decode.caps is not None and decode.caps.is_vllm_nixl


def with_kv_params(body: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    return {**body, "kv_transfer_params": params}


async def served_by_decode_alone(call: Call, decode: Instance) -> bool:
    """Conditional disaggregation: when a remote prefill does not pay, D prefills itself (and this answers); and
    so after an instance refused the KV parameters the gateway wrote (`call.without_kv`)."""
    if not call.without_kv and call.gateway.conditional.use_remote_prefill(call.body, decode, call.prompt):
        return False
    await call.relay("decode", decode, call.body)
    return True


class Colocated(Forwarder):
    name = "colocated"
    dispatch = "single"
    scheduling_modes = frozenset({"batch", "staged"})
    roles = ("both",)
    single_prompt = False  # the instance answers a prompt list itself

    async def run(self, call: Call) -> None:
        await call.relay("colocated", call.pick("both"), call.body)


class Pull(Forwarder):
    """Serial, vLLM NIXL style: P prefills and holds, then D pulls P's blocks with the parameters P returned."""

    name = "pull"
    dispatch = "serial"
    scheduling_modes = frozenset({"batch", "staged"})
    roles = ("prefill", "decode")

    async def run(self, call: Call) -> None:
        gw = call.gateway
        staged = gw.scheduling == "staged" and not call.without_kv
        decode = None if staged else call.pick("decode")
        if decode is not None and await served_by_decode_alone(call, decode):
            return
        prefill = call.pick("prefill", decode)
        call.stage = Stage.PREFILL_SENT
        started = time.monotonic()
        answer = await call.call_prefill("prefill", prefill, prefill_body(call.body, call.transfer_id,
                                                                          vllm=_reads_vllm_nixl(decode)),
                                         gw.deadlines.prefill_s)
        call.timings["prefill"] = time.monotonic() - started
        call.timings["kv_ready"] = time.monotonic() - call.started
        params = answer.kv_transfer_params
        if decode is None:
            decode = call.pick("decode", prefill)  # staged: chosen now, on the freshest load
        if not isinstance(params, dict) or not params.get("do_remote_prefill"):
            # Visible, not silent: counted, and D computes the prompt itself.
            gw.metrics.decision("local_prefill", "prefill_returned_no_kv_params")
            await call.relay("decode", decode, call.body)
            return
        if _reads_vllm_nixl(decode) and "transfer_token" in params:
            # Staged: D was chosen after P answered in pdserve's shape, which a vLLM decoder cannot read.
            gw.release_kv(prefill, params, call.transfer_id)
            gw.metrics.decision("local_prefill", "kv_params_not_vllm_shaped")
            await call.relay("decode", decode, call.body)
            return
        call.held = (prefill, params)
        call.prefill_usage = answer.usage
        call.stage = Stage.KV_HELD
        call.stage = Stage.DECODE_SENT
        await call.relay("decode", decode, with_kv_params(call.body, params))


class DecodeFirst(Forwarder):
    """Single stage (Llumnix vllm-kvt style): only D gets the request, with P's address; D asks P to prefill."""

    name = "decode-first"
    dispatch = "single"
    scheduling_modes = frozenset({"batch"})
    roles = ("prefill", "decode")

    async def run(self, call: Call) -> None:
        decode = call.pick("decode")
        if await served_by_decode_alone(call, decode):
            return
        prefill = call.pick("prefill", decode)
        params = kv.DecodeFirst(prefill.url, call.transfer_id).to_wire()
        call.stage = Stage.DECODE_SENT
        await call.relay("decode", decode, with_kv_params(call.body, params))


# After D answered, how long a push waits for P's own reply before dropping it (P's KV is already written).
_PREFILL_REPLY_GRACE_S = 2.0


class Push(Forwarder):
    """Parallel (MoRIIO WRITE / Mooncake style): P and D get the request at once, joined by the transfer_id.

    D registers its blocks with P's side channel and P writes each layer as it is computed. If either leg
    fails before the client saw a byte, the other is cancelled and the request retried on a fresh pair.
    """

    name = "push"
    dispatch = "parallel"
    scheduling_modes = frozenset({"batch"})
    roles = ("prefill", "decode")

    async def run(self, call: Call) -> None:
        gw = call.gateway
        decode = call.pick("decode")
        if await served_by_decode_alone(call, decode):
            return
        prefill = call.pick("prefill", decode)
        side = prefill.caps.side_channel if prefill.caps is not None else None
        if side is None:
            raise LegError("prefill", "no_side_channel", f"{prefill.url} has no KV side channel", instance=prefill)
        p_body = prefill_body(call.body, call.transfer_id, push=True)
        d_params = kv.RemotePrefill(
            engine_id=side.engine_id, host=side.host, port=side.port,
            remote_key=None, block_ids=None, token=None, transfer_id=call.transfer_id, mode="push").to_wire()
        call.stage = Stage.DECODE_SENT
        prefill_leg = asyncio.ensure_future(call.call_prefill("prefill", prefill, p_body, gw.deadlines.prefill_s))
        prefill_leg.add_done_callback(lambda leg: _take_prefill_usage(call, leg))
        decode_leg = asyncio.ensure_future(call.relay("decode", decode, with_kv_params(call.body, d_params)))
        try:
            await asyncio.wait({prefill_leg, decode_leg}, return_when=asyncio.FIRST_COMPLETED)
            if prefill_leg.done() and prefill_leg.exception() is not None and not decode_leg.done():
                if not call.first_byte_sent:
                    raise prefill_leg.exception()  # cancel D (finally) and let the gateway retry
                # D already answers the client: tell it the KV will not come, so it computes locally now.
                gw.release_transfer(decode, call.transfer_id)
            await decode_leg
            # The client has its answer; P's reply (its usage) normally follows within a moment.
            await asyncio.wait({prefill_leg}, timeout=_PREFILL_REPLY_GRACE_S)
        finally:
            for leg in (prefill_leg, decode_leg):
                if not leg.done():
                    leg.cancel()
            await asyncio.gather(prefill_leg, decode_leg, return_exceptions=True)


def _take_prefill_usage(call: Call, leg: asyncio.Future) -> None:
    if not leg.cancelled() and leg.exception() is None:
        call.prefill_usage = leg.result().usage


FORWARDERS: dict[str, type[Forwarder]] = {f.name: f for f in (Pull, DecodeFirst, Colocated, Push)}


def make_forwarder(protocol: str, scheduling: str) -> Forwarder:
    cls = FORWARDERS.get(protocol)
    if cls is None:
        supported = "; ".join(f().describe() for f in FORWARDERS.values())
        raise ValueError(f"unknown protocol {protocol!r}; supported: {supported}")
    if scheduling not in cls.scheduling_modes:
        raise ValueError(f"protocol {protocol!r} does not support {scheduling!r} scheduling; it supports: "
                         f"{', '.join(sorted(cls.scheduling_modes))}")
    return cls()


__all__ = ["FORWARDERS", "Forwarder", "Instance", "make_forwarder", "prefill_body", "with_kv_params"]
