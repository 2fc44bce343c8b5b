"""The real target/draft pair on CPU: Qwen2.5-Coder-0.5B drafting for Qwen2.5-Coder-1.5B
(one tokenizer, ../shared/models/fetch), greedy output identical with and without speculation,
and the draft accepted more often than not on code. Slow (two GGUF dequantizations and a 1.5B
model in fp32 on the CPU, a few minutes): `pytest -m slow`."""

from __future__ import annotations

import pytest
from conftest import fetch_model

from llmaccel import LLM, SamplingParams

PROMPTS = ['def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
           "# Python: read a CSV file and print the sum of the second column\nimport csv\n",
           "The capital of France is"]


@pytest.mark.slow
def test_qwen_coder_pair_greedy_is_lossless():
    target = str(fetch_model("qwen2.5-coder-1.5b-instruct"))
    draft = str(fetch_model("qwen2.5-coder-0.5b-instruct"))
    kw = {"dtype": "float32", "device": "cpu", "max_model_len": 2048}
    params = SamplingParams(temperature=0, max_tokens=24)
    plain = [o.outputs[0].token_ids
             for o in LLM(target, **kw).generate(PROMPTS, params, use_tqdm=False)]
    llm = LLM(target, speculative_config={"method": "draft", "model": draft,
                                          "num_speculative_tokens": 4}, **kw)
    spec = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in spec] == plain
    stats = llm.get_stats().spec_decode
    print("Qwen2.5-Coder 0.5B -> 1.5B:", stats)
    assert stats["acceptance_rate"] > 0.5
    assert spec[0].metrics.spec_decode["num_accepted_tokens"] > 0
