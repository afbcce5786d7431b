"""Which kernel a linear's rows take beside oneDNN's packed weights: by default a single fp32 row on F.linear
where MKL serves it well (gemv), `onednn` packed weights only, `auto` measured per shape. Every choice must give
transformers' greedy tokens in fp32, whichever kernel a row count takes."""

from __future__ import annotations

import platform
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import random_prompt
from test_oracle import NUM_TOKENS, PROMPT_LENGTHS, check_against_hf

from pdserve.layers import linear
from pdserve.layers.linear import CALIBRATION_ROWS, Linear, calibrate_linears, onednn_available

pytestmark = pytest.mark.skipif(not onednn_available(torch.device("cpu")), reason="no oneDNN: F.linear only")


def _onednn(layer: Linear, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, layer.packed, layer.bias, "none", [], "")


def test_by_default_a_single_fp32_row_takes_f_linear_and_bf16_stays_on_onednn(monkeypatch) -> None:
    monkeypatch.delenv(linear.LINEAR_ENV_VAR, raising=False)
    monkeypatch.setattr(linear, "mkl_gemv_preferred", lambda: True)
    fp32, bf16 = torch.randn(96, 2048), torch.randn(96, 2048, dtype=torch.bfloat16)
    layers = [Linear(fp32), Linear(bf16)]
    calibrate_linears(layers, [fp32, bf16])
    assert layers[0].plain is fp32 and layers[0].plain_rows == 1  # the loaded weight kept, not copied
    if onednn_available(torch.device("cpu"), torch.bfloat16):
        assert layers[1].plain is None and layers[1].plain_rows == 0
    else:  # a CPU without oneDNN's bf16 path: F.linear on the weight as loaded
        assert layers[1].packed is None and layers[1].plain is bf16
    x = torch.randn(2, 2048)
    # Bit for bit: one row is MKL's GEMV, two rows are oneDNN's, whatever else the process did before.
    assert torch.equal(layers[0](x[:1]), F.linear(x[:1], fp32))
    assert torch.equal(layers[0](x), _onednn(layers[0], x))
    for backend, preferred in (("gemv", False), ("onednn", True)):  # a CPU without MKL's tuned GEMV; opted out
        monkeypatch.setenv(linear.LINEAR_ENV_VAR, backend)
        monkeypatch.setattr(linear, "mkl_gemv_preferred", lambda preferred=preferred: preferred)
        onednn_only = Linear(fp32)
        calibrate_linears([onednn_only], [fp32])
        assert onednn_only.plain is None and torch.equal(onednn_only(x[:1]), _onednn(onednn_only, x[:1]))
    monkeypatch.setenv(linear.LINEAR_ENV_VAR, "fast")
    with pytest.raises(ValueError, match="PDSERVE_LINEAR_BACKEND='fast'.*onednn, gemv, auto"):
        calibrate_linears([Linear(fp32)], [fp32])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_cpu_without_onednns_half_precision_path_takes_f_linear(monkeypatch, dtype) -> None:
    """oneDNN's packed bf16 and fp16 weights need AVX-512 (or AVX-NE-CONVERT): on an AVX2 CPU reordering raises, and
    an instance would not start with --dtype bfloat16."""
    for name in ("_is_mkldnn_bf16_supported", "_is_mkldnn_fp16_supported"):
        monkeypatch.setattr(torch.ops.mkldnn, name, lambda: False)
    weight, x = torch.randn(64, 32, dtype=dtype), torch.randn(3, 32, dtype=dtype)
    layer = Linear(weight)
    calibrate_linears([layer], [weight])
    assert layer.packed is None and layer.plain is weight
    assert torch.equal(layer(x), F.linear(x, weight))
    assert onednn_available(torch.device("cpu"))  # fp32 keeps oneDNN


def test_calibration_keeps_plain_weights_only_where_asked(monkeypatch) -> None:
    weight = torch.randn(48, 32)
    layers = [Linear(weight), Linear(weight)]
    monkeypatch.setenv(linear.LINEAR_ENV_VAR, "auto")
    monkeypatch.setattr(linear, "PLAIN_MARGIN", 0.0)  # F.linear never wins
    calibrate_linears(layers, [weight, weight])
    assert all(layer.plain is None and layer.plain_rows == 0 for layer in layers)
    monkeypatch.setattr(linear, "PLAIN_MARGIN", float("inf"))  # F.linear "wins" every count
    calibrate_linears(layers, [weight, weight])
    assert all(layer.plain_rows == CALIBRATION_ROWS[-1] for layer in layers)
    x = torch.randn(CALIBRATION_ROWS[-1] + 1, 32)
    for rows in (1, x.shape[0]):  # F.linear below the bound, oneDNN above it
        torch.testing.assert_close(layers[0](x[:rows]), x[:rows] @ weight.T, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["onednn", "auto"])
def test_engine_on_the_other_linear_choices_matches_transformers(backend, monkeypatch, models, make_llm,
                                                                 hf_models) -> None:
    """The default (gemv) is what the oracle tests run (on Intel: F.linear decode); these are the packed-only path
    and F.linear up to 16 rows."""
    monkeypatch.setenv(linear.LINEAR_ENV_VAR, backend)
    monkeypatch.setattr(linear, "PLAIN_MARGIN", float("inf"))  # auto: decode and short chunks on F.linear
    prompts = [random_prompt(n, seed=n) for n in PROMPT_LENGTHS]
    compared = check_against_hf(make_llm, hf_models, models("llama"), prompts, f"llama, linears {backend}")
    assert compared >= len(prompts) * NUM_TOKENS // 2


@pytest.mark.skipif(platform.machine() != "x86_64" or sys.platform != "linux", reason="x86-64 Linux only")
def test_the_vendor_is_read_on_x86_linux() -> None:
    # An empty answer here would silently keep every fp32 GEMV on the slower kernel.
    assert linear.cpu_vendor() in ("GenuineIntel", "AuthenticAMD", "HygonGenuine", "CentaurHauls")
