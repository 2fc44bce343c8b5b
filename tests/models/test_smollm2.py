"""The real SmolLM2-135M-Instruct (GGUF, through ../shared/models/fetch) against transformers."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from llmaccel import LLM, SamplingParams
from llmaccel.models.tokenizer import format_prompt

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "What are the three laws of thermodynamics?",
]


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf):
    llm = LLM(str(smollm2_gguf), dtype="float32", device="cpu", enable_prefix_caching=False)
    mc, tok = llm.engine.model_config, llm.get_tokenizer()
    hf = AutoModelForCausalLM.from_pretrained(str(smollm2_gguf.parent),
                                              gguf_file=smollm2_gguf.name,
                                              dtype=torch.float32).eval()
    return mc, llm, tok, hf


def test_config_and_tokenizer_from_gguf(smollm2):
    mc, model, tok, _ = smollm2
    assert mc.architecture == "LlamaForCausalLM"
    assert (mc.num_layers, mc.num_kv_heads, mc.head_dim) == (30, 3, 64)
    assert tok.decode(tok("Hello world").input_ids) .endswith("Hello world")
    assert "<|im_start|>" in tok.decode(format_prompt(tok, "hi", chat=True))


def test_greedy_continuations_equal_transformers(smollm2):
    """32 greedy tokens for 4 prompts of different lengths, generated as one batch by us and
    one prompt at a time by transformers, token for token (EOS ignored on both sides)."""
    _, llm, tok, hf = smollm2
    ids = [tok(p).input_ids for p in PROMPTS[:3]] + [format_prompt(tok, PROMPTS[3], chat=True)]
    outs = llm.generate(ids, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    ours = [o.outputs[0].token_ids for o in outs]
    for prompt_ids, our_tokens in zip(ids, ours):
        # eos_token_id=[]: run all 32 steps, as ignore_eos does
        theirs = hf.generate(torch.tensor([prompt_ids]), max_new_tokens=32, do_sample=False,
                             eos_token_id=[], pad_token_id=0)[0, len(prompt_ids):].tolist()
        assert len(our_tokens) == 32
        assert our_tokens == theirs, (tok.decode(our_tokens), tok.decode(theirs))


def test_generation_stops_at_eos(smollm2):
    mc, llm, tok, _ = smollm2
    from llmaccel.models.tokenizer import eos_token_ids
    eos = eos_token_ids(mc, tok)
    out = llm.chat([{"role": "user", "content": "Say hi."}],
                   SamplingParams(temperature=0, max_tokens=200))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason is None
    assert out.token_ids[-1] in eos and all(t not in eos for t in out.token_ids[:-1])
    assert out.text == tok.decode(out.token_ids, skip_special_tokens=True)


def test_stop_strings_and_min_tokens(smollm2):
    _, llm, tok, _ = smollm2
    prompt = [{"role": "user", "content": "Count from 1 to 20, separated by commas."}]
    full = llm.chat(prompt, SamplingParams(temperature=0, max_tokens=40))[0].outputs[0]
    assert "5" in full.text
    cut = llm.chat(prompt, SamplingParams(temperature=0, max_tokens=40, stop=["5"]))[0]
    cut = cut.outputs[0]
    assert cut.text == full.text[:full.text.index("5")]
    assert (cut.finish_reason, cut.stop_reason) == ("stop", "5")
    kept = llm.chat(prompt, SamplingParams(temperature=0, max_tokens=40, stop="5",
                                           include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == full.text[:full.text.index("5") + 1]
    short = llm.chat([{"role": "user", "content": "Say hi."}],
                     SamplingParams(temperature=0, max_tokens=200))[0].outputs[0]
    longer = llm.chat([{"role": "user", "content": "Say hi."}],
                      SamplingParams(temperature=0, max_tokens=200,
                                     min_tokens=len(short.token_ids) + 5))[0].outputs[0]
    assert len(longer.token_ids) >= len(short.token_ids) + 5
    assert longer.token_ids[:len(short.token_ids) - 1] == short.token_ids[:-1]
