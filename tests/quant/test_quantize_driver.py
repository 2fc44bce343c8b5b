"""End-to-end `quantize_model` on a tiny random Llama: files, tensor layouts, configs, errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import LlamaConfig

from llmaccel.quant.calibration import (
    CalibConfig,
    CalibrationError,
    calibration_batches,
    sample_windows,
)
from llmaccel.quant.driver import quantize_model
from tests.cli_helpers import one_line_error, run_llmaccel
from tests.conftest import generated_wikitext_dir
from tests.tiny_models import make_tiny_model

# Generated text: layouts, seeding and error bounds need text, not WikiText in particular.
DATA = str(generated_wikitext_dir())
VOCAB = 384
# in_features 128 / 256 so group 128 tiles every linear; GQA (2 kv heads) so v->o is not folded
CONFIG = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              tie_word_embeddings=False)


def _tiny_tokenizer(directory: Path) -> None:
    """A byte-level BPE trained on the generated validation text, saved as an HF tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = (Path(DATA) / "wikitext-2-raw" / "wiki.valid.raw").read_text(encoding="utf-8")
    tok.train_from_iterator(text.splitlines(), trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>",
                            eos_token="</s>").save_pretrained(directory)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("tiny_llama")
    make_tiny_model(LlamaConfig(**CONFIG), d, seed=0)
    _tiny_tokenizer(d)
    return d


@pytest.fixture(scope="module")
def results(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = {}
    calib = CalibConfig(DATA, n_samples=8, seq_len=64, seed=0)
    for method in ("rtn", "gptq", "awq"):
        d = tmp_path_factory.mktemp(f"q_{method}")
        report = quantize_model(tiny_llama, method=method, bits=4, group_size=128, out_dir=d,
                                calib=calib, device="cpu", show_progress=False)
        out[method] = (d, report)
    return out


def _tensors(d: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def test_calibration_windows_are_seeded_and_full_length(tiny_llama: Path) -> None:
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    a = calibration_batches(tok, CalibConfig(DATA, n_samples=4, seq_len=32, seed=1))
    b = calibration_batches(tok, CalibConfig(DATA, n_samples=4, seq_len=32, seed=1))
    assert a.shape == (4, 32) and torch.equal(a, b)
    assert int(a.max()) < VOCAB
    with pytest.raises(CalibrationError, match="fewer than seq_len"):
        sample_windows(torch.arange(10), 2, 32)


def test_gptq_checkpoint_layout(results: dict) -> None:
    from transformers import GPTQConfig
    d, _ = results["gptq"]
    t = _tensors(d)
    p = "model.layers.0.self_attn.q_proj."
    assert t[p + "qweight"].shape == (128 // 8, 128) and t[p + "qweight"].dtype == torch.int32
    assert t[p + "qzeros"].shape == (1, 128 // 8) and t[p + "qzeros"].dtype == torch.int32
    assert t[p + "scales"].shape == (1, 128) and t[p + "scales"].dtype == torch.float16
    assert t[p + "g_idx"].shape == (128,)
    assert t["model.layers.1.mlp.down_proj.qweight"].shape == (256 // 8, 128)
    assert "model.layers.0.self_attn.q_proj.weight" not in t
    assert t["lm_head.weight"].shape == (VOCAB, 128)
    qc = json.loads((d / "config.json").read_text())["quantization_config"]
    cfg = GPTQConfig.from_dict(qc)
    assert (cfg.bits, cfg.group_size, cfg.sym) == (4, 128, True)
    assert (d / "tokenizer.json").is_file() and (d / "quantize_report.json").is_file()


def test_awq_checkpoint_layout(results: dict) -> None:
    from transformers import AwqConfig
    d, report = results["awq"]
    t = _tensors(d)
    p = "model.layers.0.mlp.gate_proj."
    assert t[p + "qweight"].shape == (128, 256 // 8) and t[p + "qweight"].dtype == torch.int32
    assert t[p + "qzeros"].shape == (1, 256 // 8)
    assert t[p + "scales"].shape == (1, 256) and t[p + "scales"].dtype == torch.float16
    assert report.sym is False
    qc = json.loads((d / "config.json").read_text())["quantization_config"]
    cfg = AwqConfig.from_dict(qc)
    assert (cfg.bits, cfg.group_size, cfg.zero_point) == (4, 128, True)
    # scales were folded into the norms: they differ from the source's
    assert "model.layers.0.input_layernorm.weight" in t


def test_rtn_compressed_tensors_layout(results: dict) -> None:
    d, report = results["rtn"]
    t = _tensors(d)
    p = "model.layers.1.mlp.up_proj."
    assert t[p + "weight_packed"].shape == (256, 128 // 8)
    assert t[p + "weight_packed"].dtype == torch.int32
    assert t[p + "weight_scale"].shape == (256, 1)
    assert t[p + "weight_shape"].tolist() == [256, 128]
    qc = json.loads((d / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "pack-quantized"
    assert report.layer_error == pytest.approx(report.layer_error_rtn)


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_layer_error_not_worse_than_rtn(results: dict, method: str) -> None:
    _, report = results[method]
    print(method, "layer error", report.layer_error, "rtn", report.layer_error_rtn)
    assert len(report.layer_error) == 2
    for err, rtn in zip(report.layer_error, report.layer_error_rtn):
        assert err <= rtn * 1.02, (report.layer_error, report.layer_error_rtn)


def test_cli_quantize(tiny_llama: Path, tmp_path: Path) -> None:
    out = tmp_path / "q"
    r = run_llmaccel("quantize", str(tiny_llama), "--method", "gptq", "--n-samples", "4",
                     "--seq-len", "32", "--out", str(out), "--device", "cpu", "--data", DATA)
    assert r.returncode == 0, r.stderr
    assert (out / "model.safetensors").is_file()
    report = json.loads((out / "quantize_report.json").read_text())
    assert report["method"] == "gptq" and report["format"] == "gptq"


@pytest.mark.parametrize("sink_weight,expected", [(None, 2.0), (1.0, 1.0), (5.0, 5.0)])
def test_gptq_weights_each_sequence_first_token(tiny_llama: Path, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch,
                                                sink_weight, expected) -> None:
    """Each Hessian update is one calibration sequence whose first row (the attention sink)
    carries `sink_weight` (default seq_len / 64: 2 for 128-token sequences)."""
    from llmaccel.quant import gptq

    seen = []
    add = gptq.HessianAccumulator.add

    def spy(self, x, first_row_weight=1.0):
        seen.append((x.reshape(-1, x.shape[-1]).shape[0], first_row_weight))
        return add(self, x, first_row_weight)

    monkeypatch.setattr(gptq.HessianAccumulator, "add", spy)
    quantize_model(tiny_llama, method="gptq", bits=4, group_size=128, out_dir=tmp_path / "q",
                   calib=CalibConfig(DATA, n_samples=2, seq_len=128, seed=0),
                   device="cpu", show_progress=False, compare_rtn=False,
                   sink_weight=sink_weight)
    assert seen and set(seen) == {(128, expected)}


def test_cli_bad_bits(tiny_llama: Path, tmp_path: Path) -> None:
    r = run_llmaccel("quantize", str(tiny_llama), "--bits", "3", "--out", str(tmp_path / "x"))
    assert "bits" in one_line_error(r)


def _dequantized_state(d: Path, fmt: str) -> dict[str, torch.Tensor]:
    """The checkpoint read back with the formats' unpackers: plain HF weights in fp32."""
    from llmaccel.quant.formats.awq import unpack_awq
    from llmaccel.quant.formats.compressed_tensors import unpack_compressed_tensors
    from llmaccel.quant.formats.gptq import unpack_gptq

    t = _tensors(d)
    marker = {"gptq": ".qweight", "awq": ".qweight", "compressed-tensors": ".weight_packed"}[fmt]
    state = {k: v.float() for k, v in t.items() if v.is_floating_point()}
    for key in [k for k in t if k.endswith(marker)]:
        p = key[: -len(marker)]
        if fmt == "gptq":
            codes, scales, zeros, g_idx = unpack_gptq(
                {n: t[f"{p}.{n}"] for n in ("qweight", "qzeros", "scales", "g_idx")}, 4, 128)
            g = g_idx.long()
        elif fmt == "awq":
            codes, scales, zeros = unpack_awq(t[p + ".qweight"], t[p + ".qzeros"],
                                              t[p + ".scales"], 128)
            g = torch.arange(codes.shape[1]) // 128
        else:
            codes, scales, zeros = unpack_compressed_tensors(
                t[p + ".weight_packed"], t[p + ".weight_scale"], t[p + ".weight_shape"],
                t.get(p + ".weight_zero_point"))
            g = torch.arange(codes.shape[1]) // 128
        w = (codes.long() - zeros.long()[:, g]).float() * scales.float()[:, g]
        state[p + ".weight"] = w
        for n in (".qzeros", ".scales", ".weight_scale"):
            state.pop(p + n, None)
    return state


@pytest.mark.parametrize("method,fmt", [("rtn", "compressed-tensors"), ("gptq", "gptq"),
                                        ("awq", "awq")])
def test_checkpoint_reads_back_close_to_original(tiny_llama: Path, results: dict, method: str,
                                                 fmt: str) -> None:
    """Logits of the unpacked checkpoint stay close to the fp model's: catches a wrong pack
    order, a scale folded into the wrong side, or a layer stored twice."""
    from transformers import AutoModelForCausalLM
    d, _ = results[method]
    ref = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    deq = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    missing, unexpected = deq.load_state_dict(_dequantized_state(d, fmt), strict=False)
    assert not unexpected and not missing
    if method == "rtn":  # RTN has no data dependence: every weight must match exactly
        from llmaccel.quant.rtn import dequantize, quantize_rtn
        w = ref.model.layers[1].mlp.down_proj.weight.data
        expect = dequantize(quantize_rtn(w, 4, 128, True, scale_dtype=torch.float32))
        assert torch.equal(deq.model.layers[1].mlp.down_proj.weight.data, expect)
    from transformers import AutoTokenizer
    text = (Path(DATA) / "wikitext-2-raw" / "wiki.test.raw").read_text(encoding="utf-8")
    ids = AutoTokenizer.from_pretrained(tiny_llama)(text)["input_ids"][:192]
    ids = torch.tensor(ids).reshape(2, 96)
    with torch.no_grad():
        a, b = ref(ids).logits, deq(ids).logits
    rel = float((a - b).pow(2).sum() / a.pow(2).sum())
    print(method, "logit rel err", rel)
    assert rel < 0.3


@pytest.mark.parametrize("method,fmt", [("rtn", "compressed-tensors"), ("gptq", "gptq"),
                                        ("awq", "awq")])
def test_engine_loads_checkpoint_greedy_matches(tiny_llama: Path, results: dict, method: str,
                                                fmt: str) -> None:
    """Our engine serves the written checkpoint with the same greedy tokens as HF transformers
    running the independently unpacked (dequantized fp32) weights."""
    from transformers import AutoModelForCausalLM

    from llmaccel.engine import SamplingParams
    from llmaccel.engine.llm import LLM
    d, _ = results[method]
    deq = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    deq.load_state_dict(_dequantized_state(d, fmt), strict=False)
    prompt = list(range(5, 21))
    with torch.no_grad():
        ref = deq.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)
    llm = LLM(str(d), device="cpu", dtype="float32")
    out = llm.generate([{"prompt_token_ids": prompt}],
                       SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    assert list(out[0].outputs[0].token_ids) == ref[0, len(prompt):].tolist()


def test_transformers_loads_our_pack_quantized_checkpoint(tiny_llama: Path, results: dict
                                                          ) -> None:
    """HF transformers (with the compressed-tensors package, as llm-compressor's users run it)
    loads our RTN int4 pack-quantized checkpoint unchanged: its decompressed weights are the
    ones our independent unpacker reads, and the logits agree."""
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    d, _ = results["rtn"]
    # run_compressed=False: decompress to dense weights (the compressed kernels need a GPU)
    theirs = AutoModelForCausalLM.from_pretrained(
        d, dtype=torch.float32,
        quantization_config=CompressedTensorsConfig(run_compressed=False)).eval()
    ours = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    ours.load_state_dict(_dequantized_state(d, "compressed-tensors"), strict=False)
    for name in ("self_attn.q_proj", "mlp.down_proj"):
        a = theirs.model.layers[1].get_submodule(name).weight.data
        b = ours.model.layers[1].get_submodule(name).weight.data
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    ids = torch.tensor([list(range(5, 37))])
    with torch.no_grad():
        torch.testing.assert_close(theirs(ids).logits, ours(ids).logits, rtol=0, atol=1e-4)


@pytest.mark.parametrize("method,tied", [("gptq", False), ("rtn", True)])
def test_lm_head_quantized(tiny_llama: Path, tmp_path: Path, method: str, tied: bool) -> None:
    """--lm-head (GPTQ format): the head is packed as `lm_head.*` with `lm_head: true` and the
    config untied (the embedding keeps the plain table); our engine serves it with the greedy
    tokens of HF transformers on the independently unpacked weights, head included."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from llmaccel.engine import SamplingParams
    from llmaccel.engine.llm import LLM

    src = tiny_llama
    if tied:
        src = tmp_path / "tied"
        make_tiny_model(LlamaConfig(**{**CONFIG, "tie_word_embeddings": True}), src, seed=1)
        _tiny_tokenizer(src)
    d = tmp_path / "q"
    quantize_model(src, method=method, bits=4, group_size=128, format="gptq", out_dir=d,
                   calib=CalibConfig(DATA, n_samples=4, seq_len=64, seed=0),
                   device="cpu", show_progress=False, lm_head=True)
    config = json.loads((d / "config.json").read_text())
    assert config["quantization_config"]["lm_head"] is True
    assert config["tie_word_embeddings"] is False
    t = _tensors(d)
    assert "lm_head.qweight" in t and "lm_head.weight" not in t
    assert t["model.embed_tokens.weight"].is_floating_point()
    state = _dequantized_state(d, "gptq")
    hf_config = AutoConfig.from_pretrained(src)
    hf_config.tie_word_embeddings = False
    deq = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).eval()
    missing, unexpected = deq.load_state_dict(state, strict=False)
    assert not unexpected and not [m for m in missing if "rotary" not in m]
    head = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).lm_head.weight
    assert not torch.equal(deq.lm_head.weight, head)  # the head really was quantized
    prompt = list(range(5, 21))
    with torch.no_grad():
        ref = deq.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)
    llm = LLM(str(d), device="cpu", dtype="float32")
    lm_head = llm.engine.runner.model.lm_head
    assert type(lm_head.quant_method).__name__ == "GPTQLinearMethod"
    out = llm.generate([{"prompt_token_ids": prompt}],
                       SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    assert list(out[0].outputs[0].token_ids) == ref[0, len(prompt):].tolist()


def test_lm_head_needs_the_gptq_format(tiny_llama: Path, tmp_path: Path) -> None:
    from llmaccel.errors import QuantizationError

    with pytest.raises(QuantizationError, match="lm-head"):
        quantize_model(tiny_llama, method="awq", bits=4, group_size=128, out_dir=tmp_path,
                       device="cpu", show_progress=False, lm_head=True)
