"""The measured per-shape linear choice (PDSERVE_LINEAR_BACKEND=auto): small batches on F.linear beside oneDNN's
packed weights. Both kernels must give the same greedy tokens, transformers' in fp32, whichever a row count takes."""

from __future__ import annotations

import pytest
import torch
from conftest import random_prompt
from test_oracle import NUM_TOKENS, PROMPT_LENGTHS, check_against_hf

from pdserve.layers import linear
from pdserve.layers.linear import CALIBRATION_ROWS, Linear, calibrate_linears, onednn_available

pytestmark = pytest.mark.skipif(not onednn_available(torch.device("cpu")), reason="no oneDNN: F.linear only")


def test_calibration_keeps_plain_weights_only_where_asked(monkeypatch) -> None:
    weight = torch.randn(48, 32)
    layers = [Linear(weight), Linear(weight)]
    calibrate_linears(layers, [weight, weight])  # the default is oneDNN alone
    assert all(layer.plain is None and layer.plain_rows == 0 for layer in layers)
    monkeypatch.setenv(linear.LINEAR_ENV_VAR, "auto")
    monkeypatch.setattr(linear, "PLAIN_MARGIN", float("inf"))  # F.linear "wins" every count
    calibrate_linears(layers, [weight, weight])
    assert all(layer.plain_rows == CALIBRATION_ROWS[-1] for layer in layers)
    x = torch.randn(CALIBRATION_ROWS[-1] + 1, 32)
    for rows in (1, x.shape[0]):  # F.linear below the bound, oneDNN above it
        torch.testing.assert_close(layers[0](x[:rows]), x[:rows] @ weight.T, atol=1e-5, rtol=1e-5)


def test_engine_on_both_linear_paths_matches_transformers(monkeypatch, models, make_llm, hf_models) -> None:
    monkeypatch.setenv(linear.LINEAR_ENV_VAR, "auto")
    monkeypatch.setattr(linear, "PLAIN_MARGIN", float("inf"))  # decode (1 row) on F.linear, prefill on oneDNN
    prompts = [random_prompt(n, seed=n) for n in PROMPT_LENGTHS]
    compared = check_against_hf(make_llm, hf_models, models("llama"), prompts, "llama, F.linear decode")
    assert compared >= len(prompts) * NUM_TOKENS // 2
