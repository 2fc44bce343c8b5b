"""Loaders: dummy shapes, dummy weights for any config.json, dtype, missing weights; rope."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig

from llmaccel.analyze import parameter_counts
from llmaccel import LLM, SamplingParams
from llmaccel.errors import CorruptCheckpointError, LLMAccelError
from llmaccel.models.config import make_model_config
from llmaccel.models.layers.rotary import compute_inv_freq, rope_parameters
from llmaccel.models.loader import get_model, load_model
from llmaccel.models.shapes import SHAPES
from tiny_models import make_tiny_model, tiny_configs


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_shapes_build_with_their_parameter_count(shape):
    """On the meta device (no memory): our model, transformers' model and analyze agree."""
    mc = make_model_config(shape)
    assert mc.load_format == "dummy"
    ours = get_model(mc, device="meta")
    with torch.device("meta"):
        theirs = AutoModelForCausalLM.from_config(mc.hf_config)
    n_ours = sum(p.numel() for p in ours.parameters())
    assert n_ours == sum(p.numel() for p in theirs.parameters())
    assert n_ours == parameter_counts(mc.hf_config)["total"]


def test_dummy_shape_generates_in_bf16():
    mc, model = load_model("smollm2-135m", dtype="bfloat16", device="cpu")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    norms = [p for n, p in model.named_parameters() if n.endswith("norm.weight")]
    assert all(bool((p == 1).all()) for p in norms)
    weights = model.model.layers[0].self_attn.qkv_proj.weight
    assert 0.02 < weights.abs().max().item() <= 0.02 * 3 ** 0.5 * 1.01  # bf16 rounding
    assert abs(weights.float().std().item() - 0.02) < 0.002
    llm = LLM("smollm2-135m", dtype="bfloat16", device="cpu", max_model_len=256)
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4


def test_dummy_weights_for_any_config_json(tmp_path):
    tiny_configs()["qwen2"].save_pretrained(tmp_path)  # config.json only, no weights
    mc, model = load_model(str(tmp_path), load_format="dummy", device="cpu")
    assert mc.load_format == "dummy" and mc.architecture == "Qwen2ForCausalLM"
    assert model.model.layers[1].self_attn.qkv_proj.bias is not None
    with pytest.raises(CorruptCheckpointError, match="no \\*.safetensors"):
        load_model(str(tmp_path), device="cpu")


def test_missing_weight_is_reported(tmp_path):
    make_tiny_model(tiny_configs()["llama"], tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(CorruptCheckpointError, match="lacks 1 weights.*layers.1.self_attn.qkv"):
        load_model(str(tmp_path), device="cpu")


def test_wrong_shape_is_reported(tmp_path):
    make_tiny_model(tiny_configs()["llama"], tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["intermediate_size"] = 80
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CorruptCheckpointError, match="does not match its config"):
        load_model(str(tmp_path), device="cpu")


def test_sliding_window_caps_max_model_len(tmp_path):
    config = tiny_configs()["mistral"]
    config.sliding_window = 32
    config.save_pretrained(tmp_path)
    assert make_model_config(str(tmp_path)).max_model_len == 32
    with pytest.raises(LLMAccelError, match="max_model_len=64 is out of range"):
        make_model_config(str(tmp_path), max_model_len=64)


def test_load_format_mismatch():
    with pytest.raises(LLMAccelError, match="load_format"):
        make_model_config("llama-3.2-1b", load_format="safetensors")
    with pytest.raises(LLMAccelError, match="unknown load_format"):
        make_model_config("llama-3.2-1b", load_format="pt")


@pytest.mark.parametrize("name", ["llama3-rope", "llama"])
def test_inv_freq_matches_transformers(name):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = tiny_configs()[name]
    params = rope_parameters(config)
    ours = compute_inv_freq(config.hidden_size // config.num_attention_heads, params)
    if params["rope_type"] == "default":
        theirs, _ = LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    else:
        theirs, _ = ROPE_INIT_FUNCTIONS[params["rope_type"]](config)
    torch.testing.assert_close(ours, theirs.float())


def test_llama32_shape_rope_is_scaled():
    params = rope_parameters(make_model_config("llama-3.2-1b").hf_config)
    assert params["rope_type"] == "llama3" and params["factor"] == 32.0
    assert params["rope_theta"] == 500000.0


def test_unsupported_rope_type(tmp_path):
    LlamaConfig(hidden_size=32, intermediate_size=48, num_attention_heads=4,
                num_hidden_layers=1, rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                   "original_max_position_embeddings": 512}
                ).save_pretrained(tmp_path)
    with pytest.raises(LLMAccelError, match="rope_type 'yarn'"):
        make_model_config(str(tmp_path))


def test_missing_tokenizer_is_named(tmp_path):
    from llmaccel.models.tokenizer import get_tokenizer
    tiny_configs()["llama"].save_pretrained(tmp_path)
    with pytest.raises(LLMAccelError, match="has no tokenizer files"):
        get_tokenizer(make_model_config(str(tmp_path), load_format="dummy"))
    with pytest.raises(LLMAccelError, match="no tokenizer; pass one with --tokenizer"):
        get_tokenizer(make_model_config("llama-3.2-1b"))


def test_dummy_weights_in_every_quantization_preset(tmp_path):
    """Dummy loads (speed runs) work for every preset, float8 weights included (float8 has
    no uniform_), and FP8's scales are positive with weight * scale in the dummy range."""
    from llmaccel.quant.presets import PRESETS, preset_config

    cfg = tiny_configs()["llama"]
    cfg.hidden_size, cfg.intermediate_size = 128, 256  # every linear a multiple of group 128
    cfg.head_dim = 128 // cfg.num_attention_heads
    cfg.save_pretrained(tmp_path)
    for name in PRESETS:
        llm = LLM(str(tmp_path), load_format="dummy", dtype="float32", device="cpu",
                  skip_tokenizer_init=True, max_model_len=64,
                  hf_overrides={"quantization_config": preset_config(name)})
        out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=2,
                                                       ignore_eos=True), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 2, name
        if name == "fp8":
            proj = llm.engine.model.model.layers[0].self_attn.qkv_proj
            assert proj.weight.dtype == torch.float8_e4m3fn
            scale = proj.weight_scale
            assert bool((scale > 0).all())
            w = proj.weight.float() * scale
            assert 0.5 * 0.02 * 3 ** 0.5 < w.abs().max().item() <= 0.02 * 3 ** 0.5 * 1.01
