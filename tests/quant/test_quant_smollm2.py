"""A real model quantized end to end: SmolLM2-135M-Instruct (from ../shared/models/fetch) through
`quantize_model` with GPTQ int4 (group 64: its 576-wide hidden size is not a multiple of 128) on
generated English-like calibration text, then our engine on the packed checkpoint against transformers on
the same weights dequantized by a decoder written here from the GPTQ format's definition."""

from __future__ import annotations


import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from llmaccel import LLM, SamplingParams
from llmaccel.models.convert import gguf_to_hf_dir
from llmaccel.quant.calibration import CalibConfig
from llmaccel.quant.driver import quantize_model

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at",
           "Once upon a time, in a small village,"]
NEW_TOKENS = 12


def decode_gptq_v1(t: dict[str, torch.Tensor], prefix: str, bits: int = 4) -> torch.Tensor:
    """W [out, in] = (code - (stored zero + 1)) * scale[g_idx[i]]; qweight packs `32/bits`
    input rows per int32 (lowest bits = first row), qzeros packs output columns the same way."""
    pf, mask = 32 // bits, (1 << bits) - 1
    qweight = t[f"{prefix}.qweight"].to(torch.int64) & 0xFFFFFFFF  # [in/pf, out]
    qzeros = t[f"{prefix}.qzeros"].to(torch.int64) & 0xFFFFFFFF    # [G, out/pf]
    scales, g_idx = t[f"{prefix}.scales"].double(), t[f"{prefix}.g_idx"].long()
    shifts = torch.arange(pf) * bits
    codes = ((qweight[:, None, :] >> shifts[None, :, None]) & mask).reshape(-1, qweight.shape[1])
    zeros = ((qzeros[:, :, None] >> shifts[None, None, :]) & mask).reshape(qzeros.shape[0], -1)
    w = (codes - (zeros[g_idx] + 1)) * scales[g_idx]  # [in, out]
    return w.t().float()


@pytest.fixture(scope="module")
def smollm2_dirs(smollm2_gguf, tmp_path_factory, wikitext_dir):
    src = tmp_path_factory.mktemp("smollm2-hf")
    _, tok = gguf_to_hf_dir(smollm2_gguf, src)
    out = tmp_path_factory.mktemp("smollm2-gptq")
    report = quantize_model(src, method="gptq", bits=4, group_size=64, out_dir=out,
                            calib=CalibConfig(str(wikitext_dir), n_samples=8, seq_len=128),
                            device="cpu", show_progress=False)
    return src, out, report, tok


def test_gptq_beats_rtn_on_smollm2(smollm2_dirs):
    """GPTQ's per-layer output error on the calibration activations is below RTN's (the
    driver measures both on the same inputs)."""
    _, _, report, _ = smollm2_dirs
    gptq, rtn = report.layer_error, report.layer_error_rtn
    assert len(gptq) == len(rtn) == 30
    assert sum(gptq) < sum(rtn)


def test_engine_greedy_equals_dequantized_reference(smollm2_dirs, tmp_path):
    src, out, _, tok = smollm2_dirs
    packed = load_file(str(out / "model.safetensors"))
    ref = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
    n = 0
    with torch.no_grad():
        for name, module in ref.named_modules():
            if isinstance(module, torch.nn.Linear) and f"{name}.qweight" in packed:
                module.weight.copy_(decode_gptq_v1(packed, name))
                n += 1
    assert n == 30 * 7
    llm = LLM(str(out), dtype="float32", device="cpu", enable_prefix_caching=True)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=NEW_TOKENS,
                                                ignore_eos=True), use_tqdm=False)
    for prompt, o in zip(PROMPTS, outs):
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            want = ref.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False,
                                min_new_tokens=NEW_TOKENS)[0, ids.shape[1]:].tolist()
        assert o.outputs[0].token_ids == want, prompt
