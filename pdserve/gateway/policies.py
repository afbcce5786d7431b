"""Instance selection policies, by name: round_robin, least_loaded, prefix_aware."""

from __future__ import annotations

import hashlib
import itertools
from abc import ABC, abstractmethod

from pdserve.gateway.registry import Instance


class NoInstanceError(RuntimeError):
    pass


class Policy(ABC):
    name = ""
    wants_prompt = False  # whether `pick` takes the prompt's token ids too (kv_aware)
    wants_affinity = False  # whether `pick` reads `affinity` (a prompt prefix, encoded per pick: not for nothing)
    reads_load = False  # whether `pick` reads the instances' scraped load (else nothing polls their /metrics for it)

    @abstractmethod
    def pick(self, candidates: list[Instance], affinity: bytes = b"") -> Instance:
        """Choose among usable candidates (never empty, and read-only: the gateway caches the list between requests);
        `affinity` is a key like a prompt prefix."""


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def pick(self, candidates: list[Instance], affinity: bytes = b"") -> Instance:
        return candidates[next(self._counter) % len(candidates)]


class LeastLoaded(Policy):
    """Fewest requests: the instance's own gauges (scraped) or our in-flight count, whichever is fresher."""

    name = "least_loaded"
    reads_load = True

    def __init__(self) -> None:
        self._tiebreak = itertools.count()

    def pick(self, candidates: list[Instance], affinity: bytes = b"") -> Instance:
        start = next(self._tiebreak) % len(candidates)
        rotated = candidates[start:] + candidates[:start]
        return min(rotated, key=lambda i: i.load)


class PrefixAware(Policy):
    """Same prompt prefix, same instance (its prefix cache is warm), unless that instance is clearly busier.

    Rendezvous hashing keeps the mapping stable as instances come and go; the balance threshold hands a
    request to the least-loaded instance when the preferred one has `balance_threshold` more requests.
    """

    name = "prefix_aware"
    wants_affinity = True
    reads_load = True

    def __init__(self, balance_threshold: float = 4.0) -> None:
        self.balance_threshold = balance_threshold
        self._least = LeastLoaded()

    def pick(self, candidates: list[Instance], affinity: bytes = b"") -> Instance:
        least = self._least.pick(candidates)
        if not affinity:
            return least
        preferred = max(candidates, key=lambda i: hashlib.blake2b(affinity + i.url.encode(), digest_size=8).digest())
        return preferred if preferred.load - least.load < self.balance_threshold else least


POLICIES: dict[str, type[Policy]] = {p.name: p for p in (RoundRobin, LeastLoaded, PrefixAware)}


def make_policy(name: str) -> Policy:
    cls = POLICIES.get(name)
    if cls is None:
        raise ValueError(f"unknown policy {name!r}; available: {', '.join(sorted(POLICIES))}")
    return cls()
