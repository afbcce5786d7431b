"""Names that vulture (confidence 60) reports as unused but that are used by something it cannot see.

Read by `tests/test_code_health.py` (`vulture pdserve tests/vulture_whitelist.py --min-confidence 60`); never
imported. Each entry says who uses the name. Anything else vulture reports is dead code: delete it.
"""

# ruff: noqa
# Module-level __getattr__ (PEP 562): Python calls it to import the model generators lazily.
__getattr__
# Properties of `tokenizers` objects, set to build tokenizer.json files; the library reads them.
_.normalizer
_.pre_tokenizer
_.decoder
_.post_processor
# A field of the CLIP vision config as Hugging Face writes it: parsed with the rest, the tower is RGB-only.
num_channels
# asyncio.Protocol callbacks (the event loop calls them, flow control included) and httptools parser callbacks
# (the parser calls them).
_.connection_made
_.data_received
_.connection_lost
_.eof_received
_.on_header
_.on_headers_complete
_.on_body
_.on_message_complete
_.on_message_begin
_.on_url
_.pause_writing
_.resume_writing
# FastAPI route handlers and exception handlers, registered by their decorators.
chat_completions
prometheus
not_found
not_allowed
# pydantic field validators, registered by their decorators.
_prompt_not_empty
internal
pdserve_info
# Fields of vLLM's NIXL agent metadata that its decoder requires (pdserve/kv_transfer/vllm_nixl/wire.py).
kv_cache_layout
ssm_sizes
# vLLM's KV connector interface (pdserve/integrations/vllm/connector.py, info.py): vLLM calls these methods, with
# these argument names, on PdConnector; the ones a protocol does not need are accepted and ignored. Its stats
# class's methods are vLLM's too (vLLM's stats logger aggregates, reduces and empties them).
build_prom_metrics
build_kv_connector_stats
get_kv_connector_stats
aggregate
reduce
is_empty
reset
request_finished_all_groups
has_pending_push_work
get_required_kvcache_layout
forward_context
layer_name
kv_layer
attn_metadata
transfer_stats_data
engine_idx
# Data planes over an optional engine: the registry (pdserve/kv_transfer/data_plane/__init__.py) looks their
# classes up by name in OPTIONAL_PLANES, so only the engine's presence decides whether they load.
NixlDataPlane
MooncakeDataPlane
# vLLM's connector stats interface (pdserve/integrations/vllm/connector.py, stats.py): vLLM's model runner asks
# the worker for stats each step, its scheduler and loggers rebuild, merge, summarise and reset them.
build_kv_connector_stats
get_kv_connector_stats
reset
aggregate
reduce
is_empty
# The gateway's per-role Kubernetes selectors: flags and config keys, read by name (f"{role}_selector") when the
# gateway builds its discovery backends (pdserve/gateway/service.py).
prefill_selector
decode_selector
both_selector
encode_selector
# Membership records carry where an instance publishes KV-cache events, verbatim, for the KV-event subscribers.
kv_events
replay_endpoint
# Fields of vLLM's KV events and event batch (pdserve/kv_events/wire.py): on the wire for vLLM's decoder and other
# consumers; the gateway's index reads only hashes, parent, tokens, block size and medium.
lora_id
group_idx
kv_cache_spec_kind
kv_cache_spec_sliding_window
locality
ownership
session_id
data_parallel_rank
# The vLLM fork server's entry, named in its profile as "module:function" (pdserve/forkserver.py).
vllm_main
# The standard library's cached temporary folder, cleared in the vLLM fork server's child so that tempfile looks it
# up again in the child's environment (pdserve/forkserver_vllm.py).
_.tempdir
