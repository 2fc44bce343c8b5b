"""Packed GPTQ / AWQ / compressed-tensors checkpoints through our loader and engine (CPU).

A tiny random model has every decoder Linear quantized with RTN and packed by our format
writers; the same dequantized weights are also saved as a plain fp32 checkpoint. Our engine on
the packed checkpoint must match our model on the plain one (logits) and transformers on the
plain one (greedy tokens).
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import make_tiny_model, tiny_configs

from llmaccel import LLM, SamplingParams
from llmaccel.errors import CorruptCheckpointError, QuantizationError
from llmaccel.models.attention import AttentionMetadata
from llmaccel.models.config import _quant_config
from llmaccel.models.loader import load_model
from llmaccel.quant.formats.awq import awq_quantization_config, pack_awq
from llmaccel.quant.formats.compressed_tensors import (
    compressed_tensors_quantization_config,
    pack_compressed_tensors,
)
from llmaccel.quant.formats.gptq import gptq_quantization_config, pack_gptq
from llmaccel.models.layers.quant_configs import quant_config_from_hf
from llmaccel.quant.rtn import QuantizedWeight, dequantize, quantize_rtn

# hidden 64, intermediate 96: every in_features is a multiple of 32, every output of 8
GROUP = 32
LINEAR = re.compile(r"(.*\.(q|k|v|o|gate|up|down)_proj)\.weight$")
LENGTHS = [7, 1, 13]


@dataclass
class Case:
    fmt: str  # gptq | awq | ct
    bits: int = 4
    group_size: int = GROUP
    sym: bool = True
    scale_dtype: torch.dtype = torch.float16
    skip: tuple[str, ...] = ()  # module-name fragments left unquantized
    act_order: bool = False  # GPTQ: a random g_idx permutation per module
    checkpoint_format: str = "gptq"
    extra: dict = field(default_factory=dict)


CASES = {
    "gptq-w4-sym": Case("gptq"),
    "gptq-w4-asym-v2": Case("gptq", sym=False, checkpoint_format="gptq_v2"),
    "gptq-w4-asym-v1-actorder": Case("gptq", sym=False, act_order=True),
    "gptq-w8-channel": Case("gptq", bits=8, group_size=-1),
    "awq-w4-zp": Case("awq", sym=False),
    "awq-w4-skip-down": Case("awq", sym=True, skip=("down_proj",)),
    "ct-w4-sym": Case("ct"),
    "ct-w4-asym-skip-down": Case("ct", sym=False, skip=("down_proj",)),
    "ct-w8-channel-bf16": Case("ct", bits=8, group_size=-1, scale_dtype=torch.bfloat16),
}


def _quantize(w: torch.Tensor, case: Case, gen: torch.Generator
              ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """(packed tensors without prefix, the dequantized fp32 weight they stand for)."""
    if case.act_order:
        # act-order: groups follow a permutation of the input channels; codes stay in order
        perm = torch.randperm(w.shape[1], generator=gen)
        qp = quantize_rtn(w[:, perm], case.bits, case.group_size, case.sym, case.scale_dtype)
        codes = torch.empty_like(qp.codes)
        codes[:, perm] = qp.codes
        packed = pack_gptq(QuantizedWeight(codes, qp.scales, qp.zeros, case.bits,
                                           case.group_size, case.sym), case.checkpoint_format)
        g_idx = torch.empty(w.shape[1], dtype=torch.int32)
        g_idx[perm] = torch.arange(w.shape[1], dtype=torch.int32) // case.group_size
        packed["g_idx"] = g_idx
        deq = torch.empty_like(w)
        deq[:, perm] = dequantize(qp)
        return packed, deq
    qw = quantize_rtn(w, case.bits, case.group_size, case.sym, case.scale_dtype)
    if case.fmt == "gptq":
        packed = pack_gptq(qw, case.checkpoint_format)
    elif case.fmt == "awq":
        packed = pack_awq(qw.codes, qw.scales, qw.zeros, case.group_size)
    else:
        packed = pack_compressed_tensors(qw.codes, qw.scales, None if case.sym else qw.zeros,
                                         num_bits=case.bits, group_size=case.group_size,
                                         symmetric=case.sym)
    return packed, dequantize(qw)


def _hf_quant_config(case: Case) -> dict:
    if case.fmt == "gptq":
        return gptq_quantization_config(case.bits, case.group_size, case.sym,
                                        desc_act=case.act_order,
                                        checkpoint_format=case.checkpoint_format)
    if case.fmt == "awq":
        return awq_quantization_config(case.group_size, zero_point=not case.sym,
                                       modules_to_not_convert=list(case.skip) or None)
    return compressed_tensors_quantization_config(
        case.bits, case.group_size, case.sym,
        ignore=["lm_head", *(f"re:.*{s}$" for s in case.skip)])


def write_checkpoints(case: Case, root: Path, family: str = "qwen2") -> tuple[Path, Path]:
    """(packed checkpoint dir, plain dequantized fp32 checkpoint dir)."""
    plain_dir, packed_dir = root / "plain", root / "packed"
    hf = make_tiny_model(tiny_configs()[family], root / "orig")
    gen = torch.Generator().manual_seed(1)
    packed: dict[str, torch.Tensor] = {}
    state = hf.state_dict()
    with torch.no_grad():
        for name, tensor in state.items():
            m = LINEAR.match(name)
            if m is None or any(s in name for s in case.skip):
                packed[name] = tensor.clone()
                continue
            tensors, deq = _quantize(tensor, case, gen)
            tensor.copy_(deq)  # the HF model now holds the dequantized weights
            packed.update({f"{m.group(1)}.{k}": v for k, v in tensors.items()})
    hf.save_pretrained(plain_dir)
    packed_dir.mkdir()
    save_file({k: v.contiguous() for k, v in packed.items()},
              str(packed_dir / "model.safetensors"))
    config = json.loads((plain_dir / "config.json").read_text())
    config["quantization_config"] = _hf_quant_config(case)
    (packed_dir / "config.json").write_text(json.dumps(config))
    return packed_dir, plain_dir


@pytest.fixture(scope="module", params=list(CASES))
def checkpoints(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    return (CASES[request.param], *write_checkpoints(CASES[request.param], root))


def _logits(model, seqs):
    meta = AttentionMetadata.for_prefill(LENGTHS, "cpu")
    positions = torch.cat([torch.arange(n) for n in LENGTHS])
    with torch.no_grad():
        return model.compute_logits(model(torch.cat(seqs), positions, meta))


def test_packed_logits_match_dequantized_reference(checkpoints, caplog):
    case, packed_dir, plain_dir = checkpoints
    with caplog.at_level(logging.INFO, logger="llmaccel.models.layers.quant_configs"):
        mc, ours = load_model(str(packed_dir), dtype="float32", device="cpu")
    _, ref = load_model(str(plain_dir), dtype="float32", device="cpu")
    assert mc.quant_config is not None and ref.quant_config is None
    seqs = [torch.randint(0, 160, (n,), generator=torch.Generator().manual_seed(n))
            for n in LENGTHS]
    torch.testing.assert_close(_logits(ours, seqs), _logits(ref, seqs), atol=1e-4, rtol=0)
    # the method of every layer is logged once, and skipped layers really stay plain
    log = caplog.text
    assert re.search(r"unquantized: .*lm_head", log)
    assert re.search(rf"int{case.bits} .*qkv_proj x2", log)
    down = ours.model.layers[0].mlp.down_proj
    assert hasattr(down, "weight") == bool(case.skip)
    assert hasattr(ours.model.layers[0].self_attn.qkv_proj, "codes")


def test_engine_greedy_matches_transformers_on_dequantized(checkpoints):
    from transformers import AutoModelForCausalLM

    case, packed_dir, plain_dir = checkpoints
    if case.fmt == "gptq" and case.bits == 8:
        pytest.skip("one engine run per format family keeps the suite fast")
    hf = AutoModelForCausalLM.from_pretrained(plain_dir, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # run the full length, like ignore_eos
    llm = LLM(str(packed_dir), dtype="float32", device="cpu", skip_tokenizer_init=True,
              num_gpu_blocks=64)
    prompts = [[5, 17, 42, 99, 3], [120, 7], list(range(10, 30))]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
                              pad_token_id=0)
        assert list(out.outputs[0].token_ids) == ref[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def gptq_dir(tmp_path_factory):
    return write_checkpoints(CASES["gptq-w4-sym"], tmp_path_factory.mktemp("gptq-err"))[0]


def _rewrite(src: Path, dst: Path, tensors=None, config=None) -> Path:
    dst.mkdir()
    cfg = json.loads((src / "config.json").read_text())
    if config:
        config(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    state = load_file(str(src / "model.safetensors"))
    if tensors:
        tensors(state)
    save_file(state, str(dst / "model.safetensors"))
    return dst


def test_corrupt_packed_shape_names_the_tensor(gptq_dir, tmp_path):
    name = "model.layers.1.self_attn.k_proj.qweight"

    def cut(state):
        state[name] = state[name][:, :-8].contiguous()

    bad = _rewrite(gptq_dir, tmp_path / "bad", tensors=cut)
    with pytest.raises(CorruptCheckpointError, match=re.escape(name)):
        load_model(str(bad), dtype="float32", device="cpu")


def test_float_packed_words_are_corrupt(gptq_dir, tmp_path):
    name = "model.layers.0.mlp.down_proj.qzeros"

    def to_float(state):
        state[name] = state[name].float()

    bad = _rewrite(gptq_dir, tmp_path / "bad", tensors=to_float)
    with pytest.raises(CorruptCheckpointError, match=re.escape(name)):
        load_model(str(bad), dtype="float32", device="cpu")


def test_unsupported_bits_is_a_quantization_error(gptq_dir, tmp_path):
    bad = _rewrite(gptq_dir, tmp_path / "bad",
                   config=lambda c: c["quantization_config"].update(bits=3))
    with pytest.raises(QuantizationError, match="bits"):
        load_model(str(bad), dtype="float32", device="cpu")


@pytest.mark.parametrize("qc, key", [
    ({"quant_method": "bitsandbytes"}, "quant_method"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "version"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "lm_head": "yes"}, "lm_head"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"},
     "checkpoint_format"),
    ({**compressed_tensors_quantization_config(4, 128), "format": "float-quantized"}, "format"),
])
def test_unsupported_settings_name_the_key(qc, key):
    with pytest.raises(QuantizationError, match=key):
        quant_config_from_hf({"quantization_config": qc})


def test_compressed_tensors_activation_quant_is_refused():
    qc = compressed_tensors_quantization_config(4, 128)
    qc["config_groups"]["group_0"]["input_activations"] = {"num_bits": 8}
    with pytest.raises(QuantizationError, match="input_activations"):
        quant_config_from_hf({"quantization_config": qc})


def test_unquantized_and_gguf_configs_get_no_quant_config():
    from transformers import LlamaConfig

    assert quant_config_from_hf({"model_type": "llama"}) is None
    # transformers puts a quantization_config on configs read from GGUF; those tensors come
    # back dequantized, so the loader must not treat them as packed
    cfg = LlamaConfig(quantization_config={"quant_method": "gguf"})
    assert _quant_config(cfg, "gguf") is None
    with pytest.raises(QuantizationError):
        _quant_config(cfg, "safetensors")


def test_compressed_tensors_wrong_weight_shape_names_the_layer(tmp_path):
    packed_dir, _ = write_checkpoints(CASES["ct-w4-sym"], tmp_path / "ct")
    name = "model.layers.0.mlp.up_proj.weight_shape"

    def swap(state):
        state[name] = state[name].flip(0).contiguous()

    bad = _rewrite(packed_dir, tmp_path / "bad", tensors=swap)
    with pytest.raises(CorruptCheckpointError, match=r"layers\.0\.mlp\.gate_up_proj"):
        load_model(str(bad), dtype="float32", device="cpu")
