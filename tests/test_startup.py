"""Startup reads the model's config.json once, and the gateway imports no torch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.config import EngineConfig
from pdserve.instance import Instance


def test_instance_reads_config_json_once(models, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The connectors, the engine and the model builder all need the config: they share one resolved copy
    # (so they cannot disagree on dtype or context length), read here once. transformers' tokenizer loading
    # opens the file on its own, through open(), which this count leaves out.
    reads: list[Path] = []
    read_text = Path.read_text

    def counting_read_text(self: Path, *args, **kwargs) -> str:
        if self.name == "config.json":
            reads.append(self)
        return read_text(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", counting_read_text)
    config = EngineConfig(model=models("llama"), role="prefill", num_kv_blocks=128,
                          kv_transfer_config={"kv_connector": "PdConnector", "kv_role": "kv_producer"},
                          ec_transfer_config={"ec_connector": "ECStorageConnector", "ec_role": "ec_consumer",
                                              "ec_connector_extra_config": {"shared_storage_path": str(tmp_path)}})
    instance = Instance(config)
    try:
        assert len(reads) == 1, reads
    finally:
        instance.connectors.agent.stop()


def test_gateway_imports_no_torch() -> None:
    # The gateway is a separate, light process: it must not pay for (or depend on) torch, nor reach it through
    # modules that import torch only lazily (the engine's config, the models).
    code = ("import pdserve.gateway.app, pdserve.gateway.cli, sys; assert 'torch' not in sys.modules, 'torch imported'; "
            "heavy = sorted(m for m in sys.modules if m.startswith(('pdserve.engine', 'pdserve.models', 'pdserve.config'))); "
            "assert not heavy, heavy")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 0, result.stderr
