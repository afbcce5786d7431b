"""KV exchange with vLLM's NixlConnector (vLLM 0.32): its handshake, its memory layout, its notifications."""
