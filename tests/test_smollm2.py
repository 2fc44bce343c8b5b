"""The real SmolLM2-135M-Instruct (GGUF, through ../shared/models/fetch) against transformers."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from llmaccel.engine import SamplingParams
from llmaccel.engine.simple_runner import generate_tokens
from llmaccel.models.loader import load_model
from llmaccel.models.tokenizer import format_prompt, get_tokenizer

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "What are the three laws of thermodynamics?",
]


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf):
    mc, model = load_model(str(smollm2_gguf), dtype="float32", device="cpu")
    tok = get_tokenizer(mc)
    hf = AutoModelForCausalLM.from_pretrained(str(smollm2_gguf.parent),
                                              gguf_file=smollm2_gguf.name,
                                              dtype=torch.float32).eval()
    return mc, model, tok, hf


def test_config_and_tokenizer_from_gguf(smollm2):
    mc, model, tok, _ = smollm2
    assert mc.architecture == "LlamaForCausalLM"
    assert (mc.num_layers, mc.num_kv_heads, mc.head_dim) == (30, 3, 64)
    assert tok.decode(tok("Hello world").input_ids) .endswith("Hello world")
    assert "<|im_start|>" in tok.decode(format_prompt(tok, "hi", chat=True))


def test_greedy_continuations_equal_transformers(smollm2):
    """32 greedy tokens for 4 prompts of different lengths, generated as one batch by us and
    one prompt at a time by transformers, token for token (EOS ignored on both sides)."""
    _, model, tok, hf = smollm2
    ids = [tok(p).input_ids for p in PROMPTS[:3]] + [format_prompt(tok, PROMPTS[3], chat=True)]
    ours = generate_tokens(model, ids, SamplingParams(temperature=0, max_tokens=32,
                                                      ignore_eos=True))
    for prompt_ids, our_tokens in zip(ids, ours):
        # eos_token_id=[]: run all 32 steps, as ignore_eos does
        theirs = hf.generate(torch.tensor([prompt_ids]), max_new_tokens=32, do_sample=False,
                             eos_token_id=[], pad_token_id=0)[0, len(prompt_ids):].tolist()
        assert len(our_tokens) == 32
        assert our_tokens == theirs, (tok.decode(our_tokens), tok.decode(theirs))


def test_generation_stops_at_eos(smollm2):
    mc, model, tok, _ = smollm2
    from llmaccel.models.tokenizer import eos_token_ids
    eos = eos_token_ids(mc, tok)
    out = generate_tokens(model, [format_prompt(tok, "Say hi.", chat=True)],
                          SamplingParams(temperature=0, max_tokens=200), eos)[0]
    assert out[-1] in eos and all(t not in eos for t in out[:-1])
