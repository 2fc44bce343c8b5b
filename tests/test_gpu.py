"""GPU checks (run on the device machine: `pytest -m gpu`); CI has no GPU and skips them."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from llmaccel import LLM, SamplingParams
from llmaccel.models.attention import AttentionMetadata
from llmaccel.models.loader import load_model
from llmaccel.models.shapes import SHAPES
from engine_matrix import MODES, check_mode, hf_greedy, random_workload, run_engine
from tiny_models import make_tiny_model, tiny_configs

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("name", list(tiny_configs()))
def test_logits_match_transformers_on_gpu(name, tmp_path):
    hf = make_tiny_model(tiny_configs()[name], tmp_path).cuda()
    _, ours = load_model(str(tmp_path), dtype="float32", device="cuda")
    lens = [5, 17, 1]
    seqs = [torch.randint(0, hf.config.vocab_size, (n,), device="cuda") for n in lens]
    meta = AttentionMetadata.for_prefill(lens, "cuda")
    pos = torch.cat([torch.arange(n, device="cuda") for n in lens])
    with torch.no_grad():
        got = ours.compute_logits(ours(torch.cat(seqs), pos, meta))
        want = torch.cat([hf(s[None]).logits[0] for s in seqs])
    torch.testing.assert_close(got, want, atol=2e-4, rtol=0)


def test_bf16_load_has_no_fp32_copy(tmp_path):
    """An fp32 checkpoint loaded as bf16 on the GPU: the peak GPU memory stays near the bf16
    weights plus one fp32 tensor in flight, never a whole fp32 model."""
    from llmaccel.models.config import make_model_config
    hf_config = make_model_config("smollm2-135m").hf_config
    with torch.device("cpu"):
        AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).save_pretrained(tmp_path)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    _, model = load_model(str(tmp_path), dtype="bfloat16", device="cuda")
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    largest_fp32 = max(p.numel() for p in model.parameters()) * 4
    rope = model.model.layers[0].self_attn.rotary_emb.cos_sin_cache
    peak = torch.cuda.max_memory_allocated() - base
    assert peak <= weights + largest_fp32 + rope.numel() * 4 * 2 + (64 << 20), (peak, weights)


@pytest.mark.parametrize("shape", ["llama-3.2-1b", "qwen2.5-1.5b"])
def test_dummy_shape_generates_on_gpu(shape):
    llm = LLM(shape, dtype="bfloat16", device="cuda", max_model_len=4096)
    outs = llm.generate([[1, 2, 3, 4], [5, 6]],
                        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    out = [o.outputs[0].token_ids for o in outs]
    assert [len(o) for o in out] == [8, 8]
    assert all(0 <= t < SHAPES[shape]["vocab_size"] for o in out for t in o)
    stats = llm.get_stats()
    assert stats.num_blocks * 16 >= 4096 and llm.engine.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("mode", list(MODES))
def test_engine_matches_transformers_on_gpu(mode, tmp_path):
    hf = make_tiny_model(tiny_configs()["llama3-rope"], tmp_path).cuda()
    prompts, max_tokens = random_workload(hf.config.vocab_size, seed=3)
    expected = hf_greedy(hf, prompts, max_tokens)
    llm, got = run_engine(str(tmp_path), mode, prompts, max_tokens, device="cuda",
                          skip_tokenizer_init=True)
    assert got == expected
    check_mode(llm, mode)
