"""KV-cache events: instances publish what their prefix caches hold in vLLM's wire format, and the gateway keeps a
global prefix index from every publishing instance (vLLM and pdserve alike) to route by overlap and load.

* `wire.py`: vLLM's event types and a decoder that reads every encoding vLLM has shipped;
* `config.py`: `--kv-events-config`, as vLLM reads it, and where a gateway dials a publisher;
* `publisher.py`: the engine's side (ZMQ PUB, the replay ROUTER, a queue drained by a thread);
* `index.py`: the gateway's dual-key prefix index (its cores: `native/` in C, `index_core.py` and
  `index_queries.py` in Python); `listener.py`: one thread subscribed to every publisher;
* `prompt.py`: the prompt's token ids at the gateway (`chat_template.py`, `pieces.py`, `fast_bpe.py`, and
  `lazy_ids.py` for reading a prompt only as far as routing needs); `policy.py`: the `kv_aware` policy;
* `metrics.py`: `pdserve:gateway_kv_index_*`.
"""
