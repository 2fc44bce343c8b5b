"""FP8 checkpoints on the batch-1 FP8 GEMV (kernels/gemv_fp8.py) inside our model: plain, where
the GPU's table has a GEMV tile for the shape, and in fused decode layers (norm, SiLU-and-mul
and residual add folded in), where it has a tile for the fusion. Tiles are forced here; on CPU
the kernel runs in Triton's interpreter. Both must give the logits of the W8A8 reference path
(`fp8_linear`), which rounds the same way, so only fp32 summation order differs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_models import make_tiny_model
from transformers import LlamaConfig

pytest.importorskip("triton")

from llmaccel.kernels import gemm_tuning, gemv_fp8
from llmaccel.kernels.gemv_fp8 import GemvFp8Config
from llmaccel.models.attention import AttentionMetadata
from llmaccel.models.layers.linear import Linear
from llmaccel.models.loader import load_model
from llmaccel.models.transformer import DecoderLayer
from llmaccel.quant.driver import quantize_model

CONFIG = {"vocab_size": 256, "hidden_size": 128, "intermediate_size": 256,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "max_position_embeddings": 256, "tie_word_embeddings": False}
TILE = GemvFp8Config(8, 64, 2, 2)


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("fp8_gemv")
    make_tiny_model(LlamaConfig(**CONFIG), base / "bf16", seed=3)
    quantize_model(base / "bf16", method="fp8", out_dir=base / "fp8", device="cpu",
                   show_progress=False)
    return base / "fp8"


def _logits(model, token: int) -> torch.Tensor:
    meta = AttentionMetadata.for_prefill([1], "cpu")  # one token: every linear sees one row
    with torch.no_grad():
        return model.compute_logits(model(torch.tensor([token]), torch.tensor([0]), meta))


def _spy(monkeypatch) -> list[tuple[str, ...]]:
    """Records the fusion arguments of every fp8_gemv call."""
    calls = []
    real = gemv_fp8.fp8_gemv

    def spy(*a, **kw):
        calls.append(tuple(sorted(k for k, v in kw.items()
                                  if v is not None and v is not False and k != "eps")))
        return real(*a, **kw)

    monkeypatch.setattr(gemv_fp8, "fp8_gemv", spy)
    return calls


@pytest.mark.parametrize("fused,silu_epilogue,prequant", [
    (False, True, False), (False, False, False), (True, True, False), (False, True, True),
    (False, False, True)])
def test_fp8_model_on_the_gemv_matches_the_w8a8_reference(fused, silu_epilogue, prequant,
                                                          fp8_dir, monkeypatch):
    """Fused decode layers, or unfused ones with SiLU-and-mul in the gate_up GEMV's epilogue
    (what the engine does) or after it; with prequant tiles the RMSNorm kernels hand the qkv
    and gate_up GEMVs their rows quantized (`rms_norm_fp8`): the W8A8 reference's logits."""
    from llmaccel.models import transformer

    if not silu_epilogue:  # the two steps: the GEMV, then silu_and_mul
        monkeypatch.setattr(transformer, "gate_up_silu", lambda layer, x, x_scale=None: None)
    tile = GemvFp8Config(8, 64, 2, 2, prequant=prequant)
    _, ref = load_model(str(fp8_dir), dtype="float32", device="cpu")
    _, ours = load_model(str(fp8_dir), dtype="float32", device="cpu")
    calls = _spy(monkeypatch)
    monkeypatch.setattr(gemm_tuning, "gemv_fp8_config", lambda n, k, device=None: tile)
    monkeypatch.setattr(gemm_tuning, "fused_fp8_config",
                        (lambda kind, n, k, device=None: tile) if fused else
                        (lambda kind, n, k, device=None: None))
    ours.set_fused_kernels(True, fuse_decode=True)
    layers = []
    original = DecoderLayer.forward_fused
    monkeypatch.setattr(DecoderLayer, "forward_fused",
                        lambda self, *a: layers.append(1) or original(self, *a))
    for token in (7, 201):
        torch.testing.assert_close(_logits(ours, token), _logits(ref, token), atol=1e-4,
                                   rtol=0)
    n = CONFIG["num_hidden_layers"]
    if fused:
        assert len(layers) == 2 * n
        assert calls == [("norm_weight",), ("residual",), ("norm_weight",),
                         ("residual", "silu")] * (2 * n)
    else:
        gate_up = ("silu_out",) if silu_epilogue else ()
        # qkv and gate_up get their rows from the norm kernel, quantized (x_scale)
        qkv, gate_up = (("x_scale",), tuple(sorted(gate_up + ("x_scale",)))) if prequant \
            else ((), gate_up)
        assert not layers and calls == [qkv, (), gate_up, ()] * (2 * n)
    qkv = ours.model.layers[0].self_attn.qkv_proj
    desc = qkv.quant_method.describe(qkv)
    assert "gemv_fp8.py" in desc and ("fused decode layers" in desc) == fused


def test_without_table_tiles_the_reference_path_runs(fp8_dir, monkeypatch):
    """No table tiles off CUDA: no GEMV call (on CUDA an untuned shape takes the default
    tile, `fp8_linear.untuned_gemv_fp8`)."""
    _, ours = load_model(str(fp8_dir), dtype="float32", device="cpu")
    calls = _spy(monkeypatch)
    monkeypatch.delenv("LLMACCEL_GEMM_CONFIGS", raising=False)
    gemm_tuning.clear_cache()
    ours.set_fused_kernels(True, fuse_decode=True)
    _logits(ours, 5)
    assert not calls
    layer = next(m for m in ours.modules() if isinstance(m, Linear))
    assert "gemv_fp8" not in layer.quant_method.describe(layer)
