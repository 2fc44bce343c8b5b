"""The batch-1 GEMV tile choice on a GPU whose tuning table has no entry for a shape (or no
table at all): the dedicated GEMV with its default tile, not the general kernel (int4) or
`torch._scaled_mm` (FP8), which an untuned H200 ran 3.5x / 1.7x slower than bf16; off CUDA,
no tile (the reference path). The layers are stand-ins: only the fields the choice reads."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from llmaccel.kernels import gemm_tuning
from llmaccel.kernels.gemv_fp8 import GemvFp8Config
from llmaccel.kernels.gemv_w4 import GemvW4Config, default_gemv_w4_config
from llmaccel.models.layers import fp8_linear, linear_methods


def _w4_layer(cuda: bool):
    return SimpleNamespace(kernel_weight=SimpleNamespace(is_cuda=cuda), output_size=3072,
                           input_size=8192, kernel_group_size=128)


def test_int4_untuned_shape_takes_the_default_gemv_tile(monkeypatch):
    monkeypatch.setattr(gemm_tuning, "gemv_w4_config", lambda n, k, g, device=None: None)
    got = linear_methods._gemv_w4_config(_w4_layer(True), 8192, torch.device("cpu"))
    assert got == default_gemv_w4_config(3072, 8192, 128)
    assert linear_methods._gemv_w4_config(_w4_layer(False), 8192, torch.device("cpu")) is None


def test_int4_table_tile_wins_over_the_default(monkeypatch):
    tile = GemvW4Config(block_n=8, block_k=256, num_warps=1, num_stages=4, vec=4)
    monkeypatch.setattr(gemm_tuning, "gemv_w4_config", lambda n, k, g, device=None: tile)
    assert linear_methods._gemv_w4_config(_w4_layer(True), 8192, torch.device("cpu")) == tile


def _fp8_layer(cuda: bool):
    return SimpleNamespace(weight=SimpleNamespace(is_cuda=cuda, device=torch.device("cpu")),
                           output_size=3072, input_size=3072)


def test_fp8_untuned_shape_takes_the_default_gemv_tile(monkeypatch):
    monkeypatch.setattr(fp8_linear.Fp8LinearMethod, "_gemv_ok", staticmethod(lambda layer: True))
    monkeypatch.setattr(gemm_tuning, "gemv_fp8_config", lambda n, k, device=None: None)
    got = fp8_linear._gemv_config(_fp8_layer(True))
    assert got == fp8_linear.untuned_gemv_fp8() and got.prequant
    assert fp8_linear._gemv_config(_fp8_layer(False)) is None
    tile = GemvFp8Config(block_n=2, block_k=4096, num_warps=4, num_stages=2)
    monkeypatch.setattr(gemm_tuning, "gemv_fp8_config", lambda n, k, device=None: tile)
    assert fp8_linear._gemv_config(_fp8_layer(True)) == tile
    # no e4m3 in Triton here: no GEMV at all
    monkeypatch.setattr(fp8_linear.Fp8LinearMethod, "_gemv_ok", staticmethod(lambda layer: False))
    assert fp8_linear._gemv_config(_fp8_layer(True)) is None
