"""FP8 W8A8 (E4M3 weights per channel, dynamic per-token activations): numerics, the
compressed-tensors float-quantized checkpoint `llmaccel quantize --method fp8` writes, loading
it in our engine (and in transformers when compressed-tensors is installed), and the errors.

E4M3 is checked against a decoder of the bit layout written here from the format's definition
(sign, 4-bit exponent with bias 7, 3-bit mantissa, subnormals at exponent 0, no infinities, NaN
at 0x7F / 0xFF), reading the raw bytes; it never calls torch's float8 conversion, so a wrong
rounding or saturation in ours shows up even if torch's cast is what we use.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
import torch
from cli_helpers import one_line_error, run_llmaccel
from safetensors.torch import load_file, save_file
from tiny_models import make_tiny_model
from transformers import LlamaConfig

from llmaccel.errors import CorruptCheckpointError, QuantizationError
from llmaccel.models.layers.quantization import UnquantizedLinearMethod
from llmaccel.quant.formats.fp8 import fp8_quantization_config
from llmaccel.quant.fp8 import (
    MIN_ACT_SCALE,
    fake_quantize_fp8_per_token,
    quantize_fp8_per_token,
    quantize_fp8_weight,
    to_fp8,
)
from llmaccel.models.layers.fp8_linear import fp8_linear
from llmaccel.models.layers.quant_configs import quant_config_from_hf

# hidden 128, intermediate 256: multiples of 16, so the same checkpoint takes _scaled_mm on a GPU
CONFIG = {"vocab_size": 256, "hidden_size": 128, "intermediate_size": 256,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "max_position_embeddings": 256, "tie_word_embeddings": False}
LINEAR = re.compile(r"(.*\.(q|k|v|o|gate|up|down)_proj)\.weight$")

# ----------------------------------------------------------------------------- E4M3 decoder


def decode_e4m3(byte: int) -> float:
    """The value of one float8_e4m3fn bit pattern, from the format's definition."""
    sign = -1.0 if byte & 0x80 else 1.0
    exponent, mantissa = (byte >> 3) & 0xF, byte & 0x7
    if exponent == 0xF and mantissa == 0x7:
        return float("nan")
    if exponent == 0:  # subnormal: no implicit leading 1, exponent 1 - bias
        return sign * (mantissa / 8.0) * 2.0 ** (1 - 7)
    return sign * (1.0 + mantissa / 8.0) * 2.0 ** (exponent - 7)


TABLE = torch.tensor([decode_e4m3(b) for b in range(256)], dtype=torch.float64)
FINITE = [b for b in range(256) if TABLE[b] == TABLE[b]]  # drops the two NaN codes


def decode(q: torch.Tensor) -> torch.Tensor:
    """float64 values of an e4m3 tensor, looked up byte by byte."""
    assert q.dtype == torch.float8_e4m3fn
    return TABLE[q.view(torch.uint8).long()]


def nearest_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Round-to-nearest-even onto the finite e4m3 values, saturating at +-448: the two grid
    values around each x are found by binary search and the nearer one kept; on a tie, the one
    whose code has an even mantissa (last bit 0)."""
    codes = torch.tensor([b for b in FINITE if b != 0x80])  # -0 would duplicate +0
    values, order = TABLE[codes].sort()
    codes = codes[order]
    x = x.double().clamp(-448.0, 448.0).reshape(-1)
    hi = torch.searchsorted(values, x).clamp(1, len(values) - 1)
    lo = hi - 1
    d_lo, d_hi = x - values[lo], values[hi] - x
    take_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (codes[hi] % 2 == 0))
    return torch.where(take_hi, values[hi], values[lo])


def scale_of(x: torch.Tensor) -> torch.Tensor:
    """The scheme's per-token scale: fp32 max |x| / 448 (true division), floored."""
    absmax = x.float().abs().amax(-1, keepdim=True)
    return (absmax / torch.full_like(absmax, 448.0)).clamp_min(MIN_ACT_SCALE)


def independent_fake_quant(x: torch.Tensor) -> torch.Tensor:
    """Per-token e4m3 round trip of x [..., K] in float64, by the test's own rounding. The scale
    and the quotient x / scale are fp32, as the scheme defines them (true division): bf16
    inputs often sit exactly halfway between two e4m3 values, and only the fp32 quotient says
    which side of the tie a value is on."""
    s_x = scale_of(x)
    return nearest_e4m3(x.float() / s_x).reshape(x.shape) * s_x.double()


def test_decoder_agrees_with_torch_on_every_code():
    raw = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    ours = decode(raw)
    theirs = raw.to(torch.float64)
    assert torch.equal(ours.isnan(), theirs.isnan())
    finite = ~ours.isnan()
    assert torch.equal(ours[finite], theirs[finite])
    assert TABLE[0x7E] == 448.0 and TABLE[0x01] == 2.0**-9 and TABLE[0x08] == 2.0**-6


def test_to_fp8_rounds_to_nearest_even_and_saturates():
    gen = torch.Generator().manual_seed(0)
    picked = torch.tensor([0.0, -0.0, 1.0, 1.0625, 1.1875, -1.0625, 17.0, 19.0, 448.0, 449.0,
                           463.9, 464.0, 1e6, -1e6, 2.0**-9, 2.0**-10, 3 * 2.0**-10, 1e-30,
                           240.0, 232.0, 248.0])  # ties: 1.0625, 1.1875, 17, 19, 2^-10, 232...
    mixed = torch.cat([picked, torch.randn(4000, generator=gen) * 30,
                       torch.randn(2000, generator=gen) * 0.01])
    q = to_fp8(mixed, torch.tensor(1.0))
    got = decode(q)
    assert not got.isnan().any()
    torch.testing.assert_close(got, nearest_e4m3(mixed), rtol=0, atol=0)
    # a scale divides before rounding
    q2 = to_fp8(torch.tensor([3.0, -6.0]), torch.tensor(0.5))
    assert decode(q2).tolist() == [6.0, -12.0]


# ------------------------------------------------------------------- weights and activations


def test_weight_per_channel_scales_on_a_hand_made_weight():
    w = torch.tensor([[1.0, -2.0, 4.0, 0.5],
                      [0.0, 0.0, 0.0, 0.0],  # a pruned row: scale must not be 0
                      [-896.0, 3.0, 0.1, 448.0],
                      [1e-3, -1e-3, 5e-4, 0.0]])
    qw = quantize_fp8_weight(w)
    assert qw.weight.dtype == torch.float8_e4m3fn and qw.weight.shape == (4, 4)
    assert qw.weight_scale.dtype == torch.float32 and qw.weight_scale.shape == (4, 1)
    expect_scale = torch.tensor([[4.0], [448.0], [896.0], [1e-3]]) / 448  # fp32, as stored
    torch.testing.assert_close(qw.weight_scale, expect_scale, rtol=0, atol=0)
    codes = decode(qw.weight)
    # row 0 lands exactly on the grid: 4 -> 448 (0x7E), -2 -> -224, 1 -> 112, 0.5 -> 56
    assert codes[0].tolist() == [112.0, -224.0, 448.0, 56.0]
    assert qw.weight.view(torch.uint8)[0, 2].item() == 0x7E
    assert codes[1].abs().sum() == 0
    # the row's absmax is the largest code, whatever its sign
    assert codes[2, 0] == -448.0 and codes[2, 3] == 224.0
    # every code is the nearest e4m3 value to w / scale
    torch.testing.assert_close(codes.reshape(-1), nearest_e4m3(w / qw.weight_scale), rtol=0,
                               atol=0)
    torch.testing.assert_close(qw.dequantize()[0], w[0], rtol=1e-6, atol=0)


def test_weight_per_tensor_scale():
    w = torch.tensor([[1.0, -8.0], [2.0, 0.25]])
    qw = quantize_fp8_weight(w, "tensor")
    assert qw.weight_scale.shape == (1,)
    assert torch.equal(qw.weight_scale, torch.tensor([8.0]) / 448)
    assert decode(qw.weight).tolist() == [[56.0, -448.0], [112.0, 14.0]]
    with pytest.raises(QuantizationError, match="strategy"):
        quantize_fp8_weight(w, "block")
    with pytest.raises(QuantizationError, match="NaN"):
        quantize_fp8_weight(torch.tensor([[float("nan"), 1.0]]))


def test_per_token_activation_scales():
    x = torch.tensor([[0.0, 0.0, 0.0, 0.0],  # all-zero token: the floor, codes 0, no NaN
                      [1.0, -3.0, 2.0, 0.5],
                      [1e-9, 0.0, 0.0, 0.0],  # below the floor: rounds to 0
                      [1e4, -2.5e3, 7.0, 0.0]])
    q, scale = quantize_fp8_per_token(x)
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
    assert scale.shape == (4, 1)
    expect = torch.tensor([[MIN_ACT_SCALE], [3.0 / 448], [MIN_ACT_SCALE], [1e4 / 448]],
                          dtype=torch.float32)
    torch.testing.assert_close(scale, expect, rtol=0, atol=0)
    codes = decode(q)
    assert codes[0].abs().sum() == 0 and codes[2].abs().sum() == 0
    assert codes[1, 1] == -448.0 and codes[3, 0] == 448.0
    torch.testing.assert_close(codes.reshape(-1), nearest_e4m3(x / scale), rtol=0, atol=0)
    # bf16 tokens (3-D input): with 8-bit inputs many quotients are exact e4m3 ties, which
    # must go to the even code, as the fp32 quotient says
    xb = (torch.randn(4, 50, 256, generator=torch.Generator().manual_seed(1)) * 3).to(
        torch.bfloat16)
    fq = fake_quantize_fp8_per_token(xb)
    assert fq.shape == xb.shape and fq.dtype == torch.float32
    torch.testing.assert_close(fq.double(), independent_fake_quant(xb), rtol=1e-6, atol=0)
    ratio = (xb.float() / scale_of(xb)).double().reshape(-1)
    ties = nearest_e4m3(ratio * (1 + 1e-9)) != nearest_e4m3(ratio * (1 - 1e-9))
    assert int(ties.sum()) > 100  # the case is really exercised


def _independent_w8a8(x: torch.Tensor, qw_weight: torch.Tensor, qw_scale: torch.Tensor,
                      bias: torch.Tensor | None) -> torch.Tensor:
    """y = fake_quant(x) @ dequant(W)^T in float64, from the test's own decoder and rounding."""
    x2 = x.reshape(-1, x.shape[-1])
    x_fq = independent_fake_quant(x2)
    w = decode(qw_weight) * qw_scale.double()
    y = x_fq @ w.t()
    if bias is not None:
        y = y + bias.double()
    return y.reshape(*x.shape[:-1], -1)


def test_fp8_linear_reference_matches_independent_math():
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(48, 64, generator=gen) * 0.05
    qw = quantize_fp8_weight(w)
    x = torch.randn(2, 5, 64, generator=gen) * 2
    x[0, 1] = 0.0  # a zero token
    bias = torch.randn(48, generator=gen)
    y = fp8_linear(x, qw.weight, qw.weight_scale, bias, use_scaled_mm=False)
    assert y.shape == (2, 5, 48) and y.dtype == torch.float32
    torch.testing.assert_close(y.double(), _independent_w8a8(x, qw.weight, qw.weight_scale, bias),
                               rtol=1e-5, atol=1e-5)
    # activation quantization is really on: not the plain product with dequantized weights
    assert not torch.allclose(y, torch.nn.functional.linear(x, qw.dequantize(), bias),
                              rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------- the quantize command


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("tiny_llama_fp8")
    make_tiny_model(LlamaConfig(**CONFIG), d, seed=0)
    return d


@pytest.fixture(scope="module")
def fp8_dir(tiny_llama: Path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fp8") / "q"
    r = run_llmaccel("quantize", str(tiny_llama), "--method", "fp8", "--out", str(out),
                     "--device", "cpu")
    assert r.returncode == 0, r.stderr
    assert "fp8 W8A8" in r.stdout
    return out


def test_checkpoint_config_and_tensors(tiny_llama: Path, fp8_dir: Path):
    qc = json.loads((fp8_dir / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "float-quantized"
    assert qc["quantization_status"] == "compressed" and qc["ignore"] == ["lm_head"]
    (group,) = qc["config_groups"].values()
    assert group["targets"] == ["Linear"] and group["output_activations"] is None
    w, a = group["weights"], group["input_activations"]
    assert {k: w[k] for k in ("num_bits", "type", "strategy", "symmetric", "dynamic")} == {
        "num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True,
        "dynamic": False}
    assert {k: a[k] for k in ("num_bits", "type", "strategy", "symmetric", "dynamic")} == {
        "num_bits": 8, "type": "float", "strategy": "token", "symmetric": True, "dynamic": True}
    report = json.loads((fp8_dir / "quantize_report.json").read_text())
    assert (report["method"], report["bits"], report["group_size"]) == ("fp8", 8, -1)

    src, t = load_file(str(tiny_llama / "model.safetensors")), load_file(
        str(fp8_dir / "model.safetensors"))
    linears = [k for k in src if LINEAR.match(k)]
    assert len(linears) == 14
    for name in linears:
        module = name.removesuffix(".weight")
        q, s = t[name], t[module + ".weight_scale"]
        assert q.dtype == torch.float8_e4m3fn and q.shape == src[name].shape
        assert s.dtype == torch.float32 and s.shape == (q.shape[0], 1)
        absmax = src[name].abs().amax(1, keepdim=True)  # fp32, the stored scale's precision
        torch.testing.assert_close(s, absmax / 448, rtol=0, atol=0)
        # each byte is the nearest e4m3 (ties to even) to the fp32 quotient w / scale
        torch.testing.assert_close(decode(q).reshape(-1), nearest_e4m3(src[name] / s),
                                   rtol=0, atol=0)
    # everything else stays plain, in the source's dtype
    assert t["lm_head.weight"].dtype == torch.float32
    assert torch.equal(t["model.embed_tokens.weight"], src["model.embed_tokens.weight"])
    assert not any(k.endswith("input_scale") for k in t)


def _reference_hf_model(tiny_llama: Path, fp8_dir: Path):
    """transformers' Llama with every linear's weight = decode(bytes) * scale and its input
    fake-quantized per token by the test's own rounding: what a W8A8 reader computes."""
    from transformers import AutoModelForCausalLM

    t = load_file(str(fp8_dir / "model.safetensors"))
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    state = {}
    for name in [k for k in t if LINEAR.match(k)]:
        state[name] = (decode(t[name]) * t[name.removesuffix(".weight") + ".weight_scale"]
                       .double()).float()
    _, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected

    def fake_quant(_m, args):
        return (independent_fake_quant(args[0]).float(),)

    for name, module in hf.named_modules():
        if isinstance(module, torch.nn.Linear) and name != "lm_head":
            module.register_forward_pre_hook(fake_quant)
    return hf


def test_engine_greedy_matches_fp32_w8a8_reference(tiny_llama: Path, fp8_dir: Path, caplog):
    """Our engine (reference fp8 path on CPU, fp32) serves the checkpoint with the same greedy
    tokens as transformers running the decoded weights with per-token activation fake-quant."""
    from llmaccel import LLM, SamplingParams

    hf = _reference_hf_model(tiny_llama, fp8_dir)
    hf.generation_config.eos_token_id = None
    with caplog.at_level(logging.INFO, logger="llmaccel.models.layers.quant_configs"):
        llm = LLM(str(fp8_dir), dtype="float32", device="cpu", skip_tokenizer_init=True,
                  num_gpu_blocks=64)
    assert re.search(r"fp8 W8A8 per-channel/per-token \(reference\): .*qkv_proj x2", caplog.text)
    assert re.search(r"unquantized: lm_head", caplog.text)
    prompts = [[5, 17, 42, 99, 3], [120, 7], list(range(10, 30))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
                              pad_token_id=0)
        assert list(out.outputs[0].token_ids) == ref[0, len(prompt):].tolist()


def _our_logits(model_dir: Path, ids: list[int]) -> torch.Tensor:
    from llmaccel.models.attention import AttentionMetadata
    from llmaccel.models.loader import load_model

    _, model = load_model(str(model_dir), dtype="float32", device="cpu")
    meta = AttentionMetadata.for_prefill([len(ids)], "cpu")
    with torch.no_grad():
        return model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids)), meta))


def assert_w8a8_logits_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    """Logits of two implementations of the same W8A8 model. Not elementwise: a 1e-6
    difference in a hidden state (RMSNorm or attention summed in another order) can move one
    activation across an e4m3 rounding boundary, a jump of one e4m3 step (up to 6%) in that
    element, which then spreads to later positions. So most positions agree to fp32 noise and
    the whole stays within 3% (relative norm); dropping the activation quantization, the
    likeliest bug, is about 8% away on this model."""
    row_err = (ours - ref).abs().amax(-1)
    assert row_err.median() < 1e-4, row_err
    rel = float((ours - ref).norm() / ref.norm())
    assert rel < 3e-2, rel


def test_logits_match_reference(tiny_llama: Path, fp8_dir: Path):
    ids = list(range(3, 40))
    ref = _reference_hf_model(tiny_llama, fp8_dir)
    with torch.no_grad():
        expect = ref(torch.tensor([ids])).logits[0]
    assert_w8a8_logits_close(_our_logits(fp8_dir, ids), expect)


def test_loaded_layers_match_independent_math(fp8_dir: Path):
    """Every loaded linear (fused q/k/v and gate/up included) computes the independent W8A8
    math of the checkpoint's own tensors, stacked shard by shard: exact up to fp32 rounding."""
    from llmaccel.models.layers.linear import Linear
    from llmaccel.models.loader import load_model
    from llmaccel.models.layers.quant_configs import checkpoint_module_names

    t = load_file(str(fp8_dir / "model.safetensors"))
    _, model = load_model(str(fp8_dir), dtype="float32", device="cpu")
    gen = torch.Generator().manual_seed(5)
    checked = 0
    for module in model.modules():
        if not isinstance(module, Linear) or module.prefix == "lm_head":
            continue
        names = checkpoint_module_names(module.prefix)
        w = torch.cat([t[n + ".weight"] for n in names])
        s = torch.cat([t[n + ".weight_scale"] for n in names])
        x = torch.randn(7, module.input_size, generator=gen)
        with torch.no_grad():
            y = module(x)
        torch.testing.assert_close(y.double(), _independent_w8a8(x, w, s, None), rtol=1e-5,
                                   atol=1e-5)
        checked += 1
    assert checked == 8


def test_transformers_loads_our_checkpoint(fp8_dir: Path):
    """transformers (through compressed-tensors) reads the checkpoint and, running dynamic
    per-token fake-quant itself, gives our logits."""
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(fp8_dir, dtype=torch.float32).eval()
    ids = list(range(3, 40))
    with torch.no_grad():
        theirs = hf(torch.tensor([ids])).logits[0]
    assert_w8a8_logits_close(_our_logits(fp8_dir, ids), theirs)


def test_vllm_per_tensor_fp8_checkpoint(tiny_llama: Path, tmp_path: Path):
    """vLLM's `quant_method: fp8` (per-tensor scalar scales): fused q/k/v and gate/up keep each
    shard's own scale, so logits match the per-shard dequantized reference."""
    src = load_file(str(tiny_llama / "model.safetensors"))
    out, plain = {}, {}
    for name, w in src.items():
        m = LINEAR.match(name)
        if m is None:
            out[name] = plain[name] = w
            continue
        qw = quantize_fp8_weight(w, "tensor")
        out[name] = qw.weight
        out[m.group(1) + ".weight_scale"] = qw.weight_scale.reshape(())  # AutoFP8 writes 0-d
        plain[name] = qw.dequantize()
    fp8, ref = tmp_path / "fp8", tmp_path / "ref"
    for d, tensors in ((fp8, out), (ref, plain)):
        d.mkdir()
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(d / "model.safetensors"))
    cfg = json.loads((tiny_llama / "config.json").read_text())
    (ref / "config.json").write_text(json.dumps(cfg))
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                  "ignored_layers": ["model.layers.1.mlp.down_proj"]}
    (fp8 / "config.json").write_text(json.dumps(cfg))
    out.pop("model.layers.1.mlp.down_proj.weight_scale")
    out["model.layers.1.mlp.down_proj.weight"] = src["model.layers.1.mlp.down_proj.weight"]
    plain["model.layers.1.mlp.down_proj.weight"] = src["model.layers.1.mlp.down_proj.weight"]
    save_file({k: v.contiguous() for k, v in out.items()}, str(fp8 / "model.safetensors"))
    save_file({k: v.contiguous() for k, v in plain.items()}, str(ref / "model.safetensors"))

    from llmaccel.models.loader import load_model
    _, model = load_model(str(fp8), dtype="float32", device="cpu")
    qkv = model.model.layers[0].self_attn.qkv_proj
    scales = [float(out[f"model.layers.0.self_attn.{p}_proj.weight_scale"]) for p in "qkv"]
    rows = torch.tensor(scales).repeat_interleave(torch.tensor(qkv.output_sizes))
    assert torch.equal(qkv.weight_scale[:, 0], rows)
    assert isinstance(model.model.layers[1].mlp.down_proj.quant_method,
                      UnquantizedLinearMethod)
    # the reference model: plain weights (dequantized per tensor) with activation fake-quant
    ids = list(range(3, 30))
    ours = _our_logits(fp8, ids)
    from llmaccel.models.attention import AttentionMetadata
    _, plain_model = load_model(str(ref), dtype="float32", device="cpu")
    for name, module in plain_model.named_modules():
        if name.endswith("_proj") and name != "model.layers.1.mlp.down_proj":
            module.register_forward_pre_hook(
                lambda _m, args: (fake_quantize_fp8_per_token(args[0]),))
    meta = AttentionMetadata.for_prefill([len(ids)], "cpu")
    with torch.no_grad():
        expect = plain_model.compute_logits(plain_model(torch.tensor(ids),
                                                        torch.arange(len(ids)), meta))
    assert_w8a8_logits_close(ours, expect)


def test_layer_error_report_includes_activation_quant(tiny_llama: Path, tmp_path: Path):
    from llmaccel.quant.driver import quantize_model

    ids = torch.randint(0, CONFIG["vocab_size"], (2, 32), generator=torch.Generator()
                        .manual_seed(0))
    report = quantize_model(tiny_llama, method="fp8", out_dir=tmp_path / "q", device="cpu",
                            calib_token_ids=ids, show_progress=False)
    assert len(report.layer_error) == 2 and all(0 < e < 0.01 for e in report.layer_error)
    assert len(report.layer_error_rtn) == 2  # int8 RTN per channel, on the same inputs


# ------------------------------------------------------------------------------- errors


def test_cli_fp8_contradictory_bits(tiny_llama: Path, tmp_path: Path):
    r = run_llmaccel("quantize", str(tiny_llama), "--method", "fp8", "--bits", "4",
                     "--out", str(tmp_path / "x"))
    assert "--bits" in one_line_error(r) and "fp8" in one_line_error(r)


@pytest.mark.parametrize("kwargs, match", [
    ({"sym": False}, "asym"),
    ({"format": "gptq"}, "compressed-tensors"),
])
def test_fp8_contradictory_settings(tiny_llama: Path, tmp_path: Path, kwargs, match):
    from llmaccel.quant.driver import quantize_model

    with pytest.raises(QuantizationError, match=match):
        quantize_model(tiny_llama, method="fp8", out_dir=tmp_path / "x", **kwargs)


def _rewrite(src: Path, dst: Path, edit) -> Path:
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    state = load_file(str(src / "model.safetensors"))
    edit(state)
    save_file(state, str(dst / "model.safetensors"))
    return dst


@pytest.mark.parametrize("case, match", [
    ("scale_transposed", r"model\.layers\.0\.mlp\.up_proj\.weight_scale.*shape \(1, 256\)"),
    ("scale_short", r"model\.layers\.0\.mlp\.up_proj\.weight_scale.*shape \(255, 1\)"),
    ("weight_int8", r"model\.layers\.0\.mlp\.up_proj\.weight.*float8_e4m3fn, got torch\.int8"),
    ("weight_bf16", r"model\.layers\.0\.mlp\.up_proj\.weight.*got torch\.bfloat16"),
    ("weight_nan", r"model\.layers\.0\.mlp\.gate_up_proj\.weight holds e4m3 NaN"),
    ("scale_inf", r"model\.layers\.0\.mlp\.gate_up_proj\.weight_scale must be finite"),
])
def test_corrupt_checkpoint_names_the_tensor(fp8_dir: Path, tmp_path: Path, case, match):
    from llmaccel.models.loader import load_model

    w, s = "model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.up_proj.weight_scale"

    def edit(state):
        if case == "scale_transposed":
            state[s] = state[s].t().contiguous()
        elif case == "scale_short":
            state[s] = state[s][:-1].contiguous()
        elif case == "weight_int8":
            state[w] = state[w].view(torch.int8).clone()
        elif case == "weight_bf16":
            state[w] = state[w].to(torch.bfloat16)
        elif case == "weight_nan":
            raw = state[w].view(torch.uint8).clone()
            raw[5, 7] = 0x7F
            state[w] = raw.view(torch.float8_e4m3fn)
        else:
            state[s] = state[s].clone()
            state[s][3, 0] = float("inf")

    bad = _rewrite(fp8_dir, tmp_path / "bad", edit)
    with pytest.raises(CorruptCheckpointError, match=match):
        load_model(str(bad), dtype="float32", device="cpu")


def _ct(edit) -> dict:
    qc = fp8_quantization_config()
    edit(qc["config_groups"]["group_0"])
    return {"quantization_config": qc}


@pytest.mark.parametrize("hf, key", [
    (_ct(lambda g: g["input_activations"].update(dynamic=False)), "input_activations.dynamic"),
    (_ct(lambda g: g["input_activations"].update(strategy="tensor")),
     "input_activations.strategy"),
    (_ct(lambda g: g.update(input_activations=None)), "input_activations"),
    (_ct(lambda g: g["weights"].update(strategy="block", block_structure=[128, 128])),
     "weights.strategy"),
    (_ct(lambda g: g["weights"].update(num_bits=4)), "weights.num_bits"),
    (_ct(lambda g: g["weights"].update(type="int")), "format"),
    ({"quantization_config": {"quant_method": "fp8", "activation_scheme": "static"}},
     "activation_scheme"),
    ({"quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic",
                              "weight_block_size": [128, 128]}}, "weight_block_size"),
])
def test_unsupported_fp8_configs_name_the_key(hf, key):
    with pytest.raises(QuantizationError, match=re.escape(key)):
        quant_config_from_hf(hf)


# --------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 3, 17, 100])
@pytest.mark.parametrize("n, k", [(48, 64), (272, 160), (2048, 1024)])
def test_scaled_mm_matches_reference_on_gpu(m, n, k, dtype):
    """torch._scaled_mm (row-wise scales) against the fp32 reference on the same e4m3 inputs.
    Both round the same fp32 quantity to `dtype` once; they differ only in the fp32 summation
    order, so allow two units in the last place of `dtype` (relative) plus a small absolute
    slack for outputs that cancel to near zero."""
    from llmaccel.models.layers.fp8_linear import scaled_mm_dtypes

    if not torch.cuda.is_available() or not scaled_mm_dtypes("cuda"):
        pytest.skip("needs a CUDA GPU with compute capability >= 8.9")
    if dtype not in scaled_mm_dtypes("cuda"):
        pytest.skip(f"this torch build's _scaled_mm has no row-wise {dtype} output")
    gen = torch.Generator(device="cuda").manual_seed(m * 7 + n + k)
    w = torch.randn(n, k, device="cuda", generator=gen) * 0.05
    qw = quantize_fp8_weight(w)
    x = (torch.randn(m, k, device="cuda", generator=gen) * 3).to(dtype)
    bias = torch.randn(n, device="cuda", generator=gen).to(dtype)
    fast = fp8_linear(x, qw.weight, qw.weight_scale, bias, use_scaled_mm=True)
    ref = fp8_linear(x, qw.weight, qw.weight_scale, bias, use_scaled_mm=False)
    ref_nobias = fp8_linear(x, qw.weight, qw.weight_scale, None, use_scaled_mm=False)
    assert fast.dtype == ref.dtype == dtype and fast.shape == ref.shape == (m, n)
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(fast.float(), ref.float(), rtol=2 * eps,
                               atol=2 * eps * ref.float().abs().mean().item())
    # and the reference itself is the independent fp64 math
    y64 = _independent_w8a8(x.cpu().float(), qw.weight.cpu(), qw.weight_scale.cpu(), None)
    torch.testing.assert_close(ref_nobias.cpu().double(), y64, rtol=4 * eps,
                               atol=4 * eps * y64.abs().mean().item())


@pytest.mark.gpu
def test_engine_runs_scaled_mm_on_gpu(fp8_dir: Path, caplog):
    """The checkpoint on CUDA: every layer logs and runs _scaled_mm, and agrees with the
    reference path on the same inputs (the loaded tensors wired right); the engine then
    generates through CUDA graphs. Whole-model logits are not compared with the CPU: Hopper's
    fp8 accumulation is not exact fp32 (about 1e-4 relative), and in this random model such
    differences move activations across e4m3 rounding boundaries layer after layer."""
    from llmaccel import LLM, SamplingParams
    from llmaccel.models.layers.linear import Linear
    from llmaccel.models.loader import load_model
    from llmaccel.models.layers.fp8_linear import Fp8LinearMethod, scaled_mm_dtypes

    if not torch.cuda.is_available() or torch.bfloat16 not in scaled_mm_dtypes("cuda"):
        pytest.skip("needs a CUDA GPU with compute capability >= 8.9")
    with caplog.at_level(logging.INFO, logger="llmaccel.models.layers.quant_configs"):
        _, model = load_model(str(fp8_dir), dtype="bfloat16", device="cuda")
    assert "fp8 W8A8 per-channel/per-token (torch._scaled_mm" in caplog.text
    gen = torch.Generator(device="cuda").manual_seed(0)
    eps = torch.finfo(torch.bfloat16).eps
    for module in model.modules():
        if isinstance(module, Linear) and isinstance(module.quant_method, Fp8LinearMethod):
            x = torch.randn(37, module.input_size, device="cuda", generator=gen,
                            dtype=torch.bfloat16)
            with torch.no_grad():
                fast = module(x).float()
            ref = fp8_linear(x, module.weight, module.weight_scale, None,
                             use_scaled_mm=False).float()
            torch.testing.assert_close(fast, ref, rtol=2 * eps,
                                       atol=2 * eps * ref.abs().mean().item())
    llm = LLM(str(fp8_dir), dtype="bfloat16", device="cuda", skip_tokenizer_init=True,
              num_gpu_blocks=64)
    outs = llm.generate([{"prompt_token_ids": p} for p in ([5, 17, 42], list(range(10, 30)))],
                        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 8 for o in outs)


@pytest.mark.parametrize("method,args,want", [
    ("fp8", [], 16), ("rtn", [], 16), ("gptq", [], 128), ("fp8", ["--n-samples", "40"], 40)])
def test_cli_reads_less_calibration_text_for_calibration_free_methods(method, args, want,
                                                                       monkeypatch, tmp_path):
    """RTN, FP8, NF4 and HQQ use the calibration text only for the error report: the CLI's
    default is 16 sequences for them, 128 for GPTQ and AWQ, and --n-samples wins."""
    from typer.testing import CliRunner

    from llmaccel.cli import app
    from llmaccel.quant import driver

    seen = {}

    def fake(model, **kw):
        seen["n"] = kw["calib"].n_samples
        raise driver.LLMAccelError("stop here")

    monkeypatch.setattr(driver, "quantize_model", fake)
    r = CliRunner().invoke(app, ["quantize", "some-model", "--method", method, *args,
                                 "--out", str(tmp_path / "q")])
    assert seen == {"n": want}, r.output
